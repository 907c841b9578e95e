"""Riding out a Redis that is away or refuses writes, and confirming writes on the replicas.

Every write here is idempotent or counted, so a re-executed message never publishes twice, and
goes through `Writes.retrying`, which rides out a Redis restart or a failover (a vanished or
demoted master) for up to TICKETQ_WORST_BATCH_S, and a Redis that refuses writes (full under
noeviction, too few replicas for min-replicas-to-write) for as long as it refuses: the batch's
messages stay unacknowledged meanwhile. With TICKETQ_REPLICA_ACKS, the writes an ack follows
(results, backend results) are confirmed by that many replicas (WAIT) before the write returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from ticketq.connections import confirm_replicas
from worker.health.refusals import Refusals

log = logging.getLogger(__name__)

_UNSET = object()


class Writes:
    """Redis commands run through `retrying` (and `durable` for the writes an ack follows)."""

    def __init__(self, client: redis.Redis, refusals: Refusals, worst_batch_s: float, replica_acks: int = 0,
                 replica_timeout_s: float = 1.0) -> None:  # fmt: skip
        """`refusals`: the process's episodes of Redis refusing writes (`worker.health.Health.refusals`)."""
        self.redis = client
        self.refusals = refusals
        self.worst_batch_s = worst_batch_s
        self.replica_acks = replica_acks
        self.replica_timeout_s = replica_timeout_s

    def retrying(self, action: Callable[[], Any], write: bool = True) -> Any:
        """Run a Redis command, retrying with backoff while Redis is away or refuses the write.

        Connection errors, timeouts and READONLY (a master demoted under us: the next connection
        asks the sentinels again) are retried for up to worst_batch_s seconds. A refused write
        (full, too few replicas) is retried until Redis takes it, with no deadline: giving up would
        fail the batch and ack its messages, results unwritten; the refusal is logged once per
        episode (`Refusals.refused`). A loop here rather than redis-py's `Retry`: that one counts attempts,
        this bounds time (a batch's results must be out before TICKETQ_WORST_BATCH_S).
        """
        deadline = time.monotonic() + self.worst_batch_s
        delay = 0.1
        while True:
            try:
                result = action()
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, delay)
            except redis.ResponseError as exc:
                if not self.refusals.refused(exc, "a result write"):
                    raise
            else:
                if write:
                    self.refusals.accepted()
                return result
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    # ----- replica acks: no ack before the replicas hold the results -----------------------

    def durable(self, client: redis.Redis, command: Callable[[Any], Any]) -> Any:
        """`command(client)`; with TICKETQ_REPLICA_ACKS, `command(pipeline)` and a WAIT on one
        connection, again until that many replicas hold the write. Returns the first answer.

        The whole pipeline runs again after a short WAIT, not the WAIT alone: after a failover the
        new master may lack the write, and a WAIT there would confirm its own history, not ours.
        The writes are idempotent, so a re-run only finds them done (the first answer is kept).
        """
        if not self.replica_acks:
            return self.retrying(lambda: command(client))
        first = _UNSET
        while True:
            value, acked = self.retrying(lambda: self._with_wait(client, command))
            first = value if first is _UNSET else first
            if acked >= self.replica_acks:
                self.refusals.replicas_behind.end()
                return first
            self.refusals.replicas_behind.begin(f"{acked} of {self.replica_acks} replica(s) confirmed within "
                                  f"{self.replica_timeout_s:g}s")  # fmt: skip

    def _with_wait(self, client: redis.Redis, command: Callable[[Any], Any]) -> tuple[Any, int]:
        pipe = client.pipeline(transaction=False)
        command(pipe)
        confirm_replicas(pipe, self.replica_acks, self.replica_timeout_s)
        replies = pipe.execute()
        return replies[0], int(replies[-1])
