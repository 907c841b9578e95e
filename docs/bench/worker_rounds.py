"""Rounds of tickets through one real worker with every default on: round times and RSS.

    .venv/bin/python docs/bench/worker_rounds.py --model DIR [--rounds 20] [--tickets 600]

Starts one `ticketq worker` on a private queue of the Redis at TICKETQ_BROKER_URL, its
environment cleared of TICKETQ_* but for the broker, the queue, the metrics port and the model:
every default on (the live cost model among them, refitting every 50 forwards). Then `--rounds`
rounds, each `--tickets` new synthetic long-tail tickets (the bench's generator, a seed per
round) sent at once and waited for, as a backlog comes. After each round: its seconds (first
send to last result), the worker's CPU seconds in it (user + system, all its threads: what a
refit on the classifying thread would add to, and less moved than wall time by other processes'
load), the worker's RSS (psutil), the live refits kept so far (`ticketq_cost_model_fits`) and the
cost model in use. `--fresh-cache`: the worker gets an empty XDG_CACHE_HOME, no cost fit cached
(and its kernel probes measured again), as on a first start. `--env NAME=VALUE` sets a worker
setting (e.g. `--env TICKETQ_LIVE_COST=0` for the run to compare with).

Targets: every round after the first within ±25% of their median (seconds, and CPU seconds), and
RSS flat (the last round within 10% of the second). Exit status 1 where one is missed, 2 where a
ticket is not answered.
Figures: docs/performance.md, "The cost model".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere in the checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))
import psutil
from live_cost import cpu_name

from producer.api import Producer
from producer.synthetic import generate_tickets
from ticketq_bench.procs import free_port, model_info, running_worker
from worker import constants
from worker.settings import Settings

SPREAD = 0.25  # every round after the first within this share of their median
RSS_GROWTH = 0.10  # the last round's RSS within this share of the second's


def worker_env(model: str, broker_url: str, queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=broker_url, TICKETQ_QUEUE=queue, TICKETQ_MODEL=model,
               TICKETQ_METRICS_PORT=str(free_port()), PYTHONUNBUFFERED="1")  # fmt: skip
    return env


def cost_line(metrics: dict[str, float]) -> str:
    term = {t: metrics.get(f"{constants.M_COST_MODEL}{{term={t}}}", float("nan")) for t in ("fixed", "token", "quad")}
    return f"{term['fixed']:.2f} ms + {term['token']:.4f} ms x tokens + {term['quad']:.2e}"


def run_round(producer: Producer, number: int, tickets: int, timeout: float) -> tuple[float, int]:
    """Seconds from the first send to the last result of one round, and the tickets answered."""
    texts = [t["text"] for t in generate_tickets(tickets, seed=1000 + number)]
    start = time.perf_counter()
    sent = producer.submit_many([{"id": f"r{number}-{i}", "text": text} for i, text in enumerate(texts)])
    results = producer.wait(sent, timeout=timeout)
    return time.perf_counter() - start, sum(r.get("status") == "ok" for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model id or directory")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tickets", type=int, default=600, help="tickets per round")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a round may take at most")
    parser.add_argument("--fresh-cache", action="store_true", help="start from the configured cost model")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="a worker setting")
    args = parser.parse_args()
    queue = f"ticketq-rounds-{uuid.uuid4().hex[:8]}"
    settings = Settings(queue=queue)
    env = worker_env(str(Path(args.model).resolve()) if Path(args.model).exists() else args.model,
                     settings.broker_url, queue)  # fmt: skip
    env.update(pair.split("=", 1) for pair in args.env)
    if args.fresh_cache:
        env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix=f"{queue}-cache-")
    producer = Producer(settings)
    log_path = Path(tempfile.gettempdir(), f"{queue}-worker.log")
    try:
        with running_worker(env, log_path) as worker:
            process = psutil.Process(worker.pid)
            info = model_info(worker.metrics())
            print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; worker "
                  f"{info.get('model')} {info.get('device')}/{info.get('dtype')} {info.get('matmul')}, "
                  f"RSS {process.memory_info().rss / 2**20:.0f} MB ready; log {log_path}")  # fmt: skip
            print("| round | seconds | CPU s | items/s | RSS MB | live refits kept | cost model | load |")
            print("|---" * 8 + "|")
            rounds = []
            for number in range(1, args.rounds + 1):
                cpu = sum(process.cpu_times()[:2])
                seconds, answered = run_round(producer, number, args.tickets, args.timeout)
                cpu = sum(process.cpu_times()[:2]) - cpu
                rss, metrics = process.memory_info().rss / 2**20, worker.metrics()
                rounds.append((seconds, cpu, rss))
                print(f"| {number} | {seconds:.2f} | {cpu:.2f} | {args.tickets / seconds:.1f} | {rss:.0f} | "
                      f"{metrics.get(constants.M_COST_MODEL_FITS + '_total{}', 0):.0f} | {cost_line(metrics)} | "
                      f"{os.getloadavg()[0]:.2f} |", flush=True)  # fmt: skip
                if answered != args.tickets:
                    print(f"round {number}: {answered} of {args.tickets} tickets answered")
                    return 2
    finally:
        producer.redis.delete(queue)
        producer.close()
    return verdict(rounds)


def verdict(rounds: list[tuple[float, float, float]]) -> int:
    """Print the spread of rounds 2.. (seconds, CPU seconds) and RSS's growth; 0 where all meet the targets."""
    if len(rounds) < 2:
        return 0
    ok = True
    for column, unit in ((0, "s"), (1, "CPU s")):
        later = [r[column] for r in rounds[1:]]
        median = statistics.median(later)
        spread = max(abs(v / median - 1) for v in later)
        ok = ok and spread <= SPREAD
        print(f"rounds 2-{len(rounds)}: {min(later):.2f}-{max(later):.2f} {unit}, median {median:.2f}, "
              f"at most {spread:.0%} from it (target {SPREAD:.0%})")  # fmt: skip
    growth = rounds[-1][2] / rounds[1][2] - 1
    ok = ok and growth <= RSS_GROWTH
    print(f"RSS {rounds[1][2]:.0f} -> {rounds[-1][2]:.0f} MB, {growth:+.1%} (target {RSS_GROWTH:.0%}); "
          f"targets {'met' if ok else 'MISSED'}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
