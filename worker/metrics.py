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

import threading
from collections.abc import Callable, Iterable, Mapping
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

from ticketq.names import QUEUE
from worker import constants as c
from worker.collectors import (
    BoundsCollector,
    HookErrorsCollector,
    ManyHistogram,
    QueueBound,
    QueueDepthCollector,
    TallyCollector,
)
from worker.health import Health
from worker.httpserver import Check, health_app, wsgi_server
from worker.results import RunTally

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PUBLISH_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)


class TicketSeries:
    """What became of the tickets and messages: outcomes, answers, dead letters, latencies, the buffer."""

    def __init__(self, r: CollectorRegistry, queue: str) -> None:
        self.tickets = QueueBound(Counter(c.M_TICKETS, "Tickets finished, by queue, label and outcome.",
                                          ["queue", "label", "outcome"], registry=r), queue)  # fmt: skip
        self.dead_letters = QueueBound(Counter(c.M_DEAD_LETTERS, "Messages or tickets dead-lettered, by queue and "
                                               "reason.", ["queue", "reason"], registry=r), queue)  # fmt: skip
        self.field_answers = QueueBound(Counter(
            c.M_FIELD_ANSWERS, "Schema field answers, by queue, schema, field, label (a multi-label field: each "
            "chosen, none for none) and review (confidence below the field's threshold).",
            ["queue", "schema", "field", "label", "review"], registry=r,
        ), queue)  # fmt: skip
        self.duplicates = Counter(c.M_DUPLICATES, "Re-executed tickets whose result was already out.", registry=r)
        self.answers = Counter(
            c.M_ANSWERS, "Answers by the precision that computed them (float32, bfloat16, float16, int8) and "
            "rechecked (true: a fast precision's answer within its error bound, computed again in float32).",
            ["precision", "rechecked"], registry=r,
        )  # fmt: skip
        self.answer_cache = Counter(c.M_ANSWER_CACHE, "Tickets looked up in the answer cache "
                                    "(TICKETQ_ANSWER_CACHE_S), by result: hit (answered from it) or miss.",
                                    ["result"], registry=r)  # fmt: skip
        self.queue_wait = ManyHistogram(c.M_QUEUE_WAIT, "Submit to batch start, seconds.", LATENCY_BUCKETS, r,
                                        {"queue": queue})  # fmt: skip
        self.latency = ManyHistogram(c.M_LATENCY, "Submit to result published, seconds.", LATENCY_BUCKETS, r,
                                     {"queue": queue})  # fmt: skip
        self.first_result = Histogram(
            c.M_FIRST_RESULT, "Batch start to its first result published, seconds.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.publish = Histogram(
            c.M_PUBLISH, "Publishing one forward batch's results (stream + backend), seconds.",
            buckets=PUBLISH_BUCKETS, registry=r,
        )  # fmt: skip
        self.flushes = Counter(c.M_FLUSHES, "Buffer drains (micro-batches handed to the engine).", registry=r)
        self.requests_waiting = Gauge(c.M_REQUESTS_WAITING, "Messages buffered in the worker, not yet in a job.",
                                      registry=r)  # fmt: skip
        self.requests_running = Gauge(c.M_REQUESTS_RUNNING, "Messages of the running job not yet answered.",
                                      registry=r)  # fmt: skip

    def watch_requests(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        """Sample the worker's buffered and running messages at scrape time."""
        self.requests_waiting.set_function(waiting)
        self.requests_running.set_function(running)


class ForwardSeries:
    """The forward batches: tokens computed and padded, sizes, durations, and the planner's cost model."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.tokens_real = Counter(c.M_TOKENS_REAL, "Real (non-pad) tokens run through the model.", registry=r)
        self.tokens_computed = Counter(c.M_TOKENS_COMPUTED, "Tokens computed in forward passes.", registry=r)
        self.tokens_padded = Counter(c.M_TOKENS_PADDED, "Pad tokens computed in forward passes.", registry=r)
        self.padding_ratio = Gauge(c.M_PADDING_RATIO_LAST, "Padding ratio of the last forward batch.", registry=r)
        self.batch_size = Histogram(c.M_BATCH_SIZE, "Tickets per forward batch.", buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            c.M_BATCH_TOKENS, "Padded tokens per forward batch.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.forward = Histogram(c.M_FORWARD, "One forward batch, seconds.", buckets=LATENCY_BUCKETS, registry=r)
        self.prefix_reuses = Counter(c.M_PREFIX_REUSES, "Forward batches that reused the prefix KV cache.", registry=r)
        self.cost_model = Gauge(
            c.M_COST_MODEL, "The planner's cost model of one forward, in seconds: fixed, per computed token "
            "(token), attention per row x width^2 (quad).", ["term"], registry=r,
        )  # fmt: skip
        self.cost_model_error = Gauge(c.M_COST_MODEL_ERROR, "Median relative error of the last live cost fit "
                                      "over the recent forwards' shapes.", registry=r)  # fmt: skip
        self.cost_model_fits = Counter(c.M_COST_MODEL_FITS, "Live refits of the planner's cost model kept.", registry=r)

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


class ShadowSeries:
    """The shadow check: tickets re-run on the reference path, and whether their labels agreed."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.shadow_checked = Counter(c.M_SHADOW_CHECKED, "Tickets re-run on the reference path.", registry=r)
        self.shadow_agreed = Counter(c.M_SHADOW_AGREED, "Shadow-checked tickets whose label matched.", registry=r)
        self.shadow_dropped = Counter(c.M_SHADOW_DROPPED, "Shadow samples dropped (checker busy).", registry=r)
        self.shadow_disagreed = Counter(
            c.M_SHADOW_DISAGREED, "Shadow-checked tickets whose label differed; near_tie: reference margin "
            f"below {c.NEAR_TIE}.", ["near_tie"], registry=r,
        )  # fmt: skip


class HealthSeries:
    """The process's health and its runs' tally, read at scrape time: a stalled loop, data lost,
    tickets re-checked or deduplicated."""

    def __init__(self, r: CollectorRegistry, health: Health, runs: RunTally) -> None:
        self.stalled = Gauge(
            c.M_STALLED, "Seconds the classifying loop has held work without progress, once past "
            "TICKETQ_WORST_BATCH_S (its lease is then no longer renewed); 0 otherwise.", registry=r,
        )  # fmt: skip
        self.stalled.set_function(health.classifying.stalled_for)
        r.register(TallyCollector(
            c.M_REDIS_DATA_LOST, "Times this worker found Redis without its data (restarted without persistence, "
            "or flushed): the epoch marker gone.", lambda: health.data_loss.count,
        ))  # fmt: skip
        r.register(TallyCollector(
            c.M_RECHECKED, "Tickets a fast precision could not settle (a decision gap within its error bound), "
            "computed again in float32.", lambda: runs.rechecked,
        ))  # fmt: skip
        r.register(TallyCollector(
            c.M_DEDUPLICATED, "Tickets answered with an identical ticket's answer in the same run (the same token "
            "ids and schema), not computed.", lambda: runs.deduplicated,
        ))  # fmt: skip


class Metrics(TicketSeries, ForwardSeries, ShadowSeries, HealthSeries):
    """All of ticketq's series, registered in `registry`, for a worker that consumes `queue`: each
    area's series (its base classes) under one roof, so a reader names `metrics.<series>`."""

    def __init__(self, registry: CollectorRegistry | None = None, queue: str = QUEUE, health: Health | None = None,
                 runs: RunTally | None = None) -> None:  # fmt: skip
        """`health` and `runs`: the process's (the worker's runtime), read at scrape time; fresh ones if not given."""
        if not queue:
            raise ValueError("Metrics: queue must name the queue the worker consumes (TICKETQ_QUEUE)")
        disable_created_metrics()  # process-wide in prometheus_client; ticketq exports no _created series
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.queue = queue
        r.set_target_info({"queue": queue})  # for joins: `* on (instance) group_left (queue) target_info`
        r.register(PROCESS_COLLECTOR)  # process_resident_memory_bytes, process_cpu_seconds_total, open fds
        r.register(PLATFORM_COLLECTOR)  # python_info
        TicketSeries.__init__(self, r, queue)
        ForwardSeries.__init__(self, r)
        ShadowSeries.__init__(self, r)
        HealthSeries.__init__(self, r, health or Health(), runs or RunTally())
        self.build = Info(c.M_BUILD_INFO, "ticketq's version and the versions of the libraries it runs on.",
                          registry=r)  # fmt: skip
        self.build.info(build_versions())
        self._bounds: Callable[[], Mapping[str, tuple[str, float]]] = dict
        r.register(BoundsCollector(lambda: self._bounds()))
        self.model = Info(
            c.M_MODEL_INFO, "The model this worker serves: model, standin, dtype, device, matmul, recheck, fused; "
            "scorer (zero-shot, or TICKETQ_HEAD's head:<digest>) and heads (each schema field's, "
            "schema.field=head:<digest>, space-separated; - for none).",
            registry=r,
        )  # fmt: skip

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
