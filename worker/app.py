"""Celery glue: `create_app(settings)` builds the app, its batch task and its start-up hooks.

    ticketq worker                                                       # the usual way
    celery -A worker.app worker --pool threads --concurrency 1 -Q ticketq   # plain Celery also works

Nothing is built at import: `create_app` takes the settings, and the app carries a `Runtime` (the
service, metrics and readiness of this process) that the worker's start-up fills in — the model
is loaded and its prefix primed in `worker_init`, before the consumer takes any message. `app`
is created from TICKETQ_* on first access, for `celery -A worker.app`. No model logic here.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import kombu.exceptions
import redis
from celery import Celery, signals

from ticketq import codec, connections
from ticketq.config import is_redis_url, is_sentinel_url, mask_url
from ticketq.connections import RedisUnavailable, connect, redis_client
from ticketq.contract import DEAD_LETTER_REASONS, Reason, TicketRejected
from ticketq.dead_letters import raw_entry
from ticketq.errors import TicketqError
from ticketq.exits import EXIT_USAGE
from ticketq.names import TASK_CLASSIFY
from worker.health import refusals
from worker.health.progress import CLASSIFYING
from worker.metrics import Metrics
from worker.nullclassifier import NullClassifier
from worker.redis import celery_results
from worker.redis.answer_cache import AnswerCache
from worker.redis.outbox import Outbox
from worker.service.core import TicketService
from worker.service.hooks.standard import live_cost, standard_hooks
from worker.service.ports import Classifier
from worker.service.routing import Routing
from worker.settings import Settings, load_settings
from worker.transport import batches, guards
from worker.transport.consumer import GuardedConsumer

log = logging.getLogger(__name__)

ClassifierFactory = Callable[[Settings], Classifier]


class ModelNotReady(TicketqError, RuntimeError):
    """The engine could not be built (model missing, bad settings)."""


class CannotStart(SystemExit):
    """The worker cannot start for a reason its operator must fix (Redis unreachable or refusing us,
    an evicting memory policy, a model that does not load): exit status 2, as for bad settings,
    with `str()` the one line that says what to do."""

    def __init__(self, message: str, logged: bool = False) -> None:
        super().__init__(EXIT_USAGE)
        self.message, self.logged = message, logged

    def __str__(self) -> str:
        return self.message


class Runtime:
    """One worker process once started: its settings, service, metrics and readiness."""

    def __init__(self, settings: Settings, classifier_factory: ClassifierFactory | None = None) -> None:
        self.settings = settings
        self.classifier_factory = classifier_factory or build_classifier
        self.service: TicketService | None = None
        self.metrics: Metrics | None = None
        self.consumer_running = False  # between worker_ready and worker_shutting_down: /readyz

    def start(self) -> TicketService:
        """Check the libraries and Redis, build the classifier, serve metrics: the worker's start-up."""
        settings = self.settings
        guards.check_versions()
        client = preflight(settings)
        metrics = Metrics(queue=settings.queue)
        classifier = self.classifier_factory(settings)
        info = getattr(classifier, "info", None)
        metrics.model.info(
            {"model": info.name, "standin": str(info.standin).lower(), "dtype": info.dtype, "device": info.device,
             "matmul": getattr(info, "matmul", "torch"), "recheck": str(getattr(info, "recheck", False)).lower(),
             "fused": str(getattr(info, "fused", False)).lower()}  # after the self-check: the path that serves
            if info else {"model": "null-classifier", "standin": "false", "dtype": "-", "device": "-", "matmul": "-",
                          "recheck": "false", "fused": "false"}
        )  # fmt: skip
        fields = [(schema.name, spec.name, (*spec.labels, *(("none",) if spec.multi else ())))
                  for schema in settings.load_schemas() for spec in schema.fields]  # fmt: skip
        metrics.preinit(settings.label_names, tuple(str(reason) for reason in DEAD_LETTER_REASONS), fields)
        metrics.watch_queue(lambda: client.llen(settings.queue))
        if callable(getattr(classifier, "error_bounds", None)):
            metrics.watch_bounds(classifier.error_bounds)
        if settings.metrics_port:
            about = lambda: "Redis " + connections.describe_memory(connections.memory_state(client))  # noqa: E731
            metrics.serve(settings.metrics_host, settings.metrics_port, ready=self.ready_problem, about=about)
            log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
        self.metrics = metrics
        routing = Routing.of(classifier, settings)
        hooks = standard_hooks(settings, classifier, metrics, routing, live_cost(settings, classifier, metrics))
        cache = AnswerCache(client, settings.answer_cache_s, settings.answer_cache_entries) \
            if settings.answer_cache_s else None
        self.service = TicketService(settings, classifier, Outbox.from_settings(client, settings), hooks, routing,
                                     cache)  # fmt: skip
        wait_for_writes(client)
        return self.service

    def ready_problem(self) -> str | None:
        problems = refusals.write_problems()  # Redis refusing writes, results not on the replicas yet
        if not self.consumer_running:
            problems.insert(0, "consumer not running")
        stalled = CLASSIFYING.stalled_for()  # its lease is no longer renewed meanwhile (worker.transport.lease)
        if stalled:
            problems.append(f"classifying stalled for {stalled:.0f} s (work in hand, no progress for longer than "
                            f"TICKETQ_WORST_BATCH_S={CLASSIFYING.bound_s:g}s)")  # fmt: skip
        return "; ".join(problems) or None


