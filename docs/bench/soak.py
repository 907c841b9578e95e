"""Soak: does the engine's memory stay put over a long run of varied tickets?

    .venv/bin/python docs/bench/soak.py [--tickets 20000] [--model DIR] [--matmul onednn]

Classifies `--tickets` synthetic long-tail tickets (the bench's generator, `--seed`) through
`Engine.classify` in this process, in jobs of 1 to 2 x `--job` tickets (seeded), as a worker
takes them off the queue: every forward batch has its own (rows, width). Prints the machine, the
matmul and the oneDNN cache capacities, then every `--every` tickets the process's RSS (VmRSS,
/proc/self/status), items/s since the last line and how many distinct batch shapes ran so far.

The target: RSS at the end within 10% of RSS after the first tenth of the run (20,000 and 2,000
tickets by default). Exit status 1 where it is missed. The growth since the model's load is printed
too: a cache that fills within the first tenth (oneDNN's, uncapped, did) shows only there.
Settings not given on the command line come from TICKETQ_* (`TICKETQ_MODEL`, `TICKETQ_DTYPE`...);
no autotune unless `--autotune-s` (the planner's default cost model: the same shapes on every
machine). Findings: docs/bench/soak.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

TARGET_GROWTH = 0.10  # RSS at the end / RSS after the first tenth of the run, at most 1 + this


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (not Linux)")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=int, default=20_000, help="tickets to classify (default: 20000)")
    parser.add_argument("--every", type=int, default=1_000, help="print RSS every N tickets (default: 1000)")
    parser.add_argument("--job", type=int, default=50, help="mean tickets per classify call (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="ticket and job-size seed (default: 0)")
    parser.add_argument("--model", help="model id or directory (default: TICKETQ_MODEL)")
    parser.add_argument("--matmul", choices=("auto", "torch", "onednn"), help="default: TICKETQ_MATMUL")
    parser.add_argument("--dtype", help="default: TICKETQ_DTYPE")
    parser.add_argument("--threads", type=int, help="torch threads (default: TICKETQ_THREADS)")
    parser.add_argument("--autotune-s", type=float, help="autotune the cost model first, for this long")
    args = parser.parse_args()
    if args.tickets < args.every or args.every < 1:
        parser.error("--tickets must be >= --every >= 1")
    return args


def jobs(texts: list[str], mean: int, seed: int):
    """`texts` in consecutive jobs of 1 to 2 x `mean` tickets."""
    rng = random.Random(seed)
    start = 0
    while start < len(texts):
        size = rng.randint(1, 2 * mean)
        yield texts[start : start + size]
        start += size


def main() -> int:
    args = parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the checkout
    from producer.synthetic import generate_tickets
    from worker.engine.kernels import ONEDNN_CACHE_VARIABLES
    from worker.engine.replicas import load_engine
    from worker.settings import Settings

    given = {"model": args.model, "matmul": args.matmul, "dtype": args.dtype, "threads": args.threads}
    settings = Settings(**{k: v for k, v in given.items() if v is not None})
    engine = load_engine(settings)
    if args.autotune_s:
        from worker.engine.autotune import autotune

        autotune(engine, budget_s=args.autotune_s)
    import torch

    caches = ", ".join(f"{name}={os.environ.get(name, '?')}" for name in ONEDNN_CACHE_VARIABLES)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    info = engine.info
    print(f"model: {info.name}{' (stand-in)' if info.standin else ''}, {info.device}/{info.dtype}, "
          f"matmul {info.matmul}, {caches}")  # fmt: skip
    texts = [ticket["text"] for ticket in generate_tickets(args.tickets, seed=args.seed)]
    baseline_at = max(args.every, args.tickets // 10 // args.every * args.every)
    loaded = rss_mb()
    print(f"RSS after load: {loaded:.0f} MB; {args.tickets} tickets, target: the end within "
          f"{TARGET_GROWTH:.0%} of RSS at {baseline_at}")  # fmt: skip
    print("| tickets | RSS MB | items/s | batch shapes so far |\n|---|---|---|---|")
    shapes: set[tuple[int, int]] = set()
    done, mark, rss_at = 0, args.every, {}
    last_time, last_done = time.perf_counter(), 0
    for job in jobs(texts, args.job, args.seed):
        _, reports = engine.classify(job)
        shapes.update((report.rows, report.width) for report in reports)
        done += len(job)
        while done >= mark:  # a job may cross a mark: RSS is read after it
            now = time.perf_counter()
            rss_at[mark] = rss_mb()
            print(f"| {mark} | {rss_at[mark]:.0f} | {(done - last_done) / (now - last_time):.1f} | {len(shapes)} |",
                  flush=True)  # fmt: skip
            last_time, last_done, mark = now, done, mark + args.every
    end = rss_at[max(rss_at)]
    growth = end / rss_at[baseline_at] - 1
    ok = growth <= TARGET_GROWTH
    verdict = "within" if ok else "MISSED:"
    print(f"RSS {rss_at[baseline_at]:.0f} MB at {baseline_at} -> {end:.0f} MB at {max(rss_at)}: {growth:+.1%} "
          f"({verdict} the {TARGET_GROWTH:.0%} target); {end - loaded:+.0f} MB since the load; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
