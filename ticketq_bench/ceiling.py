"""The linear-layer ceiling beside a mode's tokens/s, in the same run: how much of the GEMMs' speed
a whole forward keeps.

After each round of an engine mode the bench times the engine's own first decoder layer's seven
linear layers (q, k, v, o, gate, up, down: the modules it serves with, prepacked, bf16 or int8 as
they are) on M random rows, M the round's mean tokens per forward, best of three, and scales it
to the whole decoder: the tokens/s at which the linear layers alone would take all the time.
The round's tokens/s divided by it is the share a forward keeps after attention, norms, rotary,
the cache and Python. `docs/bench/gemm_ceiling.py` is the same measure on fresh weights per
kernel and dtype.
"""

from __future__ import annotations

import statistics
import time

import torch

NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def linear_ceiling(engine, rows: int, repeats: int = 3) -> float | None:
    """Tokens/s of the engine's decoder linear layers alone at M = `rows`; None for a decoder
    whose layers are not Llama/Qwen2-shaped."""
    layers = getattr(engine.decoder, "layers", None)
    try:
        modules = [layers[0].get_submodule(name) for name in NAMES]
    except (AttributeError, TypeError, IndexError):
        return None
    hidden, inner = engine.model.config.hidden_size, engine.model.config.intermediate_size
    x = torch.randn(rows, hidden, device=engine.device).to(engine.dtype)  # (M, hidden)
    h = torch.randn(rows, inner, device=engine.device).to(engine.dtype)  # (M, intermediate): down_proj's input

    def layer() -> None:
        for module in modules[:-1]:
            module(x)
        modules[-1](h)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        layer()  # warm-up: a new M builds its oneDNN primitives
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            layer()
            best = min(best, time.perf_counter() - started)
    return rows / (best * len(layers))


def ceiling_note(mode: str, rows: int, shares: list[float]) -> str:
    """The line under the table: each round's share of the ceiling and their median."""
    each = ", ".join(f"{share:.0%}" for share in shares)
    return (f"{mode}: tokens/s against the linear-layer ceiling timed after each round (the engine's own "
            f"linear layers at M = {rows} rows): {each} (median {statistics.median(shares):.0%})")  # fmt: skip
