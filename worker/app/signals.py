"""The worker's start-up and readiness hooks on Celery's signals (process-wide: each checks its app)."""

from __future__ import annotations

import gc
import logging
from typing import Any

from celery import Celery, signals

from ticketq.names import TASK_CLASSIFY
from worker.app.logs import startup_logging
from worker.app.runtime import runtime_of
from worker.errors import CannotStart, ModelNotReady
from worker.redis import celery_results
from worker.transport import batches

log = logging.getLogger(__name__)


def connect_signals(app: Celery) -> None:
    """Start-up and readiness hooks of this app's worker (Celery's signals are process-wide)."""
    runtime = runtime_of(app)
    uid = f"ticketq-{id(app)}"

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        runtime.controller = sender
        problem = pool_problem(getattr(sender, "pool_cls", None), getattr(sender, "concurrency", None))
        if problem:
            log.critical("ticketq worker cannot start: %s", problem)
            raise CannotStart(problem, logged=True)
        # Celery logs and swallows exceptions from signal handlers; a worker without a model must stop.
        try:
            with startup_logging():
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


def pool_problem(pool_cls: Any, concurrency: Any) -> str | None:
    """Why Celery's pool settings cannot run ticketq, or None. One worker process is one model
    replica, computed by one thread while the consumer buffers: `--pool threads --concurrency 1`.
    Another pool or concurrency (`celery -A worker.app worker --pool prefork -c 2`) would run the
    batch function in parallel copies over one model, or fork the model: refused in one line."""
    name = pool_cls if isinstance(pool_cls, str) else getattr(pool_cls, "__module__", "")
    if "thread" in str(name).lower() and concurrency == 1:
        return None
    shown = pool_cls if isinstance(pool_cls, str) else str(name).rsplit(".", 1)[-1]  # celery.concurrency.<pool>
    return (f"ticketq runs one model per worker process, on Celery's threads pool with concurrency 1 (got pool "
            f"{shown!s}, concurrency {concurrency}): drop --pool/--concurrency (or pass --pool threads "
            "--concurrency 1), and run more worker processes for more throughput")
