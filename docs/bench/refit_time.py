"""How long one live cost refit takes, by the number of served shapes in its window.

    .venv/bin/python docs/bench/refit_time.py [--shapes 50,100,200,400] [--seeds 10] [--burners 0]

Served forwards as a loaded machine produces them: shapes as the planner makes them (1-32 rows,
12-400 tokens wide, nearly every one new), the forward cost of a full-size stand-in on a 2-core
Zen 5 (the live fit in docs/performance.md) with 3% jitter, half of the forwards slowed 1.3-2x by
a bursty neighbour and one in ten tripled. For each window size, `--seeds` windows, each refitted
by `LiveCostModel.refit` (dedup, trimmed fit, soundness, error, cache write: all a background
refit does) on this thread; prints the median and the slowest refit, the fits the trim made (its
bound: TRIM_ROUNDS), the fit's largest error against the true cost, the machine and the load
average. `--burners` processes spin on the CPU meanwhile (see live_cost.py). Target: under 50 ms
at 400 shapes. Figures: docs/performance.md, "The cost model".
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_cost import burn, cpu_name

from worker.engine.autotune import TRIM_ROUNDS, LiveCostModel
from worker.engine.cost import CostModel

TRUE = CostModel(fixed_ms=47.3, token_ms=1.58, quad_ms=3.2e-3)


def window(rng: random.Random, shapes: int) -> list[tuple[int, int, float]]:
    """(rows, width, ms) of served forwards until `shapes` distinct shapes were seen."""
    forwards, seen = [], set()
    while len(seen) < shapes:
        rows, width = rng.choice((1, 2, 3, 4, 6, 8, 12, 16, 24, 32)), rng.randint(12, 400)
        ms = TRUE.batch_ms(rows, width) * rng.uniform(0.97, 1.03)
        if rng.random() < 0.5:
            ms *= rng.uniform(1.3, 2.0)
        if rng.random() < 0.1:
            ms *= 3
        forwards.append((rows, width, ms))
        seen.add((rows, width))
    return forwards


def timed_refit(forwards: list[tuple[int, int, float]]) -> tuple[float, int, CostModel | None]:
    """Seconds of one refit, the fits it made, and what it kept."""
    info = SimpleNamespace(name="bench", device="cpu", dtype="float32", matmul="torch")
    engine = SimpleNamespace(cost=CostModel(25.0, 0.8), info=info)
    fits, fit = [], CostModel.fit.__func__
    CostModel.fit = classmethod(lambda cls, samples, relative=False: fits.append(1) or fit(cls, samples, relative))
    try:
        start = time.perf_counter()
        kept = LiveCostModel(engine, window=len(forwards)).refit(forwards)
        return time.perf_counter() - start, len(fits), kept
    finally:
        CostModel.fit = classmethod(fit)


def worst_error(cost: CostModel | None) -> float:
    if cost is None:
        return float("nan")
    grid = [(r, w) for r in (1, 2, 4, 8, 16, 32) for w in (16, 64, 128, 256, 384)]
    return max(abs(cost.batch_ms(r, w) - TRUE.batch_ms(r, w)) / TRUE.batch_ms(r, w) for r, w in grid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="50,100,200,400", help="window sizes, in distinct shapes")
    parser.add_argument("--seeds", type=int, default=10, help="windows per size")
    parser.add_argument("--burners", type=int, default=0, help="CPU-spinning processes meanwhile")
    args = parser.parse_args()
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="refit-bench-")  # the fit cache goes there
    stop = time.time() + 3600
    burners = [multiprocessing.Process(target=burn, args=(stop, 1.0, 2.0, n), daemon=True)
               for n in range(args.burners)]  # fmt: skip
    for process in burners:
        process.start()
    timed_refit(window(random.Random(0), 50))  # warm-up: imports, numpy's first calls
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, {args.burners} burner(s), "
          f"load average {os.getloadavg()[0]:.2f}; trim bound {TRIM_ROUNDS} fits")  # fmt: skip
    print("| shapes | forwards | refit ms, median | slowest | fits, median (most) | largest error |")
    print("|---|---|---|---|---|---|")
    try:
        for shapes in (int(n) for n in args.shapes.split(",")):
            runs = []
            for seed in range(args.seeds):
                forwards = window(random.Random(seed), shapes)
                runs.append((len(forwards), *timed_refit(forwards)))
            ms = [1000 * seconds for _, seconds, _, _ in runs]
            fits = [count for _, _, count, _ in runs]
            print(f"| {shapes} | {statistics.median(n for n, *_ in runs):.0f} | {statistics.median(ms):.1f} | "
                  f"{max(ms):.1f} | {statistics.median(fits):.0f} ({max(fits)}) | "
                  f"{max(worst_error(kept) for *_, kept in runs):.1%} |", flush=True)  # fmt: skip
    finally:
        for process in burners:
            process.terminate()
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
