"""Open-loop load test: Poisson arrivals through Redis and a real worker, latency against offered load.

    ticketq loadtest --model models/qwen2.5-0.5b-standin --rates 0.5,0.8,1.0,1.2 --duration 30 \\
        --json docs/bench/loadtest.json --chart docs/bench/loadtest.png
    ticketq loadtest --null --duration 3          # the queue path alone (null classifier)

(`python -m ticketq_bench.loadtest` takes the same options.) It starts one `ticketq worker` subprocess
(`ticketq_bench.procs`) on a private queue, measures its capacity (a burst of
`--capacity-tickets` tickets, first send to last result) unless `--capacity` is given, then for each
fraction of that capacity sends single-ticket messages with exponential gaps (open loop: a late
send does not delay the next one's schedule) and collects every result from the results stream.
Per rate it reports p50/p95/p99 end-to-end latency (send to result in the stream, one clock),
time to first result, items/s, padding, forwards and peak queue depth. Figures are printed, never
asserted: the machines are shared and noisy.
"""

from __future__ import annotations

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from producer.api import Producer
from producer.synthetic import generate_tickets
from ticketq.cli import CONTEXT_SETTINGS
from ticketq.names import RESULTS_STREAM
from ticketq_bench.procs import free_port, model_info, running_worker, scrape
from worker.settings import Settings

DEFAULT_RATES = (0.5, 0.8, 1.0, 1.2)


@dataclass(frozen=True)
class Options:
    """One load test as the command line asked for it."""

    model: str | None = None
    null: bool = False
    rates: tuple[float, ...] = DEFAULT_RATES
    duration: float = 20.0
    capacity: float | None = None
    capacity_tickets: int = 100
    pool: int = 600
    seed: int = 0
    threads: int | None = None
    broker_url: str | None = None
    json: Path | None = None
    chart: Path | None = None
    markdown: Path | None = None


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
            reply = client.xread({RESULTS_STREAM: last}, count=1000, block=200)
            now = time.time()
            for _, entries in reply or ():
                for entry_id, fields in entries:
                    last = entry_id
                    result = json.loads(fields[b"data"])
                    self.arrived.setdefault(str(result.get("id")), (now, result.get("status", "?")))


def stream_position(producer: Producer) -> str:
    """The results stream's last id now: the collector reads only what comes after it."""
    reply = producer.redis.xrevrange(RESULTS_STREAM, count=1)
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