def build_classifier(settings: Settings) -> Classifier:
    """The engine the settings ask for (model loaded, prefix primed, autotuned), or the null classifier."""
    if settings.null_classifier:
        log.warning("TICKETQ_NULL_CLASSIFIER is on: labels are a hash, for measuring queue overhead only")
        return NullClassifier(settings.label_names)
    from worker.engine import Engine, ModelNotFound  # torch is imported only by workers that classify

    started = time.perf_counter()
    try:
        engine = Engine.from_settings(settings)
    except ModelNotFound as exc:
        raise ModelNotReady(str(exc)) from None
    if settings.autotune:
        from worker.engine.autotune import autotune

        autotune(engine, budget_s=settings.autotune_s)
    elif settings.live_cost:
        from worker.engine.autotune import load_cached

        cached = load_cached(engine)
        if cached is not None:
            engine.cost = cached
            log.info("cost model: this machine's last fit, %.2f ms + %.4f ms x tokens",
                     cached.fixed_ms, cached.token_ms)  # fmt: skip
    info = engine.info
    log.info(
        "model %s ready on %s/%s%s%s in %.1fs (prefix %d tokens cached)%s",
        info.name, info.device, info.dtype, ", re-checked in float32" if info.recheck else "",
        (" (oneDNN GEMMs, fused layers)" if info.fused else " (oneDNN GEMMs)") if info.matmul == "onednn" else "",
        time.perf_counter() - started, engine.prefix_len,
        " — STAND-IN: labels are meaningless" if info.standin else "",
    )  # fmt: skip
    if info.self_check:
        log.info("self-check (batched path against the reference, docs/models.md): %s", info.self_check)
    return engine


# Celery's consumer logs each lost broker connection with its whole chained traceback (three per
# failover or restart): an outage, not a bug, gets its one line with the reason instead.
CONSUMER_LOGGER = "celery.worker.consumer.consumer"
_OUTAGES = (redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError, ConnectionError)


class OutageWithoutTraceback(logging.Filter):
    """A record whose exception is a lost connection keeps its message and the reason, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, _OUTAGES):
            record.msg, record.args = f"{record.getMessage()} ({type(exc).__name__}: {exc})", ()
            record.exc_info = record.exc_text = None
        return True


def quiet_outages(logger: logging.Logger | None = None) -> None:
    """Install `OutageWithoutTraceback` on Celery's consumer logger, once."""
    logger = logger or logging.getLogger(CONSUMER_LOGGER)
    if not any(isinstance(f, OutageWithoutTraceback) for f in logger.filters):
        logger.addFilter(OutageWithoutTraceback())


