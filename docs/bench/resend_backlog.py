"""Re-sends under a backlog: does `wait(resend_after=S)` keep Redis within ~1.1x what is outstanding?

    .venv/bin/python docs/bench/resend_backlog.py [--tickets 20000] [--resend-after 5] [--model DIR | --null]

Starts a private redis-server (no persistence) and sends `--tickets` tickets (idempotent task ids,
as `ticketq-produce file` sends them) before one worker starts, so the worker has minutes of
backlog; then waits for every result with `resend_after`, as `ticketq-produce --resend-after`
does. Throughout, every 0.1 s, it samples the messages Redis holds for the queue (queued, being
fetched, unacked) against the tickets still outstanding. Prints the machine, the worker's rate,
how long the backlog lasted, the largest messages/outstanding ratio while more than 10 prefetch
windows are outstanding (a message answered but not yet acked is still in Redis: at most about a
prefetch window, which dominates the ratio at the end), the largest excess of messages over
outstanding over the whole run, the re-sends the producer logged, and how many tickets were
answered, and how many of them once in the results stream. Exit status 1 when the ratio passes
1.1 or a ticket is not answered exactly once. The worker runs the model of `--model` (default: TICKETQ_MODEL) or, with
`--null`, the null classifier (a backlog of seconds, not minutes, for the same tickets).
Findings: docs/reliability.md (Re-sends with a budget).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from producer.api import Producer  # noqa: E402
from ticketq import names  # noqa: E402
from ticketq.config import ClientSettings  # noqa: E402
from ticketq_bench.procs import WorkerProcess, free_port, wait_for  # noqa: E402

QUEUE = "resend-bench"
TARGET = 1.1
PREFETCH = 128  # the worker's default prefetch window (2 x TICKETQ_BATCH_WINDOW)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def held(client: redis.Redis) -> int:
    """Messages Redis holds for the queue: queued, being fetched, unacked."""
    fetching = client.keys(names.FETCHING_KEY.format(consumer="*", queue=QUEUE))
    return client.llen(QUEUE) + client.hlen(names.unacked_key()) + sum(client.llen(key) for key in fetching)


def pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


class Resent(logging.Handler):
    """Counts the messages the producer says it re-sent."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if match := re.match(r"re-sent (\d+) message", record.getMessage()):
            self.count += int(match.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tickets", type=int, default=20_000)
    parser.add_argument("--resend-after", type=float, default=5.0)
    parser.add_argument("--model", default=os.environ.get("TICKETQ_MODEL"))
    parser.add_argument("--null", action="store_true", help="the null classifier instead of a model")
    args = parser.parse_args()
    if not args.null and not args.model:
        parser.error("--model DIR (or TICKETQ_MODEL), or --null")
    workdir = Path(tempfile.mkdtemp(prefix="resend-bench-"))
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
                               "--dir", str(workdir)], stdout=subprocess.DEVNULL)  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    wait_for(lambda: pings(client), 10, "redis-server")
    resent = Resent()
    logging.getLogger("producer.waiting").addHandler(resent)
    producer = Producer(ClientSettings(broker_url=url, queue=QUEUE))
    worker = None
    try:
        tickets = [{"id": f"R-{i}", "text": f"ticket {i}: my invoice was charged twice"} for i in range(args.tickets)]
        sent = producer.submit_many(tickets, idempotent=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        env.update(TICKETQ_BROKER_URL=url, TICKETQ_QUEUE=QUEUE, TICKETQ_METRICS_PORT=str(free_port()))
        env.update({"TICKETQ_NULL_CLASSIFIER": "1"} if args.null else {"TICKETQ_MODEL": args.model})
        worker = WorkerProcess(env, workdir / "worker.log")
        worker.wait_ready(timeout=300)
        outstanding, samples, done = [args.tickets], [], threading.Event()

        def sample() -> None:
            probe = redis.Redis.from_url(url)
            while not done.is_set():
                left = outstanding[0]
                samples.append((held(probe), left))
                done.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        def answered(rows: list[dict]) -> None:
            outstanding[0] -= len(rows)

        results = producer.wait(sent, timeout=3600, resend_after=args.resend_after, on_result=answered)
        took = time.monotonic() - started
        done.set()
        sampler.join(timeout=10)
        counts = Counter((json.loads(f[b"data"])["task_id"], json.loads(f[b"data"])["id"])
                         for _, f in client.xrange(names.RESULTS_STREAM))  # fmt: skip
    finally:
        producer.close()
        if worker is not None:
            worker.stop(timeout=30)
        server.kill()
    ratios = [h / left for h, left in samples if left > 10 * PREFETCH]
    worst = max(ratios, default=0.0)
    excess = max((h - left for h, left in samples), default=0)
    ok = sum(row["status"] == "ok" for row in results)
    once = sum(n == 1 for n in counts.values())
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; worker: {'null classifier' if args.null else args.model}")
    print(f"{args.tickets} tickets, resend_after {args.resend_after:g} s: backlog {took:.1f} s "
          f"({args.tickets / took:.0f} tickets/s); {len(samples)} samples; max messages/outstanding {worst:.3f} "
          f"(outstanding > {10 * PREFETCH}); max messages - outstanding {excess}; "
          f"re-sent {resent.count}; answered {ok}/{args.tickets}, {once} of them once in the stream "
          f"({sum(counts.values())} entries)")  # fmt: skip
    return 0 if worst <= TARGET and ok == once == args.tickets == len(counts) else 1


if __name__ == "__main__":
    sys.exit(main())
