"""Open-loop load test: Poisson arrivals through Redis and a real worker, latency against offered load.

    python -m worker.loadtest --model models/qwen2.5-0.5b-standin --rates 0.5,0.8,1.0,1.2 --duration 30 \\
        --json docs/bench/loadtest.json --chart docs/bench/loadtest.png
    python -m worker.loadtest --null --duration 3          # the queue path alone (null classifier)

It starts one `ticketq worker` subprocess on a private queue, measures its capacity (a burst of
`--capacity-tickets` tickets, first send to last result) unless `--capacity` is given, then for each
fraction of that capacity sends single-ticket messages with exponential gaps (open loop: a late
send does not delay the next one's schedule) and collects every result from the results stream.
Per rate it reports p50/p95/p99 end-to-end latency (send to result in the stream, one clock),
time to first result, items/s, padding, forwards and peak queue depth. Figures are printed, never
asserted: the machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from producer.api import Producer
from producer.synthetic import generate_tickets
from worker import constants as c
from worker.demo import free_port, scrape, start_worker, wait_ready
from worker.settings import Settings

DEFAULT_RATES = (0.5, 0.8, 1.0, 1.2)


@dataclass
class RateResult:
    """One offered rate: what was sent, what came back, and how long it took."""

    fraction: float
    offered_per_s: float
    sent: int = 0
    completed: int = 0
    failed: int = 0
    p50_s: float | None = None
    p95_s: float | None = None
    p99_s: float | None = None
    mean_s: float | None = None
    time_to_first_result_s: float | None = None
    items_per_s: float | None = None
    padding: float | None = None
    forwards: int = 0
    mean_batch_rows: float | None = None
    mean_forward_s: float | None = None
    peak_queue_depth: int = 0  # messages in the broker list (the worker prefetches: usually small)
    peak_outstanding: int = 0  # sent and not yet answered: the whole system's queue, prefetched included


@dataclass
class Report:
    model: str
    capacity_per_s: float
    capacity_measured: bool
    duration_s: float
    machine: dict
    rates: list[RateResult] = field(default_factory=list)


# ----- one rate ---------------------------------------------------------------------------


class Collector(threading.Thread):
    """Reads the results stream from where it stood at the start; records when each ticket's result arrived."""

    def __init__(self, producer: Producer, since_id: str) -> None:
        super().__init__(name="loadtest-collector", daemon=True)
        self.producer, self.since_id = producer, since_id
        self.arrived: dict[str, tuple[float, str]] = {}  # ticket id -> (time, status)
        self.stop = threading.Event()

    def run(self) -> None:
        last = self.since_id
        client = self.producer.redis
        while not self.stop.is_set():
            reply = client.xread({c.RESULTS_STREAM: last}, count=1000, block=200)
            now = time.time()
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last = entry_id
                    result = json.loads(fields[b"data"])
                    self.arrived.setdefault(str(result.get("id")), (now, result.get("status", "?")))


def stream_position(producer: Producer) -> str:
    """The results stream's last id now: the collector reads only what comes after it."""
    reply = producer.redis.xrevrange(c.RESULTS_STREAM, count=1)
    return reply[0][0].decode() if reply else "0"


def send_poisson(producer: Producer, texts: list[str], rate: float, duration_s: float, seed: int,
                 sent: dict[str, float]) -> None:  # fmt: skip
    """Send single-ticket messages at Poisson times for `duration_s`, recording ticket id -> send time in `sent`."""
    rng = random.Random(seed)
    start = time.monotonic()
    due = 0.0
    for index in range(10**9):
        due += rng.expovariate(rate)
        if due > duration_s:
            break
        delay = start + due - time.monotonic()
        if delay > 0:  # load generation paces on the clock; behind schedule, send at once (open loop)
            time.sleep(delay)
        ticket_id = f"lt-{seed}-{index}"
        sent[ticket_id] = time.time()
        producer.submit(texts[index % len(texts)], id=ticket_id)


def run_rate(producer: Producer, metrics_url: str, texts: list[str], fraction: float, capacity: float,
             duration_s: float, seed: int) -> RateResult:  # fmt: skip
    result = RateResult(fraction, round(fraction * capacity, 3))
    before = scrape(metrics_url)
    collector = Collector(producer, stream_position(producer))
    collector.start()
    sent: dict[str, float] = {}
    depth = DepthSampler(producer, lambda: len(sent) - sum(1 for t in list(sent) if t in collector.arrived))
    depth.start()
    try:
        send_poisson(producer, texts, result.offered_per_s, duration_s, seed, sent)
        drain_s = 60 + 3 * duration_s
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline and not sent.keys() <= collector.arrived.keys():
            time.sleep(0.1)  # polling our own collector thread's dict; no cross-process sync involved
    finally:
        collector.stop.set()
        depth.stop.set()
        collector.join()
        depth.join()
    summarise(result, sent, collector.arrived, before, scrape(metrics_url))
    result.peak_queue_depth, result.peak_outstanding = depth.peak, depth.peak_outstanding
    return result