def create_app(settings: Settings, classifier_factory: ClassifierFactory | None = None) -> Celery:
    """The Celery app of one worker (or client) process; `classifier_factory` replaces the engine (tests)."""
    codec.install()
    quiet_outages()
    sentinel = is_sentinel_url(settings.broker_url)
    # A failover to the next sentinel of the list must keep the atomic fetch (see PinnedConnection).
    amqp = "worker.transport:AMQP" if settings.fetch == "atomic" else None
    app = Celery("ticketq", broker=settings.broker_url, backend=settings.backend_url, amqp=amqp)
    app.ticketq_runtime = Runtime(settings, classifier_factory)
    if settings.fetch == "atomic":  # pop and record in one Redis step; see worker/transport/fetch.py
        app.conf.broker_transport = f"worker.transport:{'SentinelTransport' if sentinel else 'Transport'}"
    transport = {"visibility_timeout": settings.visibility_timeout_s}
    broker_transport = {
        **transport,
        **connections.transport_options(settings.broker_url, **settings.sentinel),  # the master's name
        "ticketq_lease_s": settings.lease_s,
        "ticketq_stream_maxlen": settings.stream_maxlen,
        # kombu sweeps the unacked set for messages past the visibility timeout only every
        # interval x throttle seconds (10 x 10 by default): a kill -9'd worker's messages came
        # back up to 100 s after the timeout. Sweep every quarter timeout (at most 10 s) instead;
        # one sweep is a ZRANGE under a mutex, cheap enough.
        "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 4)),
        "unacked_restore_throttle": 1,
    }
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],  # pickle/yaml are refused (and dead-lettered by DeadLetterConsumer)
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # celery-batches buffers unacked messages: the prefetch window must hold a full batch window
        worker_prefetch_multiplier=settings.effective_prefetch,
        worker_concurrency=1,
        worker_pool="threads",  # one model per process; the consumer keeps buffering while it computes
        worker_consumer="worker.app:DeadLetterConsumer",
        broker_transport_options=broker_transport,
        result_backend_transport_options={
            **transport, **connections.transport_options(settings.backend_url, **settings.sentinel)
        },
        result_expires=settings.result_expires_s,
        result_extended=False,
        task_default_queue=settings.queue,
        task_routes={TASK_CLASSIFY: {"queue": settings.queue}},
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
    )
    app.task(
        name=TASK_CLASSIFY,
        base=batches.Batches,
        bind=True,
        flush_every=settings.batch_window,
        flush_interval=settings.max_wait_ms / 1000,
        acks_late=True,
    )(classify_batch)
    _connect_signals(app)
    return app


def run_worker(
    settings: Settings,
    loglevel: str = "INFO",
    name: str | None = None,
    classifier_factory: ClassifierFactory | None = None,
) -> None:
    """Run one worker process (one model replica) on the ticket queue until it is stopped."""
    connections.close(preflight(settings))  # a clear one-line error before Celery's banner; start-up connects again
    app = create_app(settings, classifier_factory)
    app.worker_main([
        "worker",
        f"--loglevel={loglevel}",
        "--pool=threads",
        "--concurrency=1",
        f"--queues={settings.queue}",
        f"--hostname={name or f'ticketq-{os.getpid()}@%h'}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",  # see worker.transport.consumer.GuardedConsumer
    ])  # fmt: skip


def runtime_of(app: Celery) -> Runtime:
    return app.ticketq_runtime


def classify_batch(task, requests: list) -> None:
    """The batch function: hands the drained buffer to the service, which never raises."""
    runtime = runtime_of(task.app)
    if runtime.service is None:  # a worker started without worker_init (e.g. eager tests)
        runtime.start()
    feed = task if isinstance(task, batches.Batches) else None  # requests between forwards; acks per result
    runtime.service.process(requests, task.backend, feed)