def worker_env(options: Options, queue: str, port: int) -> dict[str, str]:
    env = {**os.environ, "TICKETQ_QUEUE": queue, "TICKETQ_METRICS_HOST": "127.0.0.1",
           "TICKETQ_METRICS_PORT": str(port), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    if options.broker_url:
        env["TICKETQ_BROKER_URL"] = options.broker_url
    if options.null:
        env["TICKETQ_NULL_CLASSIFIER"] = "1"
    else:
        env["TICKETQ_NULL_CLASSIFIER"] = "0"
        env["TICKETQ_MODEL"] = options.model or env.get("TICKETQ_MODEL", Settings().model)
    if options.threads:
        env["TICKETQ_THREADS"] = str(options.threads)
    return env


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"host": platform.node(), "cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "loadavg_at_end": [round(x, 2) for x in load] if load else None}  # fmt: skip


def run(options: Options) -> Report:
    """A worker on a private queue, its capacity, then every rate in turn; the queue is deleted after."""
    queue = f"ticketq-loadtest-{uuid.uuid4().hex[:8]}"
    settings = Settings(**({"broker_url": options.broker_url} if options.broker_url else {}), queue=queue)
    texts = [t["text"] for t in generate_tickets(options.pool, seed=options.seed)]
    env = worker_env(options, queue, free_port())
    producer = Producer(settings)
    try:
        with running_worker(env, Path(tempfile.gettempdir(), f"{queue}-worker.log")) as worker:
            model = "null-classifier" if options.null else env["TICKETQ_MODEL"]
            report = run_rates(producer, worker.metrics_url, texts, model, options)
            ran = model_info(worker.metrics())  # what the worker's `auto` settings chose on this machine
            report.machine["worker"] = {k: ran[k] for k in ("dtype", "device", "matmul") if k in ran}
            return report
    finally:
        producer.redis.delete(queue)
        producer.close()


def run_rates(producer: Producer, metrics_url: str, texts: list[str], model: str, options: Options) -> Report:
    """Warm up, measure (or take) the capacity, then each offered rate; one table row per rate on stderr."""
    producer.wait(producer.submit_many(texts[:8]), timeout=600)  # warm-up: kernels, connections
    capacity = options.capacity or measure_capacity(producer, texts, options.capacity_tickets)
    report = Report(model, round(capacity, 3), options.capacity is None, options.duration, {})
    for number, fraction in enumerate(options.rates):
        rate = run_rate(producer, metrics_url, texts, fraction, capacity, options.duration, seed=options.seed + number)
        report.rates.append(rate)
        print(table_row(rate), file=sys.stderr, flush=True)
    report.machine = machine()
    return report


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


# ----- command line ----------------------------------------------------------------------------


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"rates must be numbers separated by commas, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise typer.BadParameter(f"every rate must be > 0, got {text!r}")
    return values


def _positive(value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise typer.BadParameter(f"must be > 0, got {value}")
    return value


app = typer.Typer(add_completion=False, context_settings=CONTEXT_SETTINGS, pretty_exceptions_enable=False)


@app.command(help=__doc__.split("\n\n")[0])
def loadtest(
    model: Annotated[str | None, typer.Option(help="TICKETQ_MODEL for the worker (default: the environment's)")] = None,
    null: Annotated[bool, typer.Option("--null", help="null classifier: the queue path alone")] = False,
    rates: Annotated[str, typer.Option(callback=_fractions, show_default=False,  # the callback makes it a tuple
                     help="fractions of capacity, comma separated (default 0.5,0.8,1.0,1.2)")] = "0.5,0.8,1.0,1.2",
    duration: Annotated[float, typer.Option(callback=_positive, help="seconds of arrivals per rate")] = 20.0,
    capacity: Annotated[float | None, typer.Option(callback=_positive,
                        help="items/s to scale the rates by (default: measure it)")] = None,
    capacity_tickets: Annotated[int, typer.Option(min=1, help="burst size of the capacity measurement")] = 100,
    pool: Annotated[int, typer.Option(help="synthetic tickets to draw texts from")] = 600,
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[int | None, typer.Option(help="TICKETQ_THREADS for the worker")] = None,
    broker_url: Annotated[str | None, typer.Option(help="Redis URL (default: TICKETQ_BROKER_URL)")] = None,
    json_path: Annotated[Path | None, typer.Option("--json", help="write the report as JSON here")] = None,
    chart_path: Annotated[Path | None, typer.Option("--chart",
                          help="write latency vs offered load as PNG here")] = None,
    markdown_path: Annotated[Path | None, typer.Option("--markdown", help="write the table as Markdown here")] = None,
) -> None:  # fmt: skip
    options = Options(model, null, tuple(rates), duration, capacity, capacity_tickets, pool, seed, threads,
                      broker_url, json_path, chart_path, markdown_path)  # fmt: skip
    write_report(run(options), options)


def write_report(report: Report, options: Options) -> None:
    """The summary line and the table on stdout; JSON, Markdown and the chart where asked."""
    ran = report.machine.get("worker") or {}
    runs = f" ({'/'.join(ran[k] for k in ('device', 'dtype', 'matmul') if k in ran)})" if ran else ""
    print(f"capacity {report.capacity_per_s:.2f} items/s ({'measured' if report.capacity_measured else 'given'}), "
          f"model {report.model}{runs}, load average {report.machine.get('loadavg_at_end')}")  # fmt: skip
    print(markdown(report))
    if options.json:
        options.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
    if options.markdown:
        options.markdown.write_text(markdown(report) + "\n")
    if options.chart:
        chart(report, options.chart)


def main(argv: Sequence[str] | None = None) -> int:
    """`ticketq loadtest ARGV` (also `python -m ticketq_bench.loadtest ARGV`); the exit status."""
    try:
        app(list(sys.argv[1:] if argv is None else argv), prog_name="ticketq loadtest")
    except SystemExit as exc:  # click's standalone mode ends every run, good or bad, in SystemExit
        return 0 if exc.code is None else int(exc.code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
