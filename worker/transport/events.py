"""Celery's monitoring events and worker state for batched requests, sent without the consumer's loop.

Flower, `celery events` and `celery inspect` know a worker by its events (`worker-online`,
`worker-heartbeat` every 2 s) and its tasks by `task-received/started/succeeded/failed` and by
`celery.worker.state` (what `inspect active/reserved/stats` read). celery-batches sends none of
them, and Celery's Heart step publishes from the consumer's event loop, retrying until the broker
answers: a Redis outage that began just before a beat held the loop, and the consumer never saw
the outage. Here every event goes through a bounded queue to one thread with its own broker
connection: an outage stalls that thread (its events are dropped once the queue is full, and
counted), never the consumer.

`WorkerEvents` also stands in for the consumer's `event_dispatcher` (the worker runs without
Celery's Events step), so the `enable_events` / `disable_events` / `heartbeat` remote-control
commands that Flower sends work: they switch the `task` group on and off here.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from contextlib import suppress
from datetime import datetime
from typing import Any

from celery.events import group_from
from celery.worker import state as worker_state
from celery.worker.state import SOFTWARE_INFO
from kombu.exceptions import OperationalError

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # Celery's default; Flower counts a worker offline after a few missed beats
RESULT_REPR_MAX = 1024  # characters of a result in its event: Celery's default `resultrepr_maxsize`
_STOP = object()


class WorkerEvents(threading.Thread):
    """One worker's event sender: a queue, a thread, a dispatcher on a connection of its own."""

    enabled = True  # read by remote-control commands, as on Celery's EventDispatcher

    def __init__(self, app: Any, hostname: str, task_events: bool, capacity: int = 10_000) -> None:
        super().__init__(name="ticketq-events", daemon=True)
        self.app, self.hostname = app, hostname
        self.groups: set[str] = {"worker", "task"} if task_events else {"worker"}
        self.dropped = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._started_at: dict[str, float] = {}  # task id -> monotonic time its job took it
        self._outage = False

    # --- the EventDispatcher surface the consumer and remote control use ---

    def send(self, type: str, blind: bool = False, **fields: Any) -> None:
        """Queue one event if its group is on; never blocks (dropped, and counted, when full)."""
        if group_from(type) not in self.groups:
            return
        fields.pop("retry", None)
        fields.pop("retry_policy", None)
        try:
            self._queue.put_nowait((type, fields))
        except queue.Full:
            self.dropped += 1

    def flush(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to flush: the thread sends as events come."""

    def close(self) -> None:
        self.stop()

    # --- task state, for events and `celery inspect` ---

    def received(self, request: Any) -> None:
        worker_state.task_reserved(request)
        if "task" in self.groups:
            self.send("task-received", uuid=request.id, name=request.name, args=request.argsrepr,
                      kwargs=request.kwargsrepr, root_id=request.root_id, parent_id=request.parent_id,
                      retries=request.request_dict.get("retries", 0), eta=_iso(request.eta),
                      expires=_iso(request.expires))  # fmt: skip

    def started(self, requests: Iterable[Any]) -> None:
        now = time.monotonic()
        for request in requests:
            worker_state.task_accepted(request)
            self._started_at[request.id] = now
            self.send("task-started", uuid=request.id)  # the dispatcher adds hostname, pid and clock

    def finished(self, request: Any, failure: str | None = None, answer: str = "", revoked: bool = False) -> None:
        """The message's result is out: `failure` is the error of a message that ended FAILURE (or
        REVOKED: past its `expires`), `answer` a short text of a successful one's answer (the event's
        `result`, what Flower shows), cut at Celery's own bound for a result's repr."""
        worker_state.task_ready(request, successful=failure is None)
        started = self._started_at.pop(request.id, None)
        runtime = time.monotonic() - started if started is not None else 0.0
        if revoked:  # as Celery's own worker announces an expired message
            self.send("task-revoked", uuid=request.id, terminated=False, signum=None, expired=True)
        elif failure is None:
            self.send("task-succeeded", uuid=request.id, result=_bounded(answer), runtime=runtime)
        else:
            self.send("task-failed", uuid=request.id, exception=failure, traceback="", runtime=runtime)

    # --- the sender thread ---

    def stop(self) -> None:
        if self.is_alive():
            with suppress(queue.Full):
                self._queue.put(_STOP, timeout=1)
            self.join(timeout=3)

    def run(self) -> None:
        dispatcher, next_beat, next_connect = None, time.monotonic(), 0.0
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                if dispatcher is not None:
                    self._publish(dispatcher, "worker-offline", self._worker_fields())
                    dispatcher.connection.close()
                return
            if dispatcher is None and time.monotonic() >= next_connect:
                dispatcher = self._connect()
                next_connect = time.monotonic() + HEARTBEAT_S  # while the broker is away: one try a beat
                if dispatcher is not None:  # (re)connected: say so first, as Celery does on start
                    dispatcher = self._publish(dispatcher, "worker-online", self._worker_fields())
            if time.monotonic() >= next_beat:
                dispatcher = self._publish(dispatcher, "worker-heartbeat", self._worker_fields())
                next_beat = time.monotonic() + HEARTBEAT_S
            if item is not None:
                dispatcher = self._publish(dispatcher, *item)

    def _worker_fields(self) -> dict[str, Any]:
        return {"freq": HEARTBEAT_S, "active": len(worker_state.active_requests),
                "processed": worker_state.all_total_count[0], "loadavg": _load_average(), **SOFTWARE_INFO}  # fmt: skip

    def _connect(self) -> Any:
        """A dispatcher on a new broker connection, or None while the broker is away."""
        connection = self.app.connection_for_write()
        try:
            connection.ensure_connection(max_retries=0)
            return self.app.events.Dispatcher(connection, hostname=self.hostname, enabled=True, groups=None)
        except Exception as exc:
            connection.close()
            self._lost(exc)
            return None

    def _publish(self, dispatcher: Any, type: str, fields: dict[str, Any]) -> Any:
        """Send one event; the dispatcher to use next (None after a failure: reconnect then)."""
        if dispatcher is None:
            self.dropped += 1
            return None
        try:
            dispatcher.send(type, retry=False, **fields)
        except (OSError, OperationalError, *dispatcher.connection.connection_errors) as exc:
            self.dropped += 1  # the broker is away: this event is lost, the consumer is not held
            self._lost(exc)
            dispatcher.connection.close()
            return None
        except Exception:  # an event that cannot be sent at all: say so, keep the connection
            self.dropped += 1
            log.exception("could not send a %s event", type)
            return dispatcher
        if self._outage:
            log.info("worker events flow again")
            self._outage = False
        return dispatcher

    def _lost(self, exc: Exception) -> None:
        if not self._outage:
            log.warning("could not send worker events (%s); dropped until the broker is back", exc)
        self._outage = True


def _load_average() -> tuple[float, float, float]:
    try:
        return tuple(round(value, 2) for value in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return (0.0, 0.0, 0.0)


def _iso(value: Any) -> Any:
    """A date as Celery's own events carry it: an ISO 8601 string (Flower parses it; a datetime
    made its task list answer 500)."""
    return value.isoformat() if isinstance(value, datetime) else value


def _bounded(text: str, limit: int = RESULT_REPR_MAX) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
