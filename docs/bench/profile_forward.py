"""Where one forward's time goes: torch.profiler over typical ticketq batches, and per-token speed on
single-sequence shapes (against llama.cpp in float32).

    .venv/bin/python docs/bench/profile_forward.py models/qwen2.5-0.5b-standin 200 1 > docs/bench/cpu-peers-profile.txt
    .venv/bin/python docs/bench/profile_forward.py models/qwen2.5-0.5b-standin 200 2 --dtype bfloat16 \\
        --batch 16x64 --batch 8x128 --ceiling

(model directory, tickets to plan over, torch threads). `--dtype float32` (the default) profiles
float32 and int8 (`TICKETQ_DTYPE=int8`), `--dtype bfloat16` the bfloat16 engine. The batch is the
median padded size of the default plan over the tickets, and each `--batch ROWSxWIDTH` besides (the
rows are the typical batch's tickets, cycled, each repeated or cut to WIDTH tokens: no padding).

Every op inside `Engine.forward_batch` is charged, by its self CPU time, to the innermost tagged
region around it: the linear layers (`nn.Linear`, oneDNN-packed or dynamic int8), RMSNorm, rotary
(the cos/sin table, and applying it to q and k), attention (transformers' SDPA wrapper: the SDPA
kernel itself, and `repeat_kv`'s copies of K/V for the 14 query heads), the KV cache (`DynamicLayer.
update`: each layer's new K/V concatenated after the prefix), the MLP's silu and product, the
residual adds, the 4D mask (`layout.prefix_mask`, and transformers' `create_causal_mask`, which returns it
as is), the label head; ops outside every region are "batch set-up and gathers" (ids, positions, the
prefix cache's views, each row's last hidden state). The split is the fastest profiled forward's, as shares of
its wall time; "python, dispatch and the profiler" is the part of it no op accounts for (the
profiler's own cost included: compare the profiled wall time with the unprofiled one). The tokens/s
are the fastest unprofiled forward's. Unprofiled and profiled forwards alternate, `--reps` of each.

`--ceiling` times, right after each unprofiled forward, the linear-layer ceiling of the same dtype
at M = the batch's rows x width (`docs/bench/gemm_ceiling.py`'s kernels, the fastest), and prints
the forward's tokens/s against it, round by round: a ratio measured side by side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from producer.synthetic import generate_tickets
from worker.engine import Engine
from worker.engine.prompt import EncodedTicket
from worker.engine.replicas import load_engine, with_int8
from worker.settings import Settings

TAG = "ticketq::"
MODULE_TAGS = {  # module class name -> the region its forward is
    "Linear": "linear layers", "PackedLinear": "linear layers", "FullRangeDynamicLinear": "linear layers",
    "Qwen2RMSNorm": "RMSNorm", "Qwen2RotaryEmbedding": "rotary", "Embedding": "embedding",
    "Qwen2MLP": "MLP silu and product", "SiLUActivation": "MLP silu and product",
    "Qwen2Attention": "attention: reshapes around it", "Qwen2DecoderLayer": "residual adds",
    "Qwen2Model": "decoder, outside the layers",
}  # fmt: skip
SDPA_KERNEL = ("scaled_dot_product", "flash_attention", "efficient_attention", "softmax")


def linear_params(config) -> int:
    """Weights in the decoder's linear layers (q, k, v, o, gate, up, down of every layer)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or hidden // config.num_attention_heads)
    return config.num_hidden_layers * (2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * inter)


