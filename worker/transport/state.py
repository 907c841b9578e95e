"""The Python side of `worker_state.lua` (beside this module): one method per command, each one script call.

The atomic fetch (`fetch.QoS`) and the leases (`lease.Lease`) change the worker state only
through here: what each key means is written once, in the script's header, and every change is
atomic in Redis (a worker killed at any instant leaves each message in the queue, in a fetching
list or in the unacked record, never nowhere).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from ticketq.lua import script
from ticketq.names import ALIVE_KEY, CONSUMERS_KEY, FETCHING_KEY, OWNED_KEY

WORKER_STATE = script(__package__, "worker_state")  # beside this module: worker_state.lua
_PUSHES = ("lpush", "rpush")


class WorkerState:
    """The keys of one channel's state: kombu's unacked record and the channel's queue names."""

    def __init__(self, unacked_index_key: str, unacked_key: str) -> None:
        self.unacked_index_key, self.unacked_key = unacked_index_key, unacked_key

    def _call(self, client: redis.Redis, command: str, consumer: str, queue: str = "", *args: Any,
              targets: Sequence[str] = ()) -> int:  # fmt: skip
        return int(self._script(client, command, consumer, queue, *args, targets=targets))

    def _script(self, client: redis.Redis, command: str, consumer: str, queue: str = "", *args: Any,
                targets: Sequence[str] = ()) -> Any:  # fmt: skip
        keys = (
            self.unacked_index_key,
            self.unacked_key,
            OWNED_KEY.format(consumer=consumer),
            FETCHING_KEY.format(consumer=consumer, queue=queue),
            ALIVE_KEY.format(consumer=consumer),
            CONSUMERS_KEY,
            queue,  # "" for the commands that use no queue: they never touch KEYS[7]
            *targets,
        )
        return client.eval(WORKER_STATE, len(keys), *keys, command, consumer, *args)

    def claim(self, client: redis.Redis, consumer: str, queue: str,
              records: Sequence[tuple[str, str, bytes | None]]) -> list[bool]:  # fmt: skip
        """(delivery tag, kombu's record, fetched item or None) recorded unacked and owned by
        `consumer`, each item taken from its fetching list for `queue`; per record, whether it was
        recorded (a fetched item no longer in the list is another worker's now)."""
        args = [part for tag, record, item in records for part in (tag, record, b"" if item is None else item)]
        return [bool(flag) for flag in self._script(client, "claim", consumer, queue, *args)]

    def ack(self, client: redis.Redis, consumer: str, tags: Sequence[str]) -> int:
        """Forget the records of acked messages that `consumer` still owns; returns how many. A
        message another worker took over when `consumer`'s lease ran out is left to its new owner."""
        return self._call(client, "ack", consumer, "", *tags)

    def beat(self, client: redis.Redis, consumer: str, ttl_ms: int, info: str) -> bool:
        """Renew `consumer`'s lease; True when it was not registered (its first beat, or another
        worker recovered it as dead meanwhile)."""
        return bool(self._call(client, "beat", consumer, "", ttl_ms, info))

    @staticmethod
    def owned(client: redis.Redis, consumer: str, tags: Sequence[str]) -> list[bool]:
        """Whether `consumer` still owns each of these delivery tags (read only)."""
        if not tags:
            return []
        return [bool(flag) for flag in client.smismember(OWNED_KEY.format(consumer=consumer), list(tags))]

    def requeue(self, client: redis.Redis, consumer: str, queue: str) -> int:
        """`consumer`'s fetching list for `queue` back at the queue's consuming end (it was next)."""
        return self._call(client, "requeue", consumer, queue)

    def release(self, client: redis.Redis, consumer: str) -> None:
        self._call(client, "release", consumer)

    def restore(self, client: redis.Redis, consumer: str, tag: str, pushes: Sequence[tuple[str, str, Any]]) -> bool:
        """One unacked message of `consumer` back in its queue, as `pushes` ((op, list, payload), what
        kombu's restore would send), only while `consumer` still owns it: of two workers recovering
        the same consumer one restores it; a message fetched again by a live consumer is its own."""
        if any(op not in _PUSHES for op, _, _ in pushes):
            raise ValueError(f"a restore pushes with {_PUSHES}, got {[op for op, _, _ in pushes]}")
        args = [part for op, _, payload in pushes for part in (op, payload)]
        return bool(self._call(client, "restore", consumer, "", tag, *args, targets=[key for _, key, _ in pushes]))

    def forget(self, client: redis.Redis, consumer: str) -> None:
        self._call(client, "forget", consumer)


class PushRecorder:
    """Stands in for the pipeline kombu's `_do_restore_message` writes to: the pushes it would
    send, to be made atomically by `WorkerState.restore`."""

    def __init__(self) -> None:
        self.pushes: list[tuple[str, str, Any]] = []

    def lpush(self, key: str, value: Any) -> None:
        self.pushes.append(("lpush", key, value))

    def rpush(self, key: str, value: Any) -> None:
        self.pushes.append(("rpush", key, value))
