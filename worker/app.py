"""Celery glue: the app, the batching task and the worker's start-up. No model logic here.

    celery -A worker.app worker --pool threads --concurrency 1 -Q ticketq
    ticketq worker          # the same, with the right flags and a Redis preflight

Settings come from TICKETQ_* at import time. The model is loaded and its prefix primed in
`worker_init`, before the consumer takes any message.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from typing import Any

import redis
from celery import Celery, signals
from celery.exceptions import InvalidTaskError
from celery.worker.consumer import Consumer
from celery_batches import Batches

from worker import constants as c
from worker import internals
from worker.deadletter import raw_entry
from worker.metrics import Metrics
from worker.service import NullClassifier, TicketRejected, TicketService
from worker.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> Celery:
    app = Celery("ticketq", broker=settings.broker_url, backend=settings.backend_url)
    if settings.fetch == "atomic":  # pop and record in one Redis step; see worker/internals.py
        app.conf.broker_transport = "worker.internals:Transport"
    transport = {"visibility_timeout": settings.visibility_timeout_s}
    broker_transport = {
        **transport,
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
        result_backend_transport_options=transport,
        result_expires=settings.result_expires_s,
        result_extended=False,
        task_default_queue=settings.queue,
        task_routes={c.TASK_CLASSIFY: {"queue": settings.queue}},
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
    )
    app.task(
        name=c.TASK_CLASSIFY,
        base=Batches,
        bind=True,
        flush_every=settings.batch_window,
        flush_interval=settings.max_wait_ms / 1000,
        acks_late=True,
    )(classify_batch)
    return app


def classify_batch(task, requests: list) -> None:
    """The batch function: hands the drained buffer to the service, which never raises."""
    if STATE.service is None:  # a worker started without worker_init (e.g. eager tests)
        start_service()
    STATE.service.process(requests, task.backend)


# Every reason a ticket or message can be dead-lettered for (service.py and DeadLetterConsumer).
REJECTION_REASONS = (
    "bad_payload", "missing_field", "wrong_type", "invalid_utf8", "oversize", "empty_text", "engine_error",
    "too_many_deliveries", "worker_error", "decode_error", "unknown_message", "unknown_task", "invalid_task",
    "unreadable_message",
)  # fmt: skip


class ModelNotReady(RuntimeError):
    """The engine could not be built (model missing, bad settings)."""


class _State:
    service: TicketService | None = None
    metrics: Metrics | None = None
    consumer_running: bool = False  # between worker_ready and worker_shutting_down: /readyz


STATE = _State()
settings = Settings()
app = create_app(settings)


def preflight(settings: Settings) -> redis.Redis:
    """Fail fast with a clear message when Redis is unreachable or refuses our credentials."""
    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=3, socket_timeout=10)
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise SystemExit(
            f"Redis at {_safe_url(settings.broker_url)} refused the credentials ({exc}). "
            "Check the password/user in TICKETQ_BROKER_URL (redis://:PASSWORD@host:6379/0)."
        ) from None
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise SystemExit(
            f"Redis is not reachable at {_safe_url(settings.broker_url)} ({exc}). Start one "
            "(redis-server --port 6379) or set TICKETQ_BROKER_URL."
        ) from None
    return client


def start_service() -> TicketService:
    internals.check_versions()
    client = preflight(settings)
    metrics = Metrics()
    if settings.null_classifier:
        log.warning("TICKETQ_NULL_CLASSIFIER is on: labels are a hash, for measuring queue overhead only")
        classifier = NullClassifier(settings.label_names)
        metrics.model.info({"model": "null-classifier", "standin": "false", "dtype": "-", "device": "-"})
    else:
        from worker.engine import Engine, ModelNotFound  # torch is imported only by workers that classify

        started = time.perf_counter()
        try:
            classifier = Engine.from_settings(settings)
        except ModelNotFound as exc:
            raise ModelNotReady(str(exc)) from None
        if settings.autotune:
            from worker.autotune import autotune

            autotune(classifier, budget_s=settings.autotune_s)
        info = classifier.info
        metrics.model.info(
            {"model": info.name, "standin": str(info.standin).lower(), "dtype": info.dtype, "device": info.device}
        )
        log.info(
            "model %s ready on %s/%s in %.1fs (prefix %d tokens cached)%s",
            info.name, info.device, info.dtype, time.perf_counter() - started, classifier.prefix_len,
            " — STAND-IN: labels are meaningless" if info.standin else "",
        )  # fmt: skip
    metrics.preinit(settings.label_names, REJECTION_REASONS)
    metrics.watch_queue(lambda: client.llen(settings.queue))
    if settings.metrics_port:
        metrics.serve(settings.metrics_host, settings.metrics_port,
                      ready=lambda: None if STATE.consumer_running else "consumer not running")  # fmt: skip
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
    STATE.metrics = metrics
    STATE.service = TicketService(settings, classifier, metrics, client)
    return STATE.service


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


@signals.worker_init.connect
def _on_worker_init(**_: Any) -> None:
    # Celery logs and swallows exceptions from signal handlers; a worker without a model must stop.
    try:
        with _startup_logging():
            start_service()
    except Exception as exc:
        log.critical("ticketq worker cannot start: %s", exc, exc_info=not isinstance(exc, ModelNotReady))
        raise SystemExit(1) from exc
    except SystemExit as exc:
        log.critical("ticketq worker cannot start: %s", exc)
        raise


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**_: Any) -> None:
    STATE.consumer_running = False


@signals.worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    STATE.consumer_running = True
    log.info("ticketq worker ready: queue %r, window %d, max wait %d ms", settings.queue, settings.batch_window,
             settings.max_wait_ms)  # fmt: skip


class DeadLetterConsumer(Consumer):
    """Celery's consumer, plus a dead-letter entry for every message Celery itself refuses.

    Celery logs and drops undecodable messages (pickle/yaml content, bad UTF-8) and unknown or
    invalid tasks; each of those now leaves its raw payload and reason in the dead-letter stream,
    and a message malformed in a way Celery does not expect is refused instead of stopping the
    worker (see `create_task_handler`). A refused message with a task id also gets a FAILURE result,
    so its client learns at once. It re-arms the batch flush timer after a broker reconnect.
    """

    def on_ready(self) -> None:
        super().on_ready()
        # asynloop calls on_ready after every (re)connect; the flush timer did not survive it.
        task = self.app.tasks.get(c.TASK_CLASSIFY)
        if isinstance(task, Batches):
            internals.rearm_flush_timer(task, self.timer)

    def create_task_handler(self, *args, **kwargs):
        on_task_received = super().create_task_handler(*args, **kwargs)
        # kombu's Redis transport counts KeyError as a connection error; from a message it is not
        # one, and re-raising it made the consumer reconnect, restore the message and loop on it.
        connection_errors = tuple(error for error in self.connection_errors if error is not KeyError)

        def on_task_received_guarded(message) -> None:
            # Celery turns only decode and content errors into on_decode_error/on_invalid_task. A
            # JSON message with our task name but headers or body that are not Celery's (no 'id'
            # header, a body that is not [args, kwargs, embed]) raised KeyError/ValueError out of
            # the event loop: "Unrecoverable error", the worker stopped, and the message, restored
            # at shutdown, stopped the next worker too. Refuse it like any invalid task instead.
            headers = message.headers
            task_id = headers.get("id") if isinstance(headers, dict) and "task" in headers else ""
            if not isinstance(task_id, str):  # a dict/int id got as far as the batch and failed it all
                self.on_invalid_task(None, message, InvalidTaskError(f"task id must be a string, got {task_id!r:.80}"))
                return
            try:
                on_task_received(message)
            except connection_errors:
                raise
            except Exception as exc:
                if message.acknowledged:  # already rejected and dead-lettered on the way
                    log.exception("error after refusing message %r", (message.headers or {}).get("id"))
                else:
                    self.on_invalid_task(None, message, exc)

        return on_task_received_guarded

    def on_decode_error(self, message, exc) -> None:
        _dead_letter_raw(self.app, "decode_error", exc, message)
        super().on_decode_error(message, exc)

    def on_unknown_message(self, body, message) -> None:
        _dead_letter_raw(self.app, "unknown_message", None, message)
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc) -> None:
        _dead_letter_raw(self.app, "unknown_task", exc, message)
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc) -> None:
        _dead_letter_raw(self.app, "invalid_task", exc, message)
        super().on_invalid_task(body, message, exc)


def _dead_letter_raw(app: Celery, reason: str, exc: Exception | None, message) -> None:
    """Dead-letter a message Celery refused, raw bytes kept; a waiting client gets a FAILURE at once."""
    entry = raw_entry(reason, exc, message.headers, message.content_type, message.body)
    try:
        client = STATE.service.redis if STATE.service else redis.Redis.from_url(settings.broker_url)
        client.xadd(c.DEAD_LETTER_STREAM, entry, maxlen=settings.stream_maxlen)
        if STATE.metrics:
            STATE.metrics.dead_letters.labels(reason=reason).inc()
        task_id = (message.headers or {}).get("id") if isinstance(message.headers, dict) else None
        if isinstance(task_id, str) and task_id:  # else the task stays PENDING: its client waits for its timeout
            app.backend.mark_as_failure(task_id, TicketRejected(reason, entry["error"]), call_errbacks=False)
    except redis.RedisError:
        log.exception("could not dead-letter a refused message: %s", json.dumps(entry)[:500])


def _safe_url(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)
