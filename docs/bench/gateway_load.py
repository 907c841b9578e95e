"""The HTTP gateway under load, beside `Producer.submit_many`, on a null-classifier worker.

Starts a private redis-server, one null-classifier worker (`ticketq worker`) and the gateway
(`python -m gateway`), then measures, in this order:

1. `Producer.submit_many(idempotent=True)`, one message per ticket: tickets/s enqueued.
2. side by side, closed loop: `--clients` concurrent clients POSTing one ticket per request as
   fast as answers come, for `--seconds`, to the gateway, then the same to the minimal app
   (docs/bench/minimal_app.py: one LPUSH a POST, uvicorn's h11 as the gateway's); then both again
   with `--batch` tickets per request; `--rounds` times. Printed per pair: requests/s, CPU ms per
   request of each process and the load average; in the JSON, `beside_minimal_app` (each round and
   the medians) and the gateway's capacity (`closed_loop_single`, `closed_loop_batched`).
3. open loop at 50% and 90% of that single-ticket capacity: Poisson arrivals, each a POST of one
   ticket; requests/s achieved, p50 and p99 latency, non-202 answers.
Last, every ticket sent is waited for in the results stream (none lost). `--compare-only` runs
step 2 alone (and the check that every ticket was answered).

The load generator runs in this process (asyncio + httpx) on the same machine: its CPU is taken
from the gateway's and the minimal app's alike, so requests/s are a floor, and on a loaded machine
mostly the neighbours'; CPU per request is the steadier figure. Usage:

    python docs/bench/gateway_load.py --seconds 10 --out docs/bench/gateway-load.json
    python docs/bench/gateway_load.py --compare-only --seconds 10 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psutil
import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from producer.api import Producer  # noqa: E402
from ticketq.config import ClientSettings  # noqa: E402
from ticketq.names import RESULTS_STREAM  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# httpx's default keep-alive expiry (5 s) is uvicorn's keep-alive (5 s), the gateway's and the minimal app's:
# an idle pooled connection was reused just as the server closed it, and the POST failed (httpx.ReadError)
# whichever server it was. Below the servers' 5 s, the client drops an idle connection first.
KEEPALIVE_EXPIRY_S = 2.0


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


class Stack:
    """redis-server + a null-classifier worker + the gateway, all private, in a temp dir."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.procs = workdir, []
        self.redis_port, self.gateway_port, metrics_port = free_port(), free_port(), free_port()
        self.broker = f"redis://127.0.0.1:{self.redis_port}/0"
        self.queue = f"bench-{uuid.uuid4().hex[:8]}"
        self.gateway = f"http://127.0.0.1:{self.gateway_port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        # every answer kept for `all_answered` to count: a run sends 100,000+ tickets, above the
        # results stream's default cap (TICKETQ_STREAM_MAXLEN), which would trim answers, not lose them
        env.update(PYTHONPATH=str(ROOT), TICKETQ_BROKER_URL=self.broker, TICKETQ_QUEUE=self.queue,
                   TICKETQ_STREAM_MAXLEN="10000000")  # fmt: skip
        self._start(["redis-server", "--port", str(self.redis_port), "--save", "", "--appendonly", "no"], env)
        wait_until(lambda: self._pings(), 10, "redis-server")
        worker = shutil.which("ticketq", path=str(Path(sys.executable).parent)) or "ticketq"
        self._start([worker, "worker"], {**env, "TICKETQ_NULL_CLASSIFIER": "1", "TICKETQ_DEVICE": "cpu",
                                         "TICKETQ_METRICS_PORT": str(metrics_port)}, "worker.log")  # fmt: skip
        wait_until(lambda: _answers(f"http://127.0.0.1:{metrics_port}/readyz"), 120, "the worker")
        self._start([sys.executable, "-m", "gateway", "--port", str(self.gateway_port)],
                    {**env, "TICKETQ_GATEWAY_ANONYMOUS": "1", "TICKETQ_GATEWAY_RATE": "1000000",
                     "TICKETQ_GATEWAY_BURST": "1000000"}, "gateway.log")  # fmt: skip
        wait_until(lambda: _answers(self.gateway + "/readyz"), 60, "the gateway")
        self.minimal = f"http://127.0.0.1:{free_port()}"  # the baseline: docs/bench/minimal_app.py, h11 as the gateway
        self._start([sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "docs" / "bench"), "minimal_app:app",
                     "--http", "h11", "--port", self.minimal.rsplit(":", 1)[1], "--log-level", "warning",
                     "--no-access-log"], {**env, "TICKETQ_BENCH_REDIS": self.broker}, "minimal.log")  # fmt: skip
        wait_until(lambda: _answers(self.minimal + "/readyz"), 60, "the minimal app")

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by the worker, the gateway and the minimal app."""
        times = [psutil.Process(proc.pid).cpu_times() for proc in self.procs[1:4]]
        return {name: t.user + t.system for name, t in zip(("worker", "gateway", "minimal"), times, strict=True)}

    def _start(self, command: list[str], env: dict, log: str | None = None) -> None:
        out = (self.workdir / log).open("wb") if log else subprocess.DEVNULL
        self.procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))

    def _pings(self) -> bool:
        try:
            return bool(redis.Redis(port=self.redis_port).ping())
        except redis.RedisError:
            return False

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            proc.wait(timeout=30)


def producer_rate(stack: Stack, count: int) -> dict:
    tickets = [{"id": f"p-{uuid.uuid4().hex}", "text": f"my invoice {n} is wrong"} for n in range(count)]
    with Producer(ClientSettings(broker_url=stack.broker, queue=stack.queue)) as producer:
        producer.check_connection()
        started = time.perf_counter()
        producer.submit_many(tickets, idempotent=True)
        elapsed = time.perf_counter() - started
    return {"tickets": count, "tickets_per_s": count / elapsed, "ids": [t["id"] for t in tickets]}


async def closed_loop(url: str, clients: int, seconds: float, batch: int, ids: list[str]) -> dict:
    latencies: list[float] = []
    failures = 0
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.monotonic() < deadline:
            tickets = [{"id": uuid.uuid4().hex, "text": "the app crashes on upload"} for _ in range(batch)]
            started = time.perf_counter()
            response = await http.post(url + "/v1/tickets", json=tickets if batch > 1 else tickets[0])
            latencies.append(time.perf_counter() - started)
            if response.status_code == 202:
                ids.extend(t["id"] for t in tickets)
            else:
                failures += 1

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)  # fmt: skip
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return {"clients": clients, "batch": batch, "requests_per_s": len(latencies) / elapsed,
            "tickets_per_s": len(latencies) * batch / elapsed, "non_202": failures, **_percentiles(latencies)}


async def open_loop(url: str, rate: float, seconds: float, ids: list[str]) -> dict:
    """Poisson arrivals at `rate`/s for `seconds`; each arrival one POST of one ticket."""
    rng, latencies, failures, tasks = random.Random(0), [], 0, []

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal failures
        ticket = {"id": uuid.uuid4().hex, "text": "please reset my password"}
        started = time.perf_counter()
        response = await http.post(url + "/v1/tickets", json=ticket)
        latencies.append(time.perf_counter() - started)
        if response.status_code == 202:
            ids.append(ticket["id"])
        else:
            failures += 1

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        started = time.perf_counter()
        at = started
        while at - started < seconds:
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(http)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    return {"target_per_s": rate, "requests_per_s": len(latencies) / elapsed, "non_202": failures,
            **_percentiles(latencies)}


def measured(stack: Stack, phase) -> dict:
    """Run a load phase; add each process's CPU milliseconds per request to its figures."""
    before = stack.cpu_s()
    figures = asyncio.run(phase)
    after = stack.cpu_s()
    for name in before:
        figures[f"{name}_cpu_ms_per_request"] = 1000 * (after[name] - before[name]) / figures["requests"]
    return figures


