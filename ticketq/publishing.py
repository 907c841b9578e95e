"""The records of publishing once, shared by the worker's store (`worker.redis.outbox`) and the
service that calls it (`worker.service.ports.Outbox`): a message's payload digest, what a publish
did not stream, and a publish that Redis did not confirm."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import redis

from ticketq import codec
from ticketq.errors import TicketqError

DIGEST_FORMAT = "2:"  # a digest of another format is never taken for a conflict


class Published(NamedTuple):
    """What `Outbox.publish` did not stream: (task id, slot) of each result already published by the
    same message (a re-execution), and of each result of another message under a used task id."""

    repeats: list[tuple[str, int]]
    conflicts: list[tuple[str, int]]


class Unconfirmed(TicketqError, redis.ConnectionError):
    """A publish call that Redis did not answer within worst_batch_s: it may still have run (a
    command sent into a partition arrives when it heals). `Outbox.landed` finds out."""

    def __init__(self, call_key: str, order: list[tuple[str, int]], cause: BaseException) -> None:
        super().__init__(f"publishing {len(order)} result(s) unconfirmed: {cause}")
        self.call_key, self.order = call_key, order


def payload_digest(args: Any) -> str:
    """A short hash of a message's arguments, as decoded, less each ticket's `submitted_at` (when
    it was sent, not what): equal for every delivery of one message and for the same tickets sent
    again under their idempotent task ids, different for another message that reuses a task id."""
    try:
        return DIGEST_FORMAT + hashlib.blake2b(codec.dumps(_without_send_time(args)), digest_size=12).hexdigest()
    except (TypeError, ValueError):  # not JSON-shaped (a hand-built request): not checked
        return ""


def _without_send_time(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: item for key, item in value.items() if key != "submitted_at"}
    if isinstance(value, list | tuple):
        return [_without_send_time(item) for item in value]
    return value
