"""Messages Celery itself refuses (undecodable, unknown or invalid tasks): each dead-lettered, raw."""

from __future__ import annotations

import json
import logging

import redis
from celery import Celery

from ticketq import connections
from ticketq.connections import redis_client
from ticketq.contract import Reason, TicketRejected
from ticketq.dead_letters import raw_entry
from worker.app.runtime import runtime_of
from worker.redis.outbox import Outbox
from worker.transport.consumer import GuardedConsumer

log = logging.getLogger(__name__)


class DeadLetterConsumer(GuardedConsumer):
    """The worker's consumer (`worker.transport.consumer`), plus a dead-letter entry for every
    message Celery itself refuses.

    Celery logs and drops undecodable messages (pickle/yaml content, bad UTF-8) and unknown or
    invalid tasks; each of those leaves its raw payload and reason in the dead-letter stream. A
    refused message with a task id also gets a FAILURE result, so its client learns at once.
    """

    def on_decode_error(self, message, exc) -> None:
        dead_letter_raw(self.app, Reason.DECODE_ERROR, exc, message)
        super().on_decode_error(message, exc)

    def on_unknown_message(self, body, message) -> None:
        dead_letter_raw(self.app, Reason.UNKNOWN_MESSAGE, None, message)
        super().on_unknown_message(body, message)

    def on_unknown_task(self, body, message, exc) -> None:
        dead_letter_raw(self.app, Reason.UNKNOWN_TASK, exc, message)
        super().on_unknown_task(body, message, exc)

    def on_invalid_task(self, body, message, exc) -> None:
        dead_letter_raw(self.app, Reason.INVALID_TASK, exc, message)
        super().on_invalid_task(body, message, exc)


def dead_letter_raw(app: Celery, reason: Reason, exc: Exception | None, message) -> None:
    """Dead-letter a message Celery refused, raw bytes kept; a waiting client gets a FAILURE at once."""
    runtime = runtime_of(app)
    settings = runtime.settings
    entry = raw_entry(reason, exc, message.headers, message.content_type, message.body)
    client = None
    if runtime.service:
        outbox = runtime.service.outbox
    else:  # refused before start-up finished: a client of its own, for this message
        client = redis_client(settings.broker_url, **settings.sentinel, socket_timeout_s=10)
        outbox = Outbox.from_settings(client, settings, runtime.health)
    try:
        outbox.dead_letter(entry)
        if runtime.metrics:
            runtime.metrics.dead_letters.labels(reason=str(reason)).inc()
        task_id = (message.headers or {}).get("id") if isinstance(message.headers, dict) else None
        if isinstance(task_id, str) and task_id:  # else the task stays PENDING: its client waits for its timeout
            app.backend.mark_as_failure(task_id, TicketRejected(reason, entry["error"]), call_errbacks=False)
    except redis.RedisError:
        log.exception("could not dead-letter a refused message: %s", json.dumps(entry)[:500])
    finally:
        if client is not None:
            connections.close(client)
