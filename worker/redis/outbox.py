"""The outbox: the worker's writes of its answers (publish once, the results and review streams,
dead letters), each through `Writes`, on top of the delivery counts and the epoch check of
`worker.redis.attempts.Attempts`.

Keys and their meaning: worker.redis.keys. Celery's backend results: worker.redis.celery_results.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import redis

from ticketq.epoch import marker_id
from ticketq.lua import script
from ticketq.names import ATTEMPTS_KEY, DEAD_LETTER_STREAM, EPOCH_KEY, RESULTS_STREAM, REVIEW_STREAM
from ticketq.publishing import Published, Unconfirmed
from worker.health import Health
from worker.redis import celery_results
from worker.redis.attempts import Attempts
from worker.redis.keys import CANCELLED, DIGEST_KEY, DONE_KEY, FAILED_KEY, PUBLISH_CALL_KEY, PUBLISH_CALL_TTL_S

if TYPE_CHECKING:
    from worker.settings import Settings

ToReview = Mapping[tuple[str, int], str]  # (task id, slot) of a result to review -> its ticket's text
NO_REVIEW: ToReview = MappingProxyType({})
log = logging.getLogger(__name__)

# The outbox's Redis scripts, beside this module (each file's header lists its keys and arguments).
PUBLISH_ONCE = script(__package__, "publish_once")  # one forward batch's results, each (task, slot) streamed once


class Outbox(Attempts):
    """The worker's Redis writes: results stream, Celery backend results, attempts counters, dead letters."""

    def __init__(
        self,
        client: redis.Redis,
        health: Health,
        stream_maxlen: int,
        result_expires_s: int,
        worst_batch_s: float,
        replica_acks: int = 0,
        replica_timeout_s: float = 1.0,
    ) -> None:
        """`health`: the process's (its refusals ride writes out, its data loss counts a lost epoch)."""
        super().__init__(client, health, result_expires_s, worst_batch_s, replica_acks, replica_timeout_s)
        self.stream_maxlen = stream_maxlen

    @classmethod
    def from_settings(cls, client: redis.Redis, settings: Settings, health: Health) -> Outbox:
        return cls(client, health, settings.stream_maxlen, settings.result_expires_s, settings.worst_batch_s,
                   settings.replica_acks, settings.replica_timeout_s)  # fmt: skip

    # ----- results -------------------------------------------------------------------------

    def publish(self, slots: Sequence[tuple], finished: Sequence[str], review: ToReview = NO_REVIEW) -> Published:
        """Stream each (task id, slot, result JSON[, payload digest]) once, each entry with the epoch
        marker's id (`ticketq.epoch`), drop the attempts keys of `finished` messages, and copy the (task
        id, slot) keys of `review` to `names.REVIEW_STREAM` with their first publication (with the text).

        One script call. EVAL, not a registered Script: redis-py checks SCRIPT EXISTS before every
        pipeline that holds a Script (a second round trip per forward batch); EVAL of a short body costs
        a few hundred bytes and Redis caches the compiled script. Deleting an attempts key before the
        backend write is safe: a crash in between only makes the redelivered message look fresh, and its
        results are published once anyway. The digest is the message's `ticketq.publishing.payload_digest`
        (omitted or "": not checked); a message whose task id already streamed another payload's results
        gets nothing written, and its results come back as conflicts."""
        by_task: dict[str, list[tuple[int, bytes]]] = {}
        digests: dict[str, str] = {}
        for task_id, slot, encoded, *digest in slots:
            by_task.setdefault(task_id, []).append((slot, encoded))
            digests.setdefault(task_id, digest[0] if digest else "")
        keys = [
            RESULTS_STREAM,
            *(DONE_KEY.format(task_id=task_id) for task_id in by_task),
            *(DIGEST_KEY.format(task_id=task_id) for task_id in by_task),
            *(FAILED_KEY.format(task_id=task_id) for task_id in by_task),
            PUBLISH_CALL_KEY.format(call=uuid.uuid4().hex),  # the same for every retry of this call
            REVIEW_STREAM,
            EPOCH_KEY,
            *(ATTEMPTS_KEY.format(task_id=task_id) for task_id in finished),
        ]
        groups = by_task.values()
        order = [(task_id, slot) for task_id, group in by_task.items() for slot, _ in group]
        args = [
            self.stream_maxlen,
            self.result_expires_s,
            len(by_task),
            PUBLISH_CALL_TTL_S,
            ",".join(str(at) for at, place in enumerate(order, 1) if place in review),
            *(",".join([str(slot) for slot, _ in group]) for group in groups),
            *digests.values(),
            *(encoded for group in groups for _, encoded in group),
            *(review[place] for place in order if place in review),  # the texts, last
        ]
        # Durable only when it finishes a message: an ack follows, and must not outrun the replicas.
        command = lambda target: target.eval(PUBLISH_ONCE, len(keys), *keys, *args)  # noqa: E731
        try:
            if finished:
                repeats, conflicts = self.durable(self.redis, command)
            else:
                repeats, conflicts = self.retrying(lambda: command(self.redis))
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError, OSError) as exc:
            raise Unconfirmed(keys[3 * len(by_task) + 1], order, exc) from exc
        return _published(order, repeats, conflicts)

    def landed(self, unconfirmed: Unconfirmed) -> Published | None:
        """What a publish call that gave up did after all (its command may have reached Redis, and
        run, after its reply was lost): its answer, or None if it has not run, in which case it is
        cancelled: a copy still in flight does nothing when it arrives. Retries while Redis is
        away, up to worst_batch_s."""
        key = unconfirmed.call_key
        # Fenced in one step: if the call has not run, it never will (arriving late, it finds the key).
        fenced = self.retrying(lambda: self.redis.set(key, CANCELLED, nx=True, ex=PUBLISH_CALL_TTL_S))
        if fenced:
            return None
        answer = self.retrying(lambda: self.redis.get(key), write=False)
        repeats, conflicts = (part or [] for part in json.loads(answer))
        return _published(unconfirmed.order, repeats, conflicts)

    def stream_results(self, encoded: Sequence[bytes]) -> None:
        """Stream results without publish-once marks (the answers of a message that reused a task id)."""
        if not encoded:
            return

        def append() -> None:
            pipe = self.redis.pipeline(transaction=True)  # all or none: a retry never appends twice
            fields = {"epoch": epoch} if (epoch := marker_id(self.epoch.known)) else {}  # as this process saw it
            for data in encoded:
                pipe.xadd(RESULTS_STREAM, {"data": data, **fields}, maxlen=self.stream_maxlen, approximate=True)
            pipe.execute()

        self.retrying(append)

    def answered(self, backend: Any, requests: Sequence[tuple[str, int]]) -> set[str]:
        """Task ids among (task id, ticket count) that have a final result: a result in the backend,
        or every ticket's result streamed (one pipelined round trip)."""
        if not requests:
            return set()
        client = getattr(backend, "client", None)
        pipe = self.redis.pipeline(transaction=False)
        for task_id, _ in requests:
            pipe.bitcount(DONE_KEY.format(task_id=task_id))
        streamed = self.retrying(pipe.execute, write=False)
        stored = [False] * len(requests)
        if isinstance(client, redis.Redis):
            keys = [backend.get_key_for_task(task_id) for task_id, _ in requests]
            stored = self.retrying(lambda: [bool(v) for v in client.mget(keys)], write=False)
        return {task_id for (task_id, count), done, kept in zip(requests, streamed, stored, strict=True)
                if kept or done >= max(count, 1)}  # fmt: skip

    def store_successes(self, backend: Any, successes: Sequence[tuple[Any, bytes]]) -> None:
        """Celery SUCCESS results for (request, value as JSON) pairs (`celery_results.store_successes`)."""
        celery_results.store_successes(self, backend, successes)

    def mark_failed(self, backend: Any, request: Any, exc: BaseException, state: str = "FAILURE") -> None:
        """Celery FAILURE (or REVOKED) result for one request (`celery_results.mark_failed`)."""
        celery_results.mark_failed(self, backend, request, exc, state)

    # ----- dead letters --------------------------------------------------------------------

    def dead_letter(self, entry: dict[str, str]) -> None:
        """Append one entry (`ticketq.dead_letters`: `ticket_entry` or `raw_entry`) to the dead-letter stream."""
        self.retrying(lambda: self.redis.xadd(DEAD_LETTER_STREAM, entry, maxlen=self.stream_maxlen))


def _published(order: list[tuple[str, int]], repeats: Sequence[int], conflicts: Sequence[int]) -> Published:
    return Published([order[p - 1] for p in repeats], [order[p - 1] for p in conflicts])