class DepthSampler(threading.Thread):
    """Samples the broker queue's length and the tickets outstanding every 50 ms; keeps the peaks."""

    def __init__(self, producer: Producer, outstanding) -> None:
        super().__init__(name="loadtest-depth", daemon=True)
        self.client = Producer(producer.settings)  # its own connection: the collector blocks on the other
        self.outstanding = outstanding
        self.peak = self.peak_outstanding = 0
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.wait(0.05):
                self.peak = max(self.peak, self.client.queue_depth())
                self.peak_outstanding = max(self.peak_outstanding, self.outstanding())
        finally:
            self.client.close()


def summarise(result: RateResult, sent: dict[str, float], arrived: dict[str, tuple[float, str]],
              before: dict[str, float], after: dict[str, float]) -> None:  # fmt: skip
    latencies = sorted(arrived[t][0] - sent[t] for t in sent if t in arrived)
    result.sent, result.completed = len(sent), len(latencies)
    result.failed = sum(1 for t in sent if t in arrived and arrived[t][1] != "ok")
    if latencies:
        result.p50_s, result.p95_s, result.p99_s = (round(percentile(latencies, q), 4) for q in (50, 95, 99))
        result.mean_s = round(statistics.fmean(latencies), 4)
        first_sent = min(sent.values())
        finished = [arrived[t][0] for t in sent if t in arrived]
        result.time_to_first_result_s = round(min(finished) - first_sent, 4)
        result.items_per_s = round(len(finished) / max(1e-9, max(finished) - first_sent), 3)
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    computed = delta.get("ticketq_tokens_computed_total{}", 0.0)
    result.padding = round(delta.get("ticketq_tokens_padded_total{}", 0.0) / computed, 4) if computed else None
    result.forwards = int(delta.get("ticketq_batch_size_count{}", 0))
    if result.forwards:
        result.mean_batch_rows = round(delta.get("ticketq_batch_size_sum{}", 0.0) / result.forwards, 2)
        result.mean_forward_s = round(delta.get("ticketq_forward_seconds_sum{}", 0.0) / result.forwards, 4)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    rank = max(1, min(len(sorted_values), math.ceil(q / 100 * len(sorted_values))))
    return sorted_values[rank - 1]


# ----- capacity, the worker, the whole run ---------------------------------------------------


def measure_capacity(producer: Producer, texts: list[str], tickets: int) -> float:
    """Items/s of a burst of `tickets` single-ticket messages, first send to last result."""
    start = time.perf_counter()
    sent = producer.submit_many([{"id": f"cap-{uuid.uuid4().hex[:6]}-{i}", "text": texts[i % len(texts)]}
                                 for i in range(tickets)])  # fmt: skip
    producer.wait(sent, timeout=max(600.0, 10.0 * tickets))
    return tickets / (time.perf_counter() - start)


