"""Prometheus metrics of one worker process: every series takes an injected registry.

Padding ratio in PromQL: `rate(ticketq_tokens_padded_total[1m]) / rate(ticketq_tokens_computed_total[1m])`.
Items/s per queue: `sum by (queue) (rate(ticketq_tickets_total{outcome="ok"}[1m]))`.

A worker consumes one queue (TICKETQ_QUEUE), given at construction: the per-ticket series and the
queue depth carry it as their `queue` label, and `target_info{queue}` names it for the rest (join
`* on (instance) group_left (queue) target_info`). One value per process: no series multiplies.

The server on TICKETQ_METRICS_PORT (`worker.httpserver`) answers `/metrics` with the series (ticketq's, plus the
process and platform collectors: memory, CPU, open fds), `/healthz` with 200 while the process
serves HTTP (liveness), `/readyz` with 200 only when every readiness check passes (Redis
reachable, model loaded, plus the caller's own check, e.g. the consumer running and Redis taking
writes), else 503 and the reasons (readiness: send it tickets or not), then a line of what the
caller's `about` reports (Redis's maxmemory-policy), and any other path with 404. Counters carry no
`_created` series: nothing reads them, and they doubled the series count.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ticketq.names import QUEUE
from worker import constants as c
from worker.health.data_loss import DATA_LOST
from worker.health.progress import CLASSIFYING
from worker.httpserver import Check, health_app, wsgi_server
from worker.results import RUNS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


M = TypeVar("M")


def queue_depth_family(depths: Mapping[str, float]) -> GaugeMetricFamily:
    """`ticketq_queue_depth{queue}`, one sample per queue: as a worker and `ticketq exporter` export it."""
    family = GaugeMetricFamily(c.M_QUEUE_DEPTH, "Messages waiting in the broker queue.", labels=["queue"])
    for queue, depth in depths.items():
        family.add_metric([queue], float(depth))
    return family


class QueueDepthCollector:
    """Samples the broker queue's length (LLEN) at scrape time, so alerts see the backlog."""

    def __init__(self, depth: Callable[[], int], queue: str) -> None:
        self._depth, self._queue = depth, queue

    def collect(self):
        try:
            depth = self._depth()
        except Exception:  # a scrape must not fail because the broker is briefly away
            return
        yield queue_depth_family({self._queue: depth})


class QueueBound(Generic[M]):
    """A labelled metric whose `queue` label is this worker's queue: `labels(**others)` fills it in,
    so a call site names only the labels that vary (prometheus_client has no constant labels)."""

    def __init__(self, metric: M, queue: str) -> None:
        self.metric, self.queue = metric, queue

    def labels(self, **labels: str) -> M:
        return self.metric.labels(queue=self.queue, **labels)


class TallyCollector:
    """A counter kept elsewhere (a process-wide tally), read at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterable[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class BoundsCollector:
    """Each re-checked runner's error bound (by schema: its precision and bound), read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[str, tuple[str, float]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            c.M_ERROR_BOUND, "A fast precision's re-check bound: answers whose smallest decision gap (log space) "
            "is below it are computed again in float32; by precision and schema.", labels=["precision", "schema"],
        )  # fmt: skip
        for schema, (precision, bound) in sorted(self._read().items()):
            family.add_metric([precision, schema], bound)
        yield family


