"""Noticing a Redis that came back without its data: the epoch marker (`names.EPOCH_KEY`).

A Redis without persistence that restarts (or one that is flushed) comes back empty: the queue,
the unacked messages, the results stream, the dead letters and the publish-once marks are gone,
and nothing in the protocol says so. Every worker and producer therefore keeps the marker: the
first to find it absent sets it (SET NX: an id and the time), and each remembers the value it
saw. A marker that is later absent, or holds another value, means Redis lost what it held: the
process says so once (`Epoch.seen` returns a `Loss` once per episode), sets a fresh marker, and
records the loss under `names.DATA_LOST_KEY` for `ticketq status`.

Cost: one GET a check (workers add the key to a read they make anyway), one SET NX and one
record when a loss is found. Worst case: a loss is noticed at the process's next check, never
before; a Redis that loses its data and gets a fresh marker from a process that never knew the
old one is still noticed by every process that did. A loss while no ticketq process runs is
noticed by none. Each results-stream entry carries the marker's id it was published under (its
`epoch` field), so that a reader that reads across a loss skips the tickets answered on both
sides of it (`AcrossEpochs`). An evicting `maxmemory-policy` could drop the marker like any key (ticketq
refuses one unless TICKETQ_ALLOW_EVICTION): that reads as a loss, which it then is.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
import uuid
from collections import deque
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import redis

from ticketq.names import DATA_LOST_KEY, EPOCH_KEY

LOSS_RECORD_TTL_S = 86400  # how long `ticketq status` shows the latest loss


@dataclass(frozen=True)
class Loss:
    """Redis lost its data: the epoch that began at `since` (unix time) is gone, noticed at
    `noticed_at` by `by` (role host:pid)."""

    since: float | None
    noticed_at: float
    by: str


def marker(by: str) -> bytes:
    """A fresh epoch marker: a random id, the time, who set it."""
    return json.dumps({"id": uuid.uuid4().hex, "since": round(time.time(), 3), "by": by}).encode()


def whoami(role: str) -> str:
    """`role host:pid`, as markers and loss records name the process."""
    return f"{role} {socket.gethostname()}:{os.getpid()}"


class Epoch:
    """What one process knows of its Redis's epoch. Not thread-safe: one thread checks."""

    def __init__(self, by: str) -> None:
        self.by = by
        self.known: bytes | None = None  # the marker last seen; None before the first check
        self.losses = 0  # episodes noticed

    def check(self, client: redis.Redis) -> Loss | None:
        """Read the marker and judge it (`seen`): a `Loss` when Redis lost its data since the last check."""
        return self.seen(client, client.get(EPOCH_KEY))

    def seen(self, client: redis.Redis, value: bytes | None) -> Loss | None:
        """Judge the marker's `value` as just read (None: absent), from a read the caller made anyway.

        The first value seen is adopted (an absent marker is set first). After that, the same value
        is the usual case (nothing written); an absent or other one is a loss, returned once: the
        marker found then (or set) is adopted, so the next check is quiet again. Redis errors
        propagate, with nothing adopted: the next check judges again.
        """
        if value is not None and value == self.known:
            return None
        if value is None:
            value = self._set_if_absent(client)
        previous, self.known = self.known, value
        if previous is None:
            return None
        loss = Loss(_since(previous), time.time(), self.by)
        self.losses += 1
        self._record(client, loss)
        return loss

    def _set_if_absent(self, client: redis.Redis) -> bytes:
        pipe = client.pipeline(transaction=True)  # SET NX then GET in one step: whoever set it, the value
        pipe.set(EPOCH_KEY, marker(self.by), nx=True)
        pipe.get(EPOCH_KEY)
        return pipe.execute()[-1]

    def _record(self, client: redis.Redis, loss: Loss) -> None:
        """The loss for `ticketq status`: the first process to notice it writes the record."""
        record = {"since": loss.since, "noticed_at": round(loss.noticed_at, 3), "by": loss.by}
        with suppress(redis.RedisError):  # refused or cut off: the caller still reports the loss, status not
            client.set(DATA_LOST_KEY, json.dumps(record), nx=True, ex=LOSS_RECORD_TTL_S)


def describe(client: redis.Redis) -> dict[str, Any]:
    """What Redis says of its epoch, for `ticketq status`: since when the marker stands and who set
    it, and the latest loss recorded (None when none). Reads only."""
    raw, lost = client.mget(EPOCH_KEY, DATA_LOST_KEY)
    current = _decoded(raw) if raw is not None else None
    return {"marker": current, "lost": _decoded(lost) if lost is not None else None}


def _since(value: bytes) -> float | None:
    since = _decoded(value).get("since")
    return float(since) if isinstance(since, int | float) else None


def _decoded(value: bytes) -> dict[str, Any]:
    """A marker or loss record as a dict; one written by something else reads as empty."""
    try:
        decoded = json.loads(value)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def marker_id(value: bytes | None) -> str | None:
    """The id of an epoch marker's raw value (None for none, or one without an id)."""
    if value is None:
        return None
    found = _decoded(value).get("id")
    return str(found) if found else None


class AcrossEpochs:
    """A results-stream reader's guard against the one repeat publish-once cannot stop: a ticket
    answered before a data loss and again after it (its message re-sent: the publish-once marks
    went with the data). Each stream entry carries the epoch it was published in (the `epoch`
    field: the marker's id, read by the publishing script itself); `repeat` says whether a
    (task id, ticket id) was yielded already in an earlier epoch. Within one epoch nothing is
    filtered (publish-once holds there).

    Cost: one 8-byte digest per entry seen, the last `window` of them (the stream's own cap, by
    default): about 80 bytes each, 8 MB for 100,000. Worst case: a ticket answered more than
    `window` entries before the loss is yielded again; an entry without the field (an older
    worker's) counts as the current epoch's.
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.epoch: bytes | None = None
        self.current: set[int] = set()  # keys yielded in this epoch
        self.earlier: set[int] = set()  # keys yielded in every epoch before it
        self.order: deque[int] = deque()  # every key kept, oldest first
        self.skipped = 0
        self.lock = threading.Lock()

    def repeat(self, epoch: bytes | None, result: dict[str, Any]) -> bool:
        """Whether this entry (its `epoch` field, its result) repeats an earlier epoch's; if not, it is remembered."""
        with self.lock:
            return self._repeat(epoch, _key(result))

    def _repeat(self, epoch: bytes | None, key: int) -> bool:
        if epoch and epoch != self.epoch:
            if self.epoch is not None:
                self.earlier |= self.current
                self.current = set()
            self.epoch = epoch
        if key in self.earlier:
            self.skipped += 1
            return True
        if key not in self.current:
            self.current.add(key)
            self.order.append(key)
            if len(self.order) > self.window:
                oldest = self.order.popleft()
                self.current.discard(oldest)
                self.earlier.discard(oldest)
        return False


def _key(result: dict[str, Any]) -> int:
    text = f"{result.get('task_id')}\0{result.get('id')}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
