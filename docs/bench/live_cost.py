"""How close the cost model learnt while serving comes to a start-up fit, on a loaded machine.

    .venv/bin/python docs/bench/live_cost.py [--model DIR] [--forwards 100] [--burners 1] [--duty 1.0]
        [--period 2] [--threads 2]

1. A start-up fit (`autotune`, the grid of shapes, best of two) with nothing else running.
2. `--burners` processes that spin on the CPU (a loaded machine: all the time, or `--duty` of
   every `--period` seconds, a neighbour's bursts), then synthetic long-tail
   tickets classified in jobs of varied sizes, as a worker's buffers come, every forward fed to
   `LiveCostModel` (refitting every 50) until `--forwards` forwards have run.
3. Both models' predictions over the autotune grid: the median and the largest difference, the
   fixed cost in tokens' worth (the plans depend only on that: scaling every cost changes no
   plan), and the load average. Target: the live fit within 15% of the quiet start-up fit after
   100 forwards. Figures depend on the machine: it is named with them.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path

from producer.synthetic import generate_tickets
from worker.engine.autotune import ROWS, WIDTHS, LiveCostModel, autotune
from worker.engine.replicas import load_engine
from worker.settings import Settings


def burn(stop: float, duty: float, period: float, seed: int) -> None:
    """Spin `duty` of every `period` seconds (1.0: all the time), each burner at its own phase."""
    time.sleep(period * (seed * 0.37 % 1.0))
    while time.time() < stop:
        busy_until = time.time() + duty * period
        while time.time() < busy_until:
            sum(i * i for i in range(10_000))
        if duty < 1:
            time.sleep((1 - duty) * period)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen2.5-0.5b-standin")
    parser.add_argument("--forwards", type=int, default=100)
    parser.add_argument("--burners", type=int, default=1, help="CPU-spinning processes while serving")
    parser.add_argument("--duty", type=float, default=1.0,
                        help="share of each period a burner spins (1.0: a constant neighbour; 0.5: bursts)")
    parser.add_argument("--period", type=float, default=2.0, help="a burner's on/off period, seconds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--autotune-s", type=float, default=15.0)
    args = parser.parse_args()

    engine = load_engine(Settings(model=args.model, dtype=args.dtype, threads=args.threads, live_cost=False))
    load_quiet = os.getloadavg()[0]
    quiet = autotune(engine, budget_s=args.autotune_s).cost
    texts = [ticket["text"] for ticket in generate_tickets(4000, seed=1)]
    learner = LiveCostModel(engine)
    stop = time.time() + 3600
    burners = [multiprocessing.Process(target=burn, args=(stop, args.duty, args.period, n), daemon=True)
               for n in range(args.burners)]  # fmt: skip
    for process in burners:
        process.start()
    try:
        job, at = 0, 0
        while learner.seen < args.forwards:
            size = 1 + (job * 5) % 12
            engine.classify(texts[at:at + size], on_batch=lambda r: learner.observe(r.rows, r.width, r.seconds))
            job, at = job + 1, (at + size) % (len(texts) - 64)
            print(f"\r{learner.seen} forwards, {learner.fits} fits kept", end="", flush=True)
        learner.wait()  # the refit in flight, if any: its fit is the one compared
        print()
        load_served = os.getloadavg()[0]
    finally:
        for process in burners:
            process.terminate()
    live = engine.cost
    grid = [(rows, width) for rows in ROWS for width in WIDTHS if rows * width <= engine.max_batch_tokens]
    diffs = [abs(live.batch_ms(r, w) - quiet.batch_ms(r, w)) / quiet.batch_ms(r, w) for r, w in grid]
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; model {args.model}, {args.dtype}, {args.threads} threads")
    print(f"start-up fit (load {load_quiet:.2f}): {quiet.fixed_ms:.2f} ms + {quiet.token_ms:.4f} ms x tokens "
          f"+ {quiet.quad_ms:.2e} ms x rows x width^2")
    print(f"live fit after {learner.seen} forwards, {learner.fits} kept, {args.burners} burner(s) at "
          f"{args.duty:.0%} of every {args.period:g} s, load "
          f"{load_served:.2f}: {live.fixed_ms:.2f} ms + {live.token_ms:.4f} ms x tokens + {live.quad_ms:.2e}")
    print(f"predicted forward times over {len(grid)} shapes: live vs start-up, median difference "
          f"{statistics.median(diffs):.1%}, largest {max(diffs):.1%}")
    # The planner's choices do not change when every cost is scaled (a uniformly slower machine):
    # what matters is the fixed cost in tokens' worth, the break-even batch size.
    print(f"fixed cost in tokens' worth (what the plans depend on): start-up {quiet.fixed_ms / quiet.token_ms:.0f}, "
          f"live {live.fixed_ms / live.token_ms:.0f}")


if __name__ == "__main__":
    main()