class HookErrorsCollector:
    """Hook calls that raised, by hook and call point (`worker.service.hooks.Hooks.errors`), read at scrape time."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(c.M_HOOK_ERRORS, "Hook calls that raised (logged; the job went on), by hook "
                                     "and call point.", labels=["hook", "point"])  # fmt: skip
        for (hook, point), count in sorted(self._read().items()):
            family.add_metric([hook, point], count)
        yield family


class ManyHistogram:
    """A histogram that takes a whole forward batch's observations in one call (`observe_many`).

    prometheus_client's `Histogram.observe` takes one value per call (a lock, a bucket search and
    two increments each): with one latency and one queue-wait observation per ticket, that was a
    tenth of the worker's CPU at tens of thousands of tickets a second. Exposed through the
    custom-collector API, with the series a `Histogram` has (`_bucket`, `_count`, `_sum`); `labels`:
    fixed labels every sample carries (the worker's queue).
    """

    def __init__(self, name: str, documentation: str, buckets: Iterable[float], registry: CollectorRegistry,
                 labels: Mapping[str, str] | None = None) -> None:  # fmt: skip
        bounds = sorted(float(b) for b in buckets)
        self._bounds = (*bounds, math.inf) if not bounds or bounds[-1] != math.inf else tuple(bounds)
        self._name, self._documentation, self._labels = name, documentation, dict(labels or {})
        self._counts = [0] * len(self._bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        values = list(values)
        per_bucket = Tally(bisect_left(self._bounds, value) for value in values)  # first bound >= value: le
        total = math.fsum(values)
        with self._lock:
            for index, count in per_bucket.items():
                self._counts[index] += count
            self._sum += total

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterable[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        family.add_metric(list(self._labels.values()), buckets, total)
        yield family


class Metrics:
    """All of ticketq's series, registered in `registry`, for a worker that consumes `queue`."""

    def __init__(self, registry: CollectorRegistry | None = None, queue: str = QUEUE) -> None:
        if not queue:
            raise ValueError("Metrics: queue must name the queue the worker consumes (TICKETQ_QUEUE)")
        disable_created_metrics()  # process-wide in prometheus_client; ticketq exports no _created series
        self.registry = registry if registry is not None else CollectorRegistry()
        self.queue = queue
        r = self.registry
        r.set_target_info({"queue": queue})  # for joins: `* on (instance) group_left (queue) target_info`
        r.register(PROCESS_COLLECTOR)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds
        r.register(PLATFORM_COLLECTOR)  # python_info
        self.tickets = QueueBound(Counter(c.M_TICKETS, "Tickets finished, by queue, label and outcome.",
                                          ["queue", "label", "outcome"], registry=r), queue)  # fmt: skip
        self.tokens_real = Counter(c.M_TOKENS_REAL, "Real (non-pad) tokens run through the model.", registry=r)
        self.tokens_computed = Counter(c.M_TOKENS_COMPUTED, "Tokens computed in forward passes.", registry=r)
        self.tokens_padded = Counter(c.M_TOKENS_PADDED, "Pad tokens computed in forward passes.", registry=r)
        self.padding_ratio = Gauge(c.M_PADDING_RATIO_LAST, "Padding ratio of the last forward batch.", registry=r)
        self.batch_size = Histogram(c.M_BATCH_SIZE, "Tickets per forward batch.", buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            c.M_BATCH_TOKENS, "Padded tokens per forward batch.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.queue_wait = ManyHistogram(c.M_QUEUE_WAIT, "Submit to batch start, seconds.", LATENCY_BUCKETS, r,
                                        {"queue": queue})  # fmt: skip
        self.forward = Histogram(c.M_FORWARD, "One forward batch, seconds.", buckets=LATENCY_BUCKETS, registry=r)
        self.latency = ManyHistogram(c.M_LATENCY, "Submit to result published, seconds.", LATENCY_BUCKETS, r,
                                     {"queue": queue})  # fmt: skip
        self.prefix_reuses = Counter(c.M_PREFIX_REUSES, "Forward batches that reused the prefix KV cache.", registry=r)
        self.dead_letters = QueueBound(Counter(c.M_DEAD_LETTERS, "Messages or tickets dead-lettered, by queue and "
                                               "reason.", ["queue", "reason"], registry=r), queue)  # fmt: skip
        self.shadow_checked = Counter(c.M_SHADOW_CHECKED, "Tickets re-run on the reference path.", registry=r)
        self.shadow_agreed = Counter(c.M_SHADOW_AGREED, "Shadow-checked tickets whose label matched.", registry=r)
        self.shadow_dropped = Counter(c.M_SHADOW_DROPPED, "Shadow samples dropped (checker busy).", registry=r)
        self.shadow_disagreed = Counter(
            c.M_SHADOW_DISAGREED, "Shadow-checked tickets whose label differed; near_tie: reference margin "
            f"below {c.NEAR_TIE}.", ["near_tie"], registry=r,
        )  # fmt: skip
        self.requests_waiting = Gauge(c.M_REQUESTS_WAITING, "Messages buffered in the worker, not yet in a job.",
                                      registry=r)  # fmt: skip
        self.requests_running = Gauge(c.M_REQUESTS_RUNNING, "Messages of the running job not yet answered.",
                                      registry=r)  # fmt: skip
        self.build = Info(c.M_BUILD_INFO, "ticketq's version and the versions of the libraries it runs on.",
                          registry=r)  # fmt: skip
        self.build.info(build_versions())
        self.field_answers = QueueBound(Counter(
            c.M_FIELD_ANSWERS, "Schema field answers, by queue, schema, field, label (a multi-label field: each "
            "chosen, none for none) and review (confidence below the field's threshold).",
            ["queue", "schema", "field", "label", "review"], registry=r,
        ), queue)  # fmt: skip
        self.duplicates = Counter(c.M_DUPLICATES, "Re-executed tickets whose result was already out.", registry=r)
        self.cost_model = Gauge(
            c.M_COST_MODEL, "The planner's cost model of one forward, in seconds: fixed, per computed token "
            "(token), attention per row x width^2 (quad).", ["term"], registry=r,
        )  # fmt: skip
        self.cost_model_error = Gauge(c.M_COST_MODEL_ERROR, "Median relative error of the last live cost fit "
                                      "over the recent forwards' shapes.", registry=r)  # fmt: skip
        self.cost_model_fits = Counter(c.M_COST_MODEL_FITS, "Live refits of the planner's cost model kept.", registry=r)
        self.stalled = Gauge(
            c.M_STALLED, "Seconds the classifying loop has held work without progress, once past "
            "TICKETQ_WORST_BATCH_S (its lease is then no longer renewed); 0 otherwise.", registry=r,
        )  # fmt: skip
        self.stalled.set_function(CLASSIFYING.stalled_for)
        r.register(TallyCollector(
            c.M_REDIS_DATA_LOST, "Times this worker found Redis without its data (restarted without persistence, "
            "or flushed): the epoch marker gone.", lambda: DATA_LOST.count,
        ))  # fmt: skip
        self.answers = Counter(
            c.M_ANSWERS, "Answers by the precision that computed them (float32, bfloat16, float16, int8) and "
            "rechecked (true: a fast precision's answer within its error bound, computed again in float32).",
            ["precision", "rechecked"], registry=r,
        )  # fmt: skip
        r.register(TallyCollector(
            c.M_RECHECKED, "Tickets a fast precision could not settle (a decision gap within its error bound), "
            "computed again in float32.", lambda: RUNS.rechecked,
        ))  # fmt: skip
        r.register(TallyCollector(
            c.M_DEDUPLICATED, "Tickets answered with an identical ticket's answer in the same run (the same token "
            "ids and schema), not computed.", lambda: RUNS.deduplicated,
        ))  # fmt: skip
        self.answer_cache = Counter(c.M_ANSWER_CACHE, "Tickets looked up in the answer cache "
                                    "(TICKETQ_ANSWER_CACHE_S), by result: hit (answered from it) or miss.",
                                    ["result"], registry=r)  # fmt: skip
        self._bounds: Callable[[], Mapping[str, tuple[str, float]]] = dict
        r.register(BoundsCollector(lambda: self._bounds()))
        self.flushes = Counter(c.M_FLUSHES, "Buffer drains (micro-batches handed to the engine).", registry=r)
        self.first_result = Histogram(
            c.M_FIRST_RESULT, "Batch start to its first result published, seconds.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.publish = Histogram(
            c.M_PUBLISH, "Publishing one forward batch's results (stream + backend), seconds.",
            buckets=PUBLISH_BUCKETS, registry=r,
        )  # fmt: skip
        self.model = Info(
            c.M_MODEL_INFO, "The model this worker serves: model, standin, dtype, device, matmul, recheck, fused.",
            registry=r,
        )

    def preinit(self, labels: tuple[str, ...], reasons: tuple[str, ...],
                fields: Iterable[tuple[str, str, Iterable[str]]] = ()) -> None:  # fmt: skip
        """Create the labelled series at 0 so dashboards and rate() see them before the first event
        (`fields`: each schema field's (schema, field, labels))."""
        for schema, name, choices in fields:
            for label in choices:
                for review in ("true", "false"):
                    self.field_answers.labels(schema=schema, field=name, label=label, review=review)
        for label in labels:
            self.tickets.labels(label=label, outcome="ok")
        for outcome in ("failed", "rejected", "expired"):
            self.tickets.labels(label="none", outcome=outcome)
        for reason in reasons:
            self.dead_letters.labels(reason=reason)
        for near_tie in ("true", "false"):
            self.shadow_disagreed.labels(near_tie=near_tie)
        for result in ("hit", "miss"):
            self.answer_cache.labels(result=result)

    def watch_bounds(self, bounds: Callable[[], Mapping[str, tuple[str, float]]]) -> None:
        """Export the classifier's re-check bounds (schema -> (precision, bound)) at scrape time."""
        self._bounds = bounds

    def watch_hook_errors(self, errors: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        """Export the service's count of hook calls that raised, at scrape time."""
        self.registry.register(HookErrorsCollector(errors))

    def watch_requests(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Sample the worker's buffered and running messages at scrape time."""
        self.requests_waiting.set_function(waiting)
        self.requests_running.set_function(running)

    def observe_batch(self, rows: int, width: int, real_tokens: int, seconds: float) -> None:
        computed = rows * width
        self.tokens_real.inc(real_tokens)
        self.tokens_computed.inc(computed)
        self.tokens_padded.inc(computed - real_tokens)
        self.padding_ratio.set((computed - real_tokens) / computed if computed else 0.0)
        self.batch_size.observe(rows)
        self.batch_tokens.observe(computed)
        self.forward.observe(seconds)
        self.prefix_reuses.inc()

    def observe_cost_model(self, fixed_ms: float, token_ms: float, quad_ms: float, error: float | None = None) -> None:
        """The planner's cost model now (ms, exported in seconds); `error`: a live fit's, one more fit."""
        for term, value in (("fixed", fixed_ms), ("token", token_ms), ("quad", quad_ms)):
            self.cost_model.labels(term=term).set(value / 1000)
        if error is not None:
            self.cost_model_error.set(error)
            self.cost_model_fits.inc()

    def watch_queue(self, depth: Callable[[], int]) -> None:
        """Sample `depth()` (the length of this worker's queue) at scrape time as `ticketq_queue_depth{queue}`."""
        self.registry.register(QueueDepthCollector(depth, self.queue))
        self._depth = depth

    def serve(
        self, host: str, port: int, ready: Check | None = None, about: Callable[[], str] | None = None
    ) -> WSGIServer:
        """Serve /metrics, /healthz and /readyz on host:port (the default host is loopback only).

        `ready` is an extra readiness check (e.g. "consumer running"), on top of Redis reachable
        (through the queue-depth probe given to `watch_queue`) and model info set; `about` gives
        a line /readyz adds to its answer, ready or not (e.g. Redis's maxmemory-policy).
        """
        checks = [self._redis_reachable, self._model_loaded, *([ready] if ready else [])]
        server = wsgi_server(host, port, health_app(make_wsgi_app(self.registry), checks, about))
        threading.Thread(target=server.serve_forever, name="ticketq-metrics", daemon=True).start()
        return server

    def _redis_reachable(self) -> str | None:
        depth = getattr(self, "_depth", None)
        if depth is None:
            return None  # nothing to probe: no queue watched
        try:
            depth()
        except Exception as exc:  # any failure of the probe means tickets cannot flow
            return f"Redis unreachable ({type(exc).__name__}: {exc})"
        return None

    def _model_loaded(self) -> str | None:
        samples = [sample for family in self.model.collect() for sample in family.samples]
        return None if any(sample.labels for sample in samples) else "model not loaded"


def build_versions() -> dict[str, str]:
    """The `ticketq_build_info` labels: installed versions, read from package metadata (no imports)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for name in ("ticketq", "torch", "transformers", "celery", "kombu"):
        try:
            versions["version" if name == "ticketq" else name] = version(name)
        except PackageNotFoundError:
            versions["version" if name == "ticketq" else name] = "unknown"
    return versions