def side_by_side(stack: Stack, args: argparse.Namespace, ids: list[str]) -> tuple[dict, dict, dict]:
    """The gateway and the minimal app (one LPUSH per POST) under the same closed loops, one after the
    other, `--rounds` times: (`beside_minimal_app`, the gateway's last single-ticket and batched figures)."""
    spare: list[str] = []  # the minimal app's tickets are no Celery messages: never answered
    rounds: dict[str, list[dict]] = {"single": [], "batched": []}
    gateway: dict[str, dict] = {}
    for number in range(args.rounds):
        for name, batch in (("single", 1), ("batched", args.batch)):
            gateway[name] = measured(stack, closed_loop(stack.gateway, args.clients, args.seconds, batch, ids))
            minimal = measured(stack, closed_loop(stack.minimal, args.clients, args.seconds, batch, spare))
            row = {"gateway_requests_per_s": gateway[name]["requests_per_s"],
                   "minimal_requests_per_s": minimal["requests_per_s"],
                   "ratio": gateway[name]["requests_per_s"] / minimal["requests_per_s"],
                   "gateway_cpu_ms_per_request": gateway[name]["gateway_cpu_ms_per_request"],
                   "minimal_cpu_ms_per_request": minimal["minimal_cpu_ms_per_request"],
                   "loadavg_1m": os.getloadavg()[0]}  # fmt: skip
            rounds[name].append(row)
            _say(f"round {number + 1}", batch, row)
    out = {name: {"rounds": rows, **{f"median_{key}": statistics.median(row[key] for row in rows)
                                     for key in rows[0] if key != "loadavg_1m"}}
           for name, rows in rounds.items()}  # fmt: skip
    for name, batch in (("single", 1), ("batched", args.batch)):
        _say("median", batch, {key.removeprefix("median_"): value for key, value in out[name].items()})
    return out, gateway["single"], gateway["batched"]


