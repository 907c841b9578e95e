"""Celery's worker consumer, hardened: events and heartbeats from a thread of their own (never the
consumer's loop), and a malformed message refused alone instead of stopping the worker."""

from __future__ import annotations

import logging
from typing import Any

import celery_batches
from celery.exceptions import InvalidTaskError
from celery.worker.consumer import Consumer

from worker.transport.batches import Batches, rearm_flush_timer
from worker.transport.events import WorkerEvents
from worker.transport.guards import HEART_STEP

log = logging.getLogger(__name__)

# The bootstep left out, by its class: Celery names steps "module:Class".


class GuardedConsumer(Consumer):
    """Celery's consumer without the Heart step, re-arming the batch flush timer on every
    (re)connect, and turning any malformed message into `on_invalid_task`.

    Celery's event heartbeat publishes from the consumer's event loop every 2 s and retries until
    the broker answers, so a Redis outage that began just before it held the loop: the consumer
    never saw the outage, never reconnected, and fetched nothing until Redis was back. A worker's
    liveness is its lease (`worker.transport.lease`), its /metrics, and the heartbeats that
    `worker.transport.events` sends from its own thread.
    """

    class Blueprint(Consumer.Blueprint):
        default_steps = [step for step in Consumer.Blueprint.default_steps if step != HEART_STEP]  # noqa: RUF012

    ticketq_events: WorkerEvents | None = None

    def on_ready(self) -> None:
        super().on_ready()
        events = self._events()
        # asynloop calls on_ready after every (re)connect; the flush timer does not survive it.
        for task in self.app.tasks.values():
            if isinstance(task, celery_batches.Batches):
                rearm_flush_timer(task, self.timer)
            if isinstance(task, Batches):
                task.events = events

    def _events(self) -> WorkerEvents:
        """The worker's event sender, started once; it also answers for the consumer's
        `event_dispatcher`, which Celery's Events step leaves unset when it is off."""
        if self.ticketq_events is None:
            self.ticketq_events = WorkerEvents(self.app, self.hostname, bool(self.app.conf.worker_send_task_events))
            self.ticketq_events.start()
        if self.event_dispatcher is None:
            self.event_dispatcher = self.ticketq_events
        return self.ticketq_events

    def shutdown(self) -> None:
        super().shutdown()
        if self.ticketq_events is not None:
            self.ticketq_events.stop()

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        on_task_received = super().create_task_handler(*args, **kwargs)
        # kombu's Redis transport counts KeyError as a connection error; from a message it is not
        # one, and re-raising it makes the consumer reconnect, restore the message and loop on it.
        connection_errors = tuple(error for error in self.connection_errors if error is not KeyError)

        def on_task_received_guarded(message: Any) -> None:
            # Celery turns only decode and content errors into on_decode_error/on_invalid_task. A
            # JSON message with a known task name but headers or body that are not Celery's (no 'id'
            # header, a body that is not [args, kwargs, embed]) raises KeyError/ValueError out of the
            # event loop: "Unrecoverable error", the worker stops, and the message, restored at
            # shutdown, stops the next worker too. It is refused like any invalid task instead.
            headers = message.headers
            task_id = headers.get("id") if isinstance(headers, dict) and "task" in headers else ""
            if not isinstance(task_id, str):  # a dict/int id would get as far as the batch and fail it all
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
