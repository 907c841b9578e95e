"""The operator's view of a running ticketq, read from Redis and Celery: queue status, dead letters
(list, show, requeue through Celery with the original task id), and result lookup.

No torch: it runs anywhere a producer runs. Stream names come from `ticketq.names`, keys and the
writes a requeue makes from `worker.store`.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import dataclass

from kombu.transport.redis import Channel

from producer.api import Producer
from ticketq import connections, names
from worker import store
from worker.settings import Settings


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter stream (`ticket_entry` or `raw_entry` in worker/store.py)."""

    entry_id: str
    fields: dict[str, str]

    @property
    def reason(self) -> str:
        return self.fields.get("reason", "?")

    @property
    def task_id(self) -> str:
        return self.fields.get("task_id", "")

    @property
    def payload(self) -> object:
        """The refused payload: the ticket (one slot), the task's args (whole message), or raw bytes."""
        if "payload" in self.fields:
            try:
                return json.loads(self.fields["payload"])
            except ValueError:
                return self.fields["payload"]
        return base64.b64decode(self.fields.get("payload_b64", ""))


class Ops:
    """Operator commands over one broker; a thin layer on `Producer` (its Celery app and Redis client)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer = Producer(settings)
        self.redis = self.producer.redis

    def close(self) -> None:
        self.producer.close()

    def status(self, ping_timeout: float = 1.0) -> dict:
        replies = self.producer.app.control.ping(timeout=ping_timeout) or []
        return {
            "queue": self.settings.queue,
            "queue_depth": self.producer.queue_depth(),
            # delivered to a worker, not yet acknowledged (kombu's Redis transport keeps them in one hash)
            "in_flight": self.redis.hlen(Channel.unacked_key),
            "leases": self.leases(),
            "workers": sorted(name for reply in replies for name in reply),
            "dead_letters": dict(Counter(letter.reason for letter in self.dead_letters()).most_common()),
            "results_stream": self.redis.xlen(names.RESULTS_STREAM),
            # noeviction is the only safe policy: any other may drop the queue, unacked messages, results
            "redis": connections.memory_state(self.redis),
        }

    def leases(self) -> dict[str, int]:
        """Consumers of the atomic fetch (worker.transport): holding a lease, or expired and awaiting
        recovery by a live worker (their messages go back to the queue within a lease period)."""
        names = self.redis.hkeys(store.CONSUMERS_KEY)
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.exists(store.ALIVE_KEY.format(consumer=name.decode()))
        alive = sum(bool(found) for found in pipe.execute())
        return {"alive": alive, "expired": len(names) - alive}

    def dead_letters(self, reason: str | None = None) -> list[DeadLetter]:
        entries = self.redis.xrange(names.DEAD_LETTER_STREAM)
        letters = [DeadLetter(raw_id.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                   for raw_id, fields in entries]  # fmt: skip
        return [letter for letter in letters if reason is None or letter.reason == reason]

    def find_dead(self, key: str) -> list[DeadLetter]:
        """Dead letters by stream entry id or by task id."""
        return [letter for letter in self.dead_letters() if key in (letter.entry_id, letter.task_id)]

    def requeue(self, letter: DeadLetter) -> str:
        """Re-send a dead letter's payload; returns the task id used. Removes the entry once sent.

        A whole message (or a single-ticket one) goes back with its original task id, so waiting
        clients get the new result. A ticket of a packed message goes alone as `<task id>:<slot>`:
        the pack's other results stand. The message's attempt counter and its publish-once marks
        are cleared first, or the retry would be refused or its result not streamed.
        """
        args, task_id = self._resend_args(letter)
        store.forget_message(self.redis, task_id)
        self.producer.app.send_task(names.TASK_CLASSIFY, args=args, queue=self.settings.queue, task_id=task_id)
        store.drop_dead_letter(self.redis, letter.entry_id)
        return task_id

    def _resend_args(self, letter: DeadLetter) -> tuple[list, str]:
        payload = letter.payload
        if isinstance(payload, bytes):
            payload = _celery_args(payload, letter.fields.get("task", ""))
            return payload, letter.task_id
        slot = letter.fields.get("slot", "")
        if slot == "":  # the whole message: payload is its args
            return (payload if isinstance(payload, list) else [payload]), letter.task_id
        single = self.producer.app.AsyncResult(letter.task_id).state == "FAILURE"  # packs never end FAILURE
        return [payload], letter.task_id if single and slot == "0" else f"{letter.task_id}:{slot}"

    def result(self, key: str) -> list[dict]:
        """Results for a task id or a ticket id: the results stream first, else the Celery backend."""
        found = [result for _, result in self.producer.results_stream()
                 if key in (result.get("id"), result.get("task_id"))]  # fmt: skip
        if found:
            return found
        meta = self.producer.app.backend.get_task_meta(key)
        if meta.get("status") in (None, "PENDING"):
            return []
        value = meta.get("result")
        if meta["status"] != "SUCCESS":
            return [{"task_id": key, "status": "failed", "error": str(value)}]
        return value if isinstance(value, list) else [value]


class NotRequeueable(ValueError):
    """A dead letter whose bytes are not a ticketq task's JSON arguments."""


def _celery_args(body: bytes, task: str) -> list:
    if task and task != names.TASK_CLASSIFY:
        raise NotRequeueable(f"task {task!r} is not {names.TASK_CLASSIFY}; nothing to re-send")
    try:
        args = json.loads(body)[0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise NotRequeueable("the payload is not a JSON Celery message; it cannot be re-sent") from None
    if not isinstance(args, list) or len(args) != 1:
        raise NotRequeueable("the payload's arguments are not one ticket or one list of tickets")
    return args
