"""bfloat16 forwards with the decoder's linear layers through torch's `linear` (A) or through oneDNN on
weights prepacked once (B, `PackedLinear` on bf16 weights), side by side in one process.

    .venv/bin/python docs/bench/bf16_packed_ab.py models/qwen2.5-0.5b-standin [threads] \\
        [--batch 5x119 --batch 16x64] [--rounds 5]

Two bf16 engines on the same model directory (two copies of the weights), the same batches: each
round runs every batch once on A and once on B, the order alternating between rounds (A B, B A, ...),
so a burst of load on a shared machine hits both alike. Prints per batch the median forward time of
each, the median of the per-round B/A speedups with their range, and how far B's answers are from
A's (max |dp| over the batch's label probabilities), and whether the decoder's outputs are equal.
The engine prepacks bf16 linears itself where the CPU has native bf16 (TICKETQ_MATMUL=auto or onednn:
`kernels.pack_linears(decoder, torch.bfloat16)`): A unpacks them again, so A is the engine without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from profile_forward import batch_shape  # the same --batch ROWSxWIDTH (docs/bench is on sys.path)

from producer.synthetic import generate_tickets
from worker.engine import Engine
from worker.engine.kernels import PackedLinear, release_freed_memory, replace_module
from worker.engine.layout import prefix_mask
from worker.engine.prompt import EncodedTicket
from worker.engine.replicas import load_engine
from worker.settings import Settings


def set_packed(decoder: torch.nn.Module, packed: bool) -> int:
    """Every bf16 linear of `decoder` prepacked for oneDNN (`packed`) or a plain `nn.Linear`; how many changed."""
    changed = 0
    for name, module in list(decoder.named_modules()):
        if packed and type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
            replace_module(decoder, name, PackedLinear(module))
        elif not packed and isinstance(module, PackedLinear):
            replace_module(decoder, name, module.to_linear())
        else:
            continue
        changed += 1
    release_freed_memory()
    return changed


def batch_of(texts: list[str], engine: Engine, rows: int, width: int) -> list[EncodedTicket]:
    """`rows` tickets cut or cycled to exactly `width` tokens (no padding)."""
    out = []
    for i in range(rows):
        ids = engine.encode([texts[i % len(texts)]])[0].ids
        ids = (ids * (width // len(ids) + 1))[:width]
        out.append(EncodedTicket(ids=tuple(ids), ticket_tokens=width, truncated=False))
    return out


def timed(engine: Engine, rows: list[EncodedTicket]) -> tuple[float, list]:
    start = time.perf_counter()
    answers = engine.forward_batch(rows)
    return time.perf_counter() - start, answers


@torch.inference_mode()
def last_hidden(engine: Engine, rows: list[EncodedTicket]) -> torch.Tensor:
    """The decoder's output over `rows` after the cached prefix: (B, W, H)."""
    width = max(len(r.ids) for r in rows)
    lengths = torch.tensor([len(r.ids) for r in rows])
    ids = torch.tensor([list(r.ids) for r in rows])  # (B, W): the rows are all `width` long
    positions = engine.prefix_len + torch.arange(width).expand(len(rows), -1)  # (B, W)
    mask = prefix_mask(engine.prefix_len, lengths, width, 0, engine.dtype)  # (B, 1, W, P+W)
    return engine.decode(ids, mask, positions, engine.batch_cache(len(rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("threads", nargs="?", type=int, default=1)
    parser.add_argument("--batch", type=batch_shape, action="append", metavar="ROWSxWIDTH", help="repeatable")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shapes = args.batch or [(5, 119), (16, 64)]
    settings = Settings(model=args.model, dtype="bfloat16", device="cpu", threads=args.threads)
    engines = {"A torch linear": load_engine(settings), "B oneDNN prepacked": load_engine(settings)}
    counts = [set_packed(e.decoder, packed) for e, packed in zip(engines.values(), (False, True), strict=True)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, bf16 engines A and B "
          f"(linears changed: {counts}); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    texts = [t["text"] for t in generate_tickets(64, seed=0)]
    batches = {f"{r}x{w}": batch_of(texts, engines["A torch linear"], r, w) for r, w in shapes}
    times = {(shape, name): [] for shape in batches for name in engines}
    diffs = dict.fromkeys(batches, 0.0)
    for engine in engines.values():  # warm-up: oneDNN primitives for every shape
        for rows in batches.values():
            engine.forward_batch(rows)
    loads = []
    for round_ in range(args.rounds):
        order = list(engines.items()) if round_ % 2 == 0 else list(engines.items())[::-1]
        loads.append(os.getloadavg()[0])
        for shape, rows in batches.items():
            answers = {}
            for name, engine in order:
                seconds, answers[name] = timed(engine, rows)
                times[shape, name].append(seconds)
            a, b = answers.values()
            worst = max(abs(pa.probs[k] - pb.probs[k]) for pa, pb in zip(a, b, strict=True) for k in pa.probs)
            diffs[shape] = max(diffs[shape], worst)
    print(f"{args.rounds} rounds, load average (1 min) at each round's start: {' '.join(f'{x:.2f}' for x in loads)}")
    print("| batch | A torch linear, ms (median) | B oneDNN prepacked, ms (median) | B/A speedup, median (range) "
          "| B tokens/s | max abs dp B vs A |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for shape, rows in batches.items():
        a, b = times[shape, "A torch linear"], times[shape, "B oneDNN prepacked"]
        speedups = [x / y for x, y in zip(a, b, strict=True)]
        tokens = sum(len(r.ids) for r in rows)
        print(f"| {shape} | {statistics.median(a) * 1e3:.0f} | {statistics.median(b) * 1e3:.0f} | "
              f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f}) | "
              f"{tokens / statistics.median(b):.0f} | {diffs[shape]:.1e} |")  # fmt: skip
    first = next(iter(batches.values()))
    same = torch.equal(*(last_hidden(engine, first) for engine in engines.values()))
    print(f"decoder output of the first batch, A and B: {'bit for bit the same' if same else 'DIFFERENT'}")
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