def worker_env(args: argparse.Namespace, queue: str, port: int) -> dict[str, str]:
    env = {**os.environ, "TICKETQ_QUEUE": queue, "TICKETQ_METRICS_HOST": "127.0.0.1",
           "TICKETQ_METRICS_PORT": str(port), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if args.broker_url:
        env["TICKETQ_BROKER_URL"] = args.broker_url
    if args.null:
        env["TICKETQ_NULL_CLASSIFIER"] = "1"
    else:
        env["TICKETQ_NULL_CLASSIFIER"] = "0"
        env["TICKETQ_MODEL"] = args.model or env.get("TICKETQ_MODEL", Settings().model)
    if args.threads:
        env["TICKETQ_THREADS"] = str(args.threads)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return env


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"host": platform.node(), "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "loadavg_at_end": [round(x, 2) for x in load] if load else None}  # fmt: skip


def run(args: argparse.Namespace) -> Report:
    queue = f"ticketq-loadtest-{uuid.uuid4().hex[:8]}"
    settings = Settings(**({"broker_url": args.broker_url} if args.broker_url else {}), queue=queue)
    texts = [t["text"] for t in generate_tickets(args.pool, seed=args.seed)]
    port = free_port(0)
    log_path = Path(tempfile.gettempdir(), f"{queue}-worker.log")
    proc = start_worker(worker_env(args, queue, port), log_path)
    producer = Producer(settings)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_ready(proc, url, log_path)
        producer.wait(producer.submit_many(texts[:8]), timeout=600)  # warm-up: kernels, connections
        capacity = args.capacity or measure_capacity(producer, texts, args.capacity_tickets)
        model = "null-classifier" if args.null else worker_env(args, queue, port)["TICKETQ_MODEL"]
        report = Report(model, round(capacity, 3), args.capacity is None, args.duration, {})
        for number, fraction in enumerate(args.rates):
            rate = run_rate(producer, url, texts, fraction, capacity, args.duration, seed=args.seed + number)
            report.rates.append(rate)
            print(table_row(rate), file=sys.stderr, flush=True)
        report.machine = machine()
        return report
    finally:
        producer.redis.delete(queue)
        producer.close()
        proc.terminate()
        proc.wait(timeout=60)


# ----- output --------------------------------------------------------------------------------

HEADER = ("| offered (× capacity) | offered/s | sent | items/s | p50 s | p95 s | p99 s | first result s | padding "
          "| forwards | rows/forward | peak broker queue | peak outstanding |\n" + "|---" * 13 + "|")  # fmt: skip


def table_row(r: RateResult) -> str:
    def f(value, spec=".3f"):
        return "—" if value is None else format(value, spec)

    return (f"| {r.fraction:.2f}× | {r.offered_per_s:.2f} | {r.sent} | {f(r.items_per_s, '.2f')} | {f(r.p50_s)} "
            f"| {f(r.p95_s)} | {f(r.p99_s)} | {f(r.time_to_first_result_s)} | {f(r.padding, '.1%')} | {r.forwards} "
            f"| {f(r.mean_batch_rows, '.1f')} | {r.peak_queue_depth} | {r.peak_outstanding} |")  # fmt: skip


def markdown(report: Report) -> str:
    return "\n".join([HEADER, *(table_row(r) for r in report.rates)])


def chart(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    rows = [r for r in report.rates if r.p50_s is not None]
    x = [r.offered_per_s for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in (("p50_s", "o-"), ("p95_s", "s--"), ("p99_s", "^:")):
        ax.plot(x, [getattr(r, name) for r in rows], style, label=name.removesuffix("_s"))
    ax.axvline(report.capacity_per_s, color="grey", lw=0.8, ls="--", label=f"capacity {report.capacity_per_s:.2f}/s")
    ax.set_xlabel("offered load, tickets/s (Poisson arrivals)")
    ax.set_ylabel("end-to-end latency, s")
    ax.set_yscale("log")
    ax.set_title(f"ticketq latency vs offered load — {Path(report.model).name}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="TICKETQ_MODEL for the worker (default: the environment's)")
    parser.add_argument("--null", action="store_true", help="null classifier: the queue path alone")
    parser.add_argument("--rates", type=_fractions, default=DEFAULT_RATES,
                        help="fractions of capacity, comma separated (default 0.5,0.8,1.0,1.2)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    parser.add_argument("--capacity", type=_positive, help="items/s to scale the rates by (default: measure it)")
    parser.add_argument("--capacity-tickets", type=int, default=100, help="burst size of the capacity measurement")
    parser.add_argument("--pool", type=int, default=600, help="synthetic tickets to draw texts from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="TICKETQ_THREADS for the worker")
    parser.add_argument("--broker-url", help="Redis URL (default: TICKETQ_BROKER_URL)")
    parser.add_argument("--json", type=Path, help="write the report as JSON here")
    parser.add_argument("--chart", type=Path, help="write latency vs offered load as PNG here")
    parser.add_argument("--markdown", type=Path, help="write the table as Markdown here")
    args = parser.parse_args(argv)
    if args.capacity_tickets < 1:
        parser.error(f"--capacity-tickets must be >= 1, got {args.capacity_tickets}")
    if args.duration <= 0:
        parser.error(f"--duration must be > 0 seconds, got {args.duration}")
    return args


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers separated by commas, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"every rate must be > 0, got {text!r}")
    return values


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(f"capacity {report.capacity_per_s:.2f} items/s ({'measured' if report.capacity_measured else 'given'}), "
          f"model {report.model}, load average {report.machine.get('loadavg_at_end')}")  # fmt: skip
    print(markdown(report))
    data = asdict(report)
    if args.json:
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(report) + "\n")
    if args.chart:
        chart(report, args.chart)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
