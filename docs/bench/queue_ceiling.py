"""The queue path's own ceiling: one null-classifier worker, N tickets, first send to last result.

    .venv/bin/python docs/bench/queue_ceiling.py --tickets 4000 --pack 1 --pack 100 [--prefill]
    .venv/bin/python docs/bench/queue_ceiling.py --tickets 4000 --plain-celery [--prefill]

One worker process (`TICKETQ_NULL_CLASSIFIER=1`: no model, labels are a hash) on a private queue
of the local Redis; the producer sends every ticket (`pack` per message), then waits for every
result through the Celery backend (`--prefill`: every ticket is queued before the worker starts,
and the worker is timed alone, from ready to last result). Prints tickets/s per pack size, the
worker's jobs and forwards, where the CPU time went (milliseconds of CPU per 1,000 tickets in the
producer — this process, sending and waiting —, the worker process and the Redis server, over the
timed span) and the machine, one run each: compare rows within a run.
`--plain-celery` runs the yardstick instead: stock Celery with a no-op task (celery_noop.py), one
message per ticket, the same Redis and the same timing.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from producer.api import Producer
from ticketq.config import ClientSettings
from ticketq_bench.procs import free_port, running_worker, wait_for

HERE = Path(__file__).resolve().parent


class CpuClock:
    """CPU seconds used so far by this process (the producer), one other process, and the Redis server."""

    def __init__(self, broker_url: str, pid: int) -> None:
        import redis

        self.redis = redis.Redis.from_url(broker_url)
        self.pid = pid
        self.ticks = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[float, float, float]:
        own = resource.getrusage(resource.RUSAGE_SELF)
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        other = (int(fields[11]) + int(fields[12])) / self.ticks  # utime + stime
        info = self.redis.info("cpu")
        return own.ru_utime + own.ru_stime, other, info["used_cpu_user"] + info["used_cpu_sys"]

    @staticmethod
    def per_thousand(before: tuple, after: tuple, tickets: int) -> tuple[float, ...]:
        return tuple(1e6 * (b - a) / tickets for a, b in zip(before, after, strict=True))


def run(broker_url: str, tickets: int, pack: int, workdir: Path, prefill: bool = False) -> dict:
    queue = f"ceiling-{uuid.uuid4().hex[:8]}"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=broker_url, TICKETQ_QUEUE=queue, TICKETQ_NULL_CLASSIFIER="1",
               TICKETQ_METRICS_PORT=str(port))  # fmt: skip
    texts = [{"id": f"c-{i}", "text": f"ceiling ticket {i}: my invoice is wrong"} for i in range(tickets)]
    settings = ClientSettings(broker_url=broker_url, queue=queue)
    with Producer(settings) as producer:
        if prefill:  # the backlog is queued first: the worker alone is timed, from ready to last result
            started = time.perf_counter()
            sent = producer.submit_many(texts, pack=pack)
            sent_s = time.perf_counter() - started
        with running_worker(env, workdir / f"worker-{pack}.log", ready_timeout=120) as worker:
            clock = CpuClock(broker_url, worker.pid)
            cpu_before, started = clock.read(), time.perf_counter()
            if not prefill:
                sent = producer.submit_many(texts, pack=pack)
                sent_s = time.perf_counter() - started
            results = producer.wait(sent, timeout=600)
            total_s = time.perf_counter() - started
            cpu = clock.per_thousand(cpu_before, clock.read(), tickets)
            metrics = worker.metrics()
    ok = sum(r["status"] == "ok" for r in results)
    return {"pack": pack, "tickets": tickets, "ok": ok, "send_s": sent_s, "total_s": total_s,
            "tickets_per_s": tickets / total_s, "jobs": metrics.get("ticketq_flushes_total{}", 0),
            "forwards": metrics.get("ticketq_batch_size_count{}", 0), "cpu_ms_per_1000": cpu}  # fmt: skip


def run_plain_celery(broker_url: str, tickets: int, workdir: Path, prefill: bool = False) -> dict:
    """Stock Celery, no-op task, one message per ticket: first send (or worker ready) to last result."""
    import redis

    os.environ.update(NOOP_BROKER_URL=broker_url, NOOP_QUEUE=f"noop-{uuid.uuid4().hex[:8]}")
    sys.path.insert(0, str(HERE))
    from celery_noop import app  # reads NOOP_* at import

    client = redis.Redis.from_url(broker_url)
    texts = [{"id": f"c-{i}", "text": f"ceiling ticket {i}: my invoice is wrong"} for i in range(tickets)]
    log_path = workdir / "plain-celery.log"
    command = [sys.executable, "-m", "celery", "-A", "celery_noop", "worker", "--pool=threads", "--concurrency=1",
               f"--queues={os.environ['NOOP_QUEUE']}", "--without-gossip", "--without-mingle", "--without-heartbeat",
               "--loglevel=INFO"]  # fmt: skip

    def send() -> tuple[list[str], float]:
        began = time.perf_counter()
        ids = [app.send_task("noop", args=[text]).id for text in texts]
        return ids, time.perf_counter() - began

    def wait_all(ids: list[str]) -> None:
        pending = list(ids)

        def done() -> bool:  # the oldest 200 not yet done, as Producer.wait reads them
            window = pending[:200]
            found = client.mget([f"celery-task-meta-{task_id}" for task_id in window])
            finished = {task_id for task_id, value in zip(window, found, strict=True) if value is not None}
            pending[:] = [task_id for task_id in pending if task_id not in finished]
            return not pending

        wait_for(done, 600, "every no-op result", interval=0.005)

    if prefill:
        ids, sent_s = send()
    with log_path.open("wb") as log:
        worker = subprocess.Popen(command, cwd=HERE, env={**os.environ, "PYTHONPATH": str(HERE)}, stdout=log,
                                  stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait_for(lambda: " ready." in log_path.read_text(errors="replace"), 60, "the plain Celery worker")
        clock = CpuClock(broker_url, worker.pid)
        cpu_before, started = clock.read(), time.perf_counter()
        if not prefill:
            ids, sent_s = send()
        wait_all(ids)
        total_s = time.perf_counter() - started
        cpu = clock.per_thousand(cpu_before, clock.read(), tickets)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    return {"pack": "plain Celery", "tickets": tickets, "ok": tickets, "send_s": sent_s, "total_s": total_s,
            "tickets_per_s": tickets / total_s, "jobs": float("nan"), "forwards": float("nan"),
            "cpu_ms_per_1000": cpu}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tickets", type=int, default=4000)
    parser.add_argument("--pack", type=int, action="append", help="tickets per message (repeatable)")
    parser.add_argument("--broker-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--prefill", action="store_true",
                        help="queue every ticket before the worker starts: time the worker alone")
    parser.add_argument("--plain-celery", action="store_true",
                        help="the yardstick: stock Celery with a no-op task, one message per ticket")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    timed = "worker ready to last result s" if args.prefill else "first send to last result s"
    print(f"| pack | tickets | ok | send s | {timed} | tickets/s | jobs | forwards | "
          "CPU ms per 1,000 tickets: producer / worker / Redis |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        runs = ([lambda: run_plain_celery(args.broker_url, args.tickets, Path(tmp), args.prefill)] if args.plain_celery
                else [lambda pack=pack: run(args.broker_url, args.tickets, pack, Path(tmp), args.prefill)
                      for pack in args.pack or [1, 100]])  # fmt: skip
        for go in runs:
            r = go()
            print(f"| {r['pack']} | {r['tickets']} | {r['ok']} | {r['send_s']:.2f} | {r['total_s']:.2f} | "
                  f"{r['tickets_per_s']:,.0f} | {r['jobs']:.0f} | {r['forwards']:.0f} | "
                  f"{' / '.join(f'{ms:.0f}' for ms in r['cpu_ms_per_1000'])} |", flush=True)


if __name__ == "__main__":
    main()
