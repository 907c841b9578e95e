"""Celery glue: `create_app(settings)` builds the app, its batch task and its start-up hooks.

    ticketq worker                                                       # the usual way
    celery -A worker.app worker --pool threads --concurrency 1 -Q ticketq   # plain Celery also works

Nothing is built at import: `create_app` takes the settings, and the app carries a `Runtime` (the
service, metrics and readiness of this process) that the worker's start-up fills in — the model
is loaded and its prefix primed in `worker_init`, before the consumer takes any message. `app`
is created from TICKETQ_* on first access, for `celery -A worker.app`. No model logic here.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from ticketq import codec, connections
from ticketq.config import is_sentinel_url
from ticketq.names import TASK_CLASSIFY
from worker.app.logs import CONSUMER_LOGGER, quiet_outages
from worker.app.preflight import preflight, wait_for_writes
from worker.app.refused import DeadLetterConsumer
from worker.app.runtime import ClassifierFactory, Runtime, build_classifier, runtime_of
from worker.app.signals import connect_signals
from worker.errors import CannotStart, ModelNotReady
from worker.health import Health
from worker.settings import Settings, load_settings
from worker.transport import TRANSPORT_OPTIONS, batches

__all__ = [
    "CONSUMER_LOGGER", "CannotStart", "ClassifierFactory", "DeadLetterConsumer", "ModelNotReady", "Runtime",
    "build_classifier", "classify_batch", "create_app", "preflight", "quiet_outages", "run_worker", "runtime_of",
    "wait_for_writes",
]  # fmt: skip


def create_app(settings: Settings, classifier_factory: ClassifierFactory | None = None) -> Celery:
    """The Celery app of one worker (or client) process; `classifier_factory` replaces the engine (tests)."""
    codec.install()
    quiet_outages()
    sentinel = is_sentinel_url(settings.broker_url)
    # A failover to the next sentinel of the list must keep the atomic fetch (see PinnedConnection).
    amqp = "worker.transport:AMQP" if settings.fetch == "atomic" else None
    app = Celery("ticketq", broker=settings.broker_url, backend=settings.backend_url, amqp=amqp)
    app.ticketq_runtime = runtime = Runtime(settings, classifier_factory)
    if settings.fetch == "atomic":  # pop and record in one Redis step; see worker/transport/fetch.py
        app.conf.broker_transport = f"worker.transport:{'SentinelTransport' if sentinel else 'Transport'}"
    app.conf.update(celery_config(settings, broker_transport_options(settings, runtime.health)))
    app.task(
        name=TASK_CLASSIFY,
        base=batches.Batches,
        bind=True,
        flush_every=settings.batch_window,
        flush_interval=settings.max_wait_ms / 1000,
        acks_late=True,
    )(classify_batch)
    connect_signals(app)
    return app


def broker_transport_options(settings: Settings, health: Health) -> dict[str, Any]:
    """kombu's options for the broker connection, the atomic fetch's own among them (`health`: the
    process's, which the consuming channel marks and meets refusals in)."""
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        **connections.transport_options(settings.broker_url, **settings.sentinel),  # the master's name
        **(TRANSPORT_OPTIONS if settings.fetch == "atomic" else {}),
        "ticketq_lease_s": settings.lease_s,
        "ticketq_stream_maxlen": settings.stream_maxlen,
        "ticketq_health": health,
        # kombu sweeps the unacked set for messages past the visibility timeout only every
        # interval x throttle seconds (10 x 10 by default): a kill -9'd worker's messages came
        # back up to 100 s after the timeout. Sweep every quarter timeout (at most 10 s) instead;
        # one sweep is a ZRANGE under a mutex, cheap enough.
        "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 4)),
        "unacked_restore_throttle": 1,
    }


def celery_config(settings: Settings, broker_transport: dict[str, Any]) -> dict[str, Any]:
    """Celery's configuration of a ticketq worker: JSON only, late acks, one thread, the batch window."""
    return dict(
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
            "visibility_timeout": settings.visibility_timeout_s,
            **connections.transport_options(settings.backend_url, **settings.sentinel),
        },
        result_expires=settings.result_expires_s,
        result_extended=False,
        task_default_queue=settings.queue,
        task_routes={TASK_CLASSIFY: {"queue": settings.queue}},
        broker_connection_retry_on_startup=True,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_hijack_root_logger=False,
    )


def run_worker(
    settings: Settings,
    loglevel: str = "INFO",
    name: str | None = None,
    classifier_factory: ClassifierFactory | None = None,
) -> int:
    """Run one worker process (one model replica) on the ticket queue until it is stopped; its exit
    status: 0 for a warm or cold shutdown, non-zero after an unrecoverable error (a supervisor that
    restarts only failures must restart it)."""
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
    # worker_main returns nothing (Celery 5.6 drops click's status): the controller keeps it.
    controller = runtime_of(app).controller
    return int(getattr(controller, "exitcode", 0) or 0)


def classify_batch(task, requests: list) -> None:
    """The batch function: hands the drained buffer to the service, which never raises."""
    runtime = runtime_of(task.app)
    if runtime.service is None:  # a worker started without worker_init (e.g. eager tests)
        runtime.start()
    feed = task if isinstance(task, batches.Batches) else None  # requests between forwards; acks per result
    runtime.service.process(requests, task.backend, feed)


_default_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """`worker.app.app`: the app built from TICKETQ_* on first access (for `celery -A worker.app`)."""
    global _default_app
    if name != "app":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _default_app is None:
        _default_app = create_app(load_settings())
    return _default_app