def _say(what: str, batch: int, row: dict) -> None:
    """One side-by-side line on stderr: both processes' requests/s and CPU per request, the ratio, the load."""
    load = f" | load {row['loadavg_1m']:.2f}" if "loadavg_1m" in row else ""
    print(f"{what}, {batch:2d} ticket(s) a POST: gateway {row['gateway_requests_per_s']:6.0f} req/s "
          f"{row['gateway_cpu_ms_per_request']:.2f} ms CPU/req | minimal app {row['minimal_requests_per_s']:6.0f} "
          f"req/s {row['minimal_cpu_ms_per_request']:.2f} ms CPU/req | ratio {row['ratio']:.2f}x{load}",
          file=sys.stderr)  # fmt: skip


def _percentiles(latencies: list[float]) -> dict:
    cuts = statistics.quantiles(latencies, n=100)
    return {"requests": len(latencies), "p50_ms": 1000 * cuts[49], "p99_ms": 1000 * cuts[98]}


def all_answered(stack: Stack, ids: list[str], timeout: float) -> int:
    """How many of `ids` are in the results stream, waiting up to `timeout` for all."""
    from ticketq import codec

    client, wanted = redis.Redis(port=stack.redis_port), set(ids)
    deadline = time.monotonic() + timeout
    while True:
        seen = {codec.loads(fields[b"data"])["id"] for _, fields in client.xrange(RESULTS_STREAM)}
        if wanted <= seen or time.monotonic() > deadline:
            return len(wanted & seen)
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each load phase")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop concurrent clients")
    parser.add_argument("--batch", type=int, default=10, help="tickets per request in the batched phase")
    parser.add_argument("--rounds", type=int, default=1, help="gateway/minimal-app pairs of each closed loop")
    parser.add_argument("--compare-only", action="store_true", help="only the side-by-side closed loops")
    parser.add_argument("--producer-tickets", type=int, default=5000)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    loadavg_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack(Path(tmp))
        try:
            baseline = {} if args.compare_only else producer_rate(stack, args.producer_tickets)
            ids = list(baseline.pop("ids", []))
            ratios, single, batched = side_by_side(stack, args, ids)
            shares = () if args.compare_only else (0.5, 0.9)
            loads = [asyncio.run(open_loop(stack.gateway, share * single["requests_per_s"], args.seconds, ids))
                     for share in shares]  # fmt: skip
            answered = all_answered(stack, ids, 300)
        finally:
            stack.close()
    report = {"cpu": _cpu(), "loadavg_1m": [loadavg_before, os.getloadavg()[0]], "beside_minimal_app": ratios,
              "producer_submit_many": baseline, "closed_loop_single": single,
              "closed_loop_batched": batched, "open_loop": loads, "sent": len(ids), "answered": answered}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