def preflight(settings: Settings) -> redis.Redis:
    """A client on the broker, or a clear one-line exit: Redis unreachable, our credentials refused,
    a read-only replica, or a maxmemory-policy that evicts keys (unless TICKETQ_ALLOW_EVICTION)."""
    urls = [settings.broker_url] + [url for url in (settings.result_backend,)
                                    if url and url != settings.broker_url and is_redis_url(url)]  # fmt: skip
    clients: list[redis.Redis] = []
    try:
        for url in urls:
            try:
                clients.append(connect(url, **settings.sentinel, socket_timeout_s=10))
                problem = _server_problem(clients[-1], url, settings)
            except RedisUnavailable as exc:
                raise CannotStart(str(exc)) from None
            except redis.RedisError as exc:
                raise CannotStart(str(RedisUnavailable(url, exc))) from None
            if problem:
                raise CannotStart(problem)
    except SystemExit:
        for client in clients:
            connections.close(client)
        raise
    for client in clients[1:]:
        connections.close(client)
    return clients[0]


def _server_problem(client: redis.Redis, url: str, settings: Settings) -> str | None:
    """Why this Redis must not hold ticketq's queue: it evicts keys, or it is a read-only replica."""
    if connections.write_problem(client) == "read-only replica":
        return (f"Redis at {mask_url(url)} is a read-only replica: point TICKETQ_BROKER_URL at the master, "
                "or at the sentinels (sentinel://host:26379;... with TICKETQ_SENTINEL_MASTER) to follow failovers")
    policy = connections.memory_policy(client)
    if policy in ("noeviction", "unknown"):
        if policy == "unknown":
            log.warning("could not read Redis's maxmemory-policy at %s: make sure it is noeviction", mask_url(url))
        return None
    if settings.allow_eviction:
        log.warning("Redis at %s has maxmemory-policy %s: it may evict queued tickets, unacked messages and "
                    "results without a word (TICKETQ_ALLOW_EVICTION is on)", mask_url(url), policy)
        return None
    return (f"Redis at {mask_url(url)} has maxmemory-policy {policy}: under memory pressure it evicts keys, and "
            "the queue, unacked messages and results are keys, dropped without a word. Set `maxmemory-policy "
            "noeviction` (redis.conf, or CONFIG SET maxmemory-policy noeviction), or TICKETQ_ALLOW_EVICTION=true "
            "to start anyway")


def wait_for_writes(client: redis.Redis, poll_s: float = 1.0) -> None:
    """Until Redis takes writes: a full Redis (noeviction) or one with too few replicas for
    min-replicas-to-write refuses the writes Celery's consumer starts with. /readyz says why meanwhile."""
    while (problem := connections.write_problem(client)) is not None:
        if not refusals.refusing(problem, "starting the consumer"):
            raise CannotStart(f"Redis refuses writes ({problem}): point TICKETQ_BROKER_URL at the master")
        time.sleep(poll_s)
    refusals.accepted()