def typical_batch(engine: Engine, texts: list[str]) -> tuple[list[EncodedTicket], int]:
    encoded = engine.encode(texts)
    plan = engine.plan(encoded)
    batches = sorted(plan.batches, key=lambda b: b.rows * b.width)
    batch = batches[len(batches) // 2]
    return [encoded[i] for i in batch.indices], batch.width


def shaped_batch(pool: list[EncodedTicket], rows: int, width: int, pad: int) -> list[EncodedTicket]:
    """`rows` tickets of exactly `width` tokens each: `pool`'s, cycled, cut or padded with `pad`."""
    out = []
    for i in range(rows):
        ids = pool[i % len(pool)].ids
        ids = (ids * (width // len(ids) + 1))[:width] if len(ids) < width else ids[:width]
        out.append(EncodedTicket(ids=tuple(ids) or (pad,) * width, ticket_tokens=width, truncated=False))
    return out


def _traced(fn: Callable, name: str) -> Callable:
    def traced(*args, **kwargs):
        with record_function(TAG + name):
            return fn(*args, **kwargs)

    return traced


@contextmanager
def tagged(engine: Engine) -> Iterator[None]:
    """Profiler regions around the decoder's modules and the functions named in the module docstring."""
    from transformers import cache_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen2 import modeling_qwen2

    from worker.engine import model as engine_model

    modules = [m for m in engine.decoder.modules() if type(m).__name__ in MODULE_TAGS]
    if type(engine.decoder).__name__ != "Qwen2Model" or not any(
        type(m).__name__.endswith("Linear") for m in modules
    ):
        raise SystemExit(f"profile_forward.py knows Qwen2 decoders only, got {type(engine.decoder).__name__}")
    for module in modules:
        module.forward = _traced(module.forward, MODULE_TAGS[type(module).__name__])
    patched = [  # (owner, attribute, original)
        (modeling_qwen2, "apply_rotary_pos_emb", modeling_qwen2.apply_rotary_pos_emb),
        (modeling_qwen2, "create_causal_mask", modeling_qwen2.create_causal_mask),
        (cache_utils.DynamicLayer, "update", cache_utils.DynamicLayer.update),
        (engine_model, "prefix_mask", engine_model.prefix_mask),
        (engine_model, "branch_logprobs", engine_model.branch_logprobs),
    ]
    names = ("rotary", "mask", "KV cache update", "mask", "label head")
    for (owner, attr, _), name in zip(patched, names, strict=True):
        setattr(owner, attr, _traced(getattr(owner, attr), name))
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _traced(sdpa, "attention")
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]  # the local override only: the registered one is back
        for owner, attr, original in patched:
            if original is None:
                delattr(owner, attr)  # the instance attribute: the class's method is back
            else:
                setattr(owner, attr, original)
        for module in modules:
            del module.forward


def _region(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(TAG):
        parent = parent.cpu_parent
    return parent.name.removeprefix(TAG) if parent is not None else None


def charge(events) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Seconds of op self time per region (see the module docstring), and per region per op name."""
    got: dict[str, float] = defaultdict(float)
    ops: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        if event.name.startswith(TAG):
            continue
        region = _region(event) or "batch set-up and gathers"
        if region == "attention":
            kernel = any(k in event.name for k in SDPA_KERNEL)
            region = "attention: SDPA kernel" if kernel else "attention: repeat_kv and copies"
        got[region] += event.self_cpu_time_total / 1e6
        ops[region][event.name] += event.self_cpu_time_total / 1e6
    return got, ops


def linear_ceiling(dtype: str, tokens: int) -> Callable[[], float]:
    """A timer of the linear ceiling at M = `tokens` rows: `docs/bench/gemm_ceiling.py`'s kernels of
    `dtype`, one decoder layer's seven GEMMs each, the fastest, as tokens/s of the whole decoder."""
    import gemm_ceiling  # beside this script

    found = gemm_ceiling.kernels([dtype])

    def tokens_s() -> float:
        best = min(gemm_ceiling.time_layer(modules, tokens, act, 2) for _, _, act, modules in found)
        return tokens / (best * gemm_ceiling.LAYERS)

    return tokens_s


def gemm_params() -> int:
    import gemm_ceiling  # beside this script

    return gemm_ceiling.MODEL_PARAMS


def breakdown(engine: Engine, rows: list[EncodedTicket], width: int, reps: int, ceiling: str | None) -> dict:
    """Unprofiled forwards (each followed by the linear ceiling at the same M, when `ceiling` names a
    dtype) alternating with profiled ones; the wall time is the fastest unprofiled forward, the split
    the fastest profiled one's."""
    tokens = len(rows) * width
    ceiling_s = linear_ceiling(ceiling, tokens) if ceiling else None
    engine.forward_batch(rows, width=width)  # warm-up
    walls, profiled, ratios, ceilings = [], [], [], []
    for _ in range(reps):
        start = time.perf_counter()
        engine.forward_batch(rows, width=width)
        walls.append(time.perf_counter() - start)
        if ceiling_s:
            ceilings.append(ceiling_s())
            ratios.append(tokens / walls[-1] / ceilings[-1])
        with tagged(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.forward_batch(rows, width=width)
            seconds = time.perf_counter() - start
        profiled.append((seconds, *charge(prof.events())))  # the events exist once the profiler stopped
    wall = min(walls)
    wall_profiled, got, ops = min(profiled, key=lambda p: p[0])
    out = dict(got)
    out["python, dispatch and the profiler"] = max(0.0, wall_profiled - sum(got.values()))
    return {"wall": wall, "walls": walls, "wall profiled": wall_profiled, "regions": out, "ops": ops,
            "ceilings": ceilings, "ratios": ratios}  # fmt: skip


def report(name: str, got: dict, rows: int, width: int, params: int) -> None:
    wall, regions, profiled = got["wall"], got["regions"], got["wall profiled"]
    tokens = rows * width
    walls = ", ".join(f"{w * 1e3:.0f}" for w in got["walls"])
    print(f"\n{name}, {rows} rows x {width}: {wall * 1e3:.0f} ms per forward (fastest of {walls} ms), "
          f"{tokens / wall:.0f} padded tokens/s; the fastest profiled forward, {profiled * 1e3:.0f} ms:")  # fmt: skip
    for key, seconds in sorted(regions.items(), key=lambda kv: -kv[1]):
        top = sorted(got["ops"].get(key, {}).items(), key=lambda kv: -kv[1])[:3]
        names = ", ".join(f"{op} {t * 1e3:.0f}" for op, t in top if t >= 5e-4)
        print(f"  {key:<34} {seconds * 1e3:7.1f} ms  {seconds / profiled:6.1%}" + (f"  ({names})" if names else ""))
    linear = regions.get("linear layers", 0.0)
    if linear:
        print(f"  linear layers inside the forward: {2 * tokens * params / linear / 1e9:.0f} GFLOPS")
    if got["ratios"]:
        ceilings = ", ".join(f"{c:.0f}" for c in got["ceilings"])
        ratios = ", ".join(f"{r:.0%}" for r in got["ratios"])
        print(f"  linear ceiling at M={tokens} beside each forward: {ceilings} tokens/s; the forward's tokens/s "
              f"against it: {ratios} (median {statistics.median(got['ratios']):.0%})")  # fmt: skip


def single_sequence(engines: dict[str, Engine], model: str) -> None:
    engine = next(iter(engines.values()))
    print("\nsingle sequence after the cached prefix, tokens/s (best of 3):")
    token = engine.prompt.encode("hello").ids[0]
    for w in (32, 74, 128):
        row = EncodedTicket(ids=(token,) * w, ticket_tokens=w, truncated=False)
        line = []
        for name, eng in engines.items():
            eng.forward_batch([row])
            best = min(_timed(lambda e=eng, r=row: e.forward_batch([r])) for _ in range(3))
            line.append(f"ticketq {name} {w / best:.0f}")
        if engine.dtype == torch.float32:
            rate = llama_cpp_rate(engine, w, model)
            line.append(f"llama.cpp f32 {rate:.0f}" if rate else "llama.cpp not installed")
        print(f"  width {w}: " + ", ".join(line))


def llama_cpp_rate(engine: Engine, width: int, model: str) -> float | None:
    try:
        from ticketq_bench.llama_cpp_peer import LlamaCppScorer, gguf_model
        from ticketq_bench.peers import PeerUnavailable
    except ImportError:
        return None
    try:
        path = gguf_model(Path(model), "f32", Path("out"))
    except PeerUnavailable:
        return None
    scorer = LlamaCppScorer(path, engine.prompt, threads=torch.get_num_threads(), n_ctx=1024)
    token = engine.prompt.encode("hello").ids[0]
    ids = [token] * width
    scorer._eval(scorer.prefix_len, ids)  # warm-up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        scorer._eval(scorer.prefix_len, ids)
        scorer._choice([0, 1])
        best = min(best, time.perf_counter() - start)
    return width / best


def batch_shape(text: str) -> tuple[int, int]:
    """`--batch ROWSxWIDTH` as (rows, width); bf16_packed_ab.py takes the same option."""
    rows, _, width = text.lower().partition("x")
    return int(rows), int(width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("tickets", nargs="?", type=int, default=200, help="tickets to plan the typical batch over")
    parser.add_argument("threads", nargs="?", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="float32: float32 and int8; bfloat16: the bfloat16 engine")  # fmt: skip
    parser.add_argument("--batch", type=batch_shape, action="append", default=[], metavar="ROWSxWIDTH",
                        help="a batch shape to profile besides the typical one (repeatable)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="forwards timed, and profiled, per batch (medians)")
    parser.add_argument("--ceiling", action="store_true",
                        help="time the linear ceiling at each batch's M beside each forward")  # fmt: skip
    args = parser.parse_args()
    settings = Settings(model=args.model, dtype=args.dtype, device="cpu", threads=args.threads)
    engine = load_engine(settings)
    engines = {args.dtype: engine}
    if args.dtype == "float32":
        engines["int8"] = with_int8(engine)
    texts = [t["text"] for t in generate_tickets(args.tickets, seed=0)]
    rows, width = typical_batch(engine, texts)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    attention = engine.model.config._attn_implementation
    print(f"load average {load}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"dtype {engine.info.dtype}, matmul {engine.info.matmul}, attention {attention}")  # fmt: skip
    print(f"typical batch (median padded size of the default plan over {args.tickets} tickets): "
          f"{len(rows)} rows x {width}, after a cached prefix of {engine.prefix_len}")  # fmt: skip
    params = linear_params(engine.model.config)
    ceiling = args.ceiling and params == gemm_params()
    if args.ceiling and not ceiling:
        print("--ceiling: gemm_ceiling.py times Qwen2.5-0.5B's shapes, not this model's: no ceiling")
    shapes = [(rows, width)] + [(shaped_batch(rows, r, w, engine.pad_id), w) for r, w in args.batch]
    for batch, w in shapes:
        for name, eng in engines.items():
            dtype = "int8" if name == "int8" else args.dtype
            got = breakdown(eng, batch, w, args.reps, dtype if ceiling else None)
            report(name, got, len(batch), w, params)
    single_sequence(engines, args.model)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
