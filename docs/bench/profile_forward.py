"""Where one forward's time goes: torch.profiler over a typical ticketq batch, float32 and int8,
and per-token speed against llama.cpp on the same single-sequence shapes.

    .venv/bin/python docs/bench/profile_forward.py models/qwen2.5-0.5b-standin 200 1 > docs/bench/cpu-peers-profile.txt

(model directory, tickets to plan over, torch threads).

Categories (self CPU time of the ops inside `Engine.forward_batch`): linear layers (aten mm/addmm/
linear, quantized::linear_dynamic and its activation quantisation), attention (sdpa and its
kernels), the 4D mask (`Engine._mask`), other tensor ops (norms, rotary, activations, copies);
"Python and dispatch" is the wall time no op accounts for.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from producer.synthetic import generate_tickets
from worker.engine import Engine
from worker.settings import Settings

LINEAR = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "quantized::linear_dynamic",
          "aten::_weight_int8pack_mm", "aten::quantize_per_tensor_dynamic", "aten::bmm")  # fmt: skip
ATTENTION = ("scaled_dot_product", "_flash_attention", "_efficient_attention", "aten::softmax", "aten::_softmax")


def typical_batch(engine: Engine, texts: list[str]):
    encoded = engine.encode(texts)
    plan = engine.plan(encoded)
    batches = sorted(plan.batches, key=lambda b: b.rows * b.width)
    batch = batches[len(batches) // 2]
    return [encoded[i] for i in batch.indices], batch.width


def breakdown(engine: Engine, rows, width: int, reps: int = 3) -> dict[str, float]:
    original_mask = engine._mask

    def traced_mask(*args, **kwargs):
        with record_function("ticketq::mask"):
            return original_mask(*args, **kwargs)

    engine._mask = traced_mask
    engine.forward_batch(rows, width=width)  # warm-up
    walls, shares = [], defaultdict(list)
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            engine.forward_batch(rows, width=width)
            wall = time.perf_counter() - start
        walls.append(wall)
        got = defaultdict(float)
        for event in prof.key_averages():
            us = event.self_cpu_time_total
            name = event.key
            if name == "ticketq::mask":
                got["mask"] += event.cpu_time_total
            elif any(k in name for k in LINEAR):
                got["linear"] += us
            elif any(k in name for k in ATTENTION):
                got["attention"] += us
            elif name.startswith(("aten::", "quantized::")):
                got["other ops"] += us
        mask_self = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "ticketq::mask")
        got["other ops"] -= got["mask"] - mask_self  # ops inside the mask counted once, as mask
        for key, us in got.items():
            shares[key].append(us / 1e6)
    engine._mask = original_mask
    wall = statistics.median(walls)
    out = {key: statistics.median(values) for key, values in shares.items()}
    out["python and dispatch"] = max(0.0, wall - sum(out.values()))
    out["wall"] = wall
    return out


def llama_cpp_rate(engine: Engine, width: int) -> float | None:
    try:
        from worker.tools.peers import LlamaCppScorer, PeerUnavailable, gguf_model
    except ImportError:
        return None
    from pathlib import Path

    try:
        path = gguf_model(Path(sys.argv[1]), "f32", Path("out"))
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


def main() -> None:
    model, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
    engine = Engine.from_settings(Settings(model=model, dtype="float32", device="cpu", threads=threads))
    int8 = engine.with_int8()
    texts = [t["text"] for t in generate_tickets(n, seed=0)]
    rows, width = typical_batch(engine, texts)
    print(f"load average {os.getloadavg()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"typical batch (median padded size of the default plan over {n} tickets): {len(rows)} rows x {width}")
    for name, eng in (("float32", engine), ("int8", int8)):
        got = breakdown(eng, rows, width)
        wall = got.pop("wall")
        tokens = len(rows) * width
        print(f"\n{name}: {wall * 1e3:.0f} ms per forward, {tokens / wall:.0f} padded tokens/s")
        for key, seconds in sorted(got.items(), key=lambda kv: -kv[1]):
            print(f"  {key:<20} {seconds * 1e3:7.1f} ms  {seconds / wall:6.1%}")
    print("\nsingle sequence after the cached prefix, tokens/s (best of 3):")
    token = engine.prompt.encode("hello").ids[0]
    from worker.engine.prompt import EncodedTicket

    for w in (32, 74, 128):
        row = EncodedTicket(ids=(token,) * w, ticket_tokens=w, truncated=False)
        line = []
        for name, eng in (("ticketq f32", engine), ("ticketq int8", int8)):
            eng.forward_batch([row])
            best = min(_timed(lambda e=eng, r=row: e.forward_batch([r])) for _ in range(3))
            line.append(f"{name} {w / best:.0f}")
        rate = llama_cpp_rate(engine, w)
        line.append(f"llama.cpp f32 {rate:.0f}" if rate else "llama.cpp not installed")
        print(f"  width {w}: " + ", ".join(line))
    print(f"load average {os.getloadavg()}")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