@contextmanager
def _startup_logging():
    """worker_init runs before Celery configures logging: without this, the start-up INFO lines
    (dtype chosen, model ready, autotune fit) were dropped and only warnings reached the log."""
    logger = logging.getLogger("worker")
    if logging.getLogger().handlers or logger.handlers:  # somebody configured logging already
        yield
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _connect_signals(app: Celery) -> None:
    """Start-up and readiness hooks of this app's worker (Celery's signals are process-wide)."""
    runtime = runtime_of(app)
    uid = f"ticketq-{id(app)}"

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        # Celery logs and swallows exceptions from signal handlers; a worker without a model must stop.
        try:
            with _startup_logging():
                celery_results.check_result_meta(app.backend)
                runtime.start()
                task = app.tasks.get(TASK_CLASSIFY)
                if runtime.metrics and isinstance(task, batches.Batches):
                    runtime.metrics.watch_requests(task.waiting, task.running)
        except ModelNotReady as exc:
            log.critical("ticketq worker cannot start: %s", exc)
            raise CannotStart(str(exc), logged=True) from exc
        except Exception as exc:
            log.critical("ticketq worker cannot start: %s", exc, exc_info=True)
            raise SystemExit(1) from exc
        except SystemExit as exc:
            log.critical("ticketq worker cannot start: %s", exc)
            raise

    def on_worker_ready(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        runtime.consumer_running = True
        # Everything built so far (Celery, kombu, the model's Python objects) lives as long as the
        # process: out of the cyclic collector's sight, its full collections stop rescanning it.
        gc.freeze()
        settings = runtime.settings
        log.info("ticketq worker ready: queue %r, window %d, max wait %d ms", settings.queue, settings.batch_window,
                 settings.max_wait_ms)  # fmt: skip

    def on_worker_shutting_down(**_: Any) -> None:  # its sender is a host name: one worker per process
        runtime.consumer_running = False

    signals.worker_init.connect(on_worker_init, weak=False, dispatch_uid=f"{uid}-init")
    signals.worker_ready.connect(on_worker_ready, weak=False, dispatch_uid=f"{uid}-ready")
    signals.worker_shutting_down.connect(on_worker_shutting_down, weak=False, dispatch_uid=f"{uid}-down")


class DeadLetterConsumer(GuardedConsumer):
    """The worker's consumer (`worker.transport.consumer`), plus a dead-letter entry for every
    message Celery itself refuses.

    Celery logs and drops undecodable messages (pickle/yaml content, bad UTF-8) and unknown or
    invalid tasks; each of those leaves its raw payload and reason in the dead-letter stream. A
    refused message with a task id also gets a FAILURE result, so its client learns at once.
    """

    def on_decode_error(self, message, exc) -> None:
        _dead_letter_raw(self.app, Reason.DECODE_ERROR, exc, message)
        super().on_decode_error(message, exc)

    def on_unknown_message(self, body, message) -> None:
        _dead_letter_raw(self.app, Reason.UNKNOWN_MESSAGE, None, message)
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc) -> None:
        _dead_letter_raw(self.app, Reason.UNKNOWN_TASK, exc, message)
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc) -> None:
        _dead_letter_raw(self.app, Reason.INVALID_TASK, exc, message)
        super().on_invalid_task(body, message, exc)


def _dead_letter_raw(app: Celery, reason: Reason, exc: Exception | None, message) -> None:
    """Dead-letter a message Celery refused, raw bytes kept; a waiting client gets a FAILURE at once."""
    runtime = runtime_of(app)
    settings = runtime.settings
    entry = raw_entry(reason, exc, message.headers, message.content_type, message.body)
    if runtime.service:
        outbox = runtime.service.outbox
    else:  # refused before start-up finished: a client of its own
        client = redis_client(settings.broker_url, **settings.sentinel, socket_timeout_s=10)
        outbox = Outbox.from_settings(client, settings)
    try:
        outbox.dead_letter(entry)
        if runtime.metrics:
            runtime.metrics.dead_letters.labels(reason=str(reason)).inc()
        task_id = (message.headers or {}).get("id") if isinstance(message.headers, dict) else None
        if isinstance(task_id, str) and task_id:  # else the task stays PENDING: its client waits for its timeout
            app.backend.mark_as_failure(task_id, TicketRejected(reason, entry["error"]), call_errbacks=False)
    except redis.RedisError:
        log.exception("could not dead-letter a refused message: %s", json.dumps(entry)[:500])


_default_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """`worker.app.app`: the app built from TICKETQ_* on first access (for `celery -A worker.app`)."""
    global _default_app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _default_app is None:
        _default_app = create_app(load_settings())
    return _default_app
