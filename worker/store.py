"""Every Redis write ticketq makes besides the broker's own queue traffic, and what each key means.

Keys and streams, what each holds, and who writes it (stream names in ticketq.names, templates
below; <task> is a Celery task id, <slot> a ticket's place in its message, <consumer> one
consuming channel, host:pid:random):

- `ticketq:results` (stream) — one entry per final ticket result (ok, failed, expired), field
  `data` = the result JSON; capped with MAXLEN ~ TICKETQ_STREAM_MAXLEN. `Outbox.publish`
  (`Outbox.stream_results` for the answers of a message that reused a task id).
- `ticketq:dead` (stream) — one entry per refused ticket or message: reason, error, payload (the
  ticket or arguments as JSON, or the raw bytes as `payload_b64` when it never became a ticket),
  whole up to `dead_letter_bound`, `truncated` when cut. `Outbox.dead_letter`; `drop_dead_letter`
  (operator requeue, once the re-sent message is answered).
- `ticketq:requeued` (hash) — dead-letter entry id -> the task id it was re-sent as, until that task
  has a result and the entry is dropped. `mark_requeued`, `settle_requeued` (operator commands).
- `ticketq:done:<task>` (bit string, TTL = result expiry) — bit <slot> is set once that ticket's
  final result is streamed, so a re-executed message never publishes twice. `Outbox.publish`.
- `ticketq:failed:<task>` (hash, TTL = result expiry) — slot -> the reason of a failure that was
  streamed and kept by a requeue (its done bit stays set): the re-sent ticket failing for the same
  reason is a repeat, not a second `failed` entry; its answer or another failure is streamed once.
  `keep_failure` (operator requeue), `Outbox.publish`.
- `ticketq:epoch`, `ticketq:epoch:lost` (strings; names in ticketq.names) — the epoch marker every
  worker and producer sets if absent and reads with its work, and the record of the latest loss
  noticed (TTL a day): a Redis that came back without its data is reported. ticketq.epoch,
  `Outbox.attempts`.
- `ticketq:digest:<task>` (string, TTL = result expiry) — a hash of the message's arguments, written
  with its first published result: a re-delivery of the same message is published once, another
  message under the same task id is answered `duplicate_task_id`. `Outbox.publish`.
- `ticketq:publish:<call>` (string, TTL PUBLISH_CALL_TTL_S) — the answer of one publish call,
  so that the call repeated after a lost reply (a timeout, a partition) gets the first answer
  again instead of "all repeats": each result is counted once, by the worker that published it;
  `cancelled` when the call gave up before it ran, so a copy that arrives late does nothing.
  `Outbox.publish`, `Outbox.landed`.
- `ticketq:attempts:<task>` (counter, TTL = result expiry) — deliveries of an unfinished message;
  bounds crash loops on poison tickets, deleted when the message is finished.
  `Outbox.count_deliveries`, `Outbox.publish`; `forget_message` (operator requeue).
- `celery-task-meta-<task>` (string, also PUBLISHed) — Celery's result in Celery's own format:
  what `AsyncResult.get()` waits on. `Outbox.store_successes`, `Outbox.mark_failed`.
- `ticketq:fetching:<consumer>:<queue>` (list) — a message between its pop and its unacked
  record. worker.transport.fetch (fetch), .lease (recovery).
- `ticketq:owned:<consumer>` (set) — delivery tags one consumer holds unacked. worker.transport.fetch
  (fetch, ack, recovery).
- `ticketq:alive:<consumer>` (string, TTL = TICKETQ_LEASE_S) — exists while the consumer beats:
  its lease. worker.transport.lease.
- `ticketq:consumers` (hash) — consumer -> {host, pid, queues, since}: whom recovery checks.
  worker.transport.lease.
- `unacked`, `unacked_index` (hash, zset) — kombu's own record of delivered, unacknowledged
  messages. kombu, through worker.transport.fetch.QoS.

The fetch and lease keys are written by one script, worker/transport/lua/worker_state.lua
(dispatched by worker.transport.state); their names are ticketq.names' (a producer reads them).

Every write here is idempotent or counted, so a re-executed message never publishes twice, and
goes through `Outbox.retrying`, which rides out a Redis restart or a failover (a vanished or
demoted master) for up to TICKETQ_WORST_BATCH_S, and a Redis that refuses writes (full under
noeviction, too few replicas for min-replicas-to-write) for as long as it refuses: the batch's
messages stay unacknowledged meanwhile. With TICKETQ_REPLICA_ACKS, the writes an ack follows
(results, backend results) are confirmed by that many replicas (WAIT) before the outbox returns.

A refusal is an `Episode`, one per reason, shared by every thread of the process (the outbox, the
transport's fetch and acks, the lease): logged once when it begins and once when it ends, and
named by /readyz while it lasts (`write_problems`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import redis
from celery import states

from ticketq import codec
from ticketq.connections import NOT_ENOUGH_REPLICAS, OUT_OF_MEMORY, confirm_replicas, write_refusal
from ticketq.epoch import Epoch, Loss, whoami
from ticketq.errors import TicketqError
from ticketq.names import (  # noqa: F401 (the delivery records' names, shared: a producer reads them)
    ALIVE_KEY,
    ATTEMPTS_KEY,
    CONSUMERS_KEY,
    DEAD_LETTER_STREAM,
    EPOCH_KEY,
    FETCHING_KEY,
    OWNED_KEY,
    RESULTS_STREAM,
    REVIEW_STREAM,
)
from worker.transport.lua import script

if TYPE_CHECKING:
    from worker.settings import Settings

log = logging.getLogger(__name__)

DONE_KEY = "ticketq:done:{task_id}"
DIGEST_KEY = "ticketq:digest:{task_id}"
FAILED_KEY = "ticketq:failed:{task_id}"
REQUEUED_KEY = "ticketq:requeued"
PUBLISH_CALL_KEY = "ticketq:publish:{call}"
# Longer than any retrying of one call, and than TCP holds an unsent command (tcp_retries2: ~15 min).
PUBLISH_CALL_TTL_S = 1800
CANCELLED = b"cancelled"  # a publish call's key when the call gave up before it ran (`Outbox.landed`)

# A dead letter keeps a refused payload whole up to this many bytes (at least; see `dead_letter_bound`).
DEAD_LETTER_MIN_BYTES = 4 * 1024 * 1024

# The outbox's Redis scripts (worker/transport/lua/: each file's header lists its keys and arguments).
PUBLISH_ONCE = script("publish_once")  # one forward batch's results, each (task, slot) streamed once
STORE_ONCE = script("store_once")  # Celery backend results, SET NX + PUBLISH
COUNT_DELIVERIES = script("count_deliveries")  # INCR + EXPIRE of each message's attempts key


class Episode:
    """A spell of one condition (Redis full, too few replicas, results not yet on the replicas):
    logged once when it begins and once when it ends, whichever threads meet it meanwhile.

    It ends at the first success `quiet_s` or more after the last failure, so a server at the edge
    of its limit (one write refused, the next accepted: its memory rises and falls with the replies
    it buffers) makes one episode, not one per write. `QUIET_S` is longer than the longest pause
    between two writes a worker tries while Redis stays full (the outbox retries every 2 s at
    most, the fetch every REFUSED_PAUSE_S), so a write that squeezes through in between does not
    end it. Cost: the end (its log line, /readyz ready again) comes up to `quiet_s` after Redis
    takes writes again.
    """

    QUIET_S = 5.0

    def __init__(self, name: str, meanwhile: str, over: str, quiet_s: float = QUIET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.name, self.meanwhile, self.over, self.quiet_s = name, meanwhile, over, quiet_s
        self.since: float | None = None  # monotonic start of the current episode
        self._last = 0.0  # monotonic time of its latest failure
        self._clock = clock
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.since is not None

    def begin(self, detail: str) -> None:
        with self._lock:
            self._last = self._clock()
            if self.since is not None:
                return
            self.since = self._last
        log.error("%s: %s; %s", self.name, detail, self.meanwhile)

    def end(self) -> None:
        if self.since is None:  # the usual case, on every write: no lock taken
            return
        with self._lock:
            now = self._clock()
            if self.since is None or now - self._last < self.quiet_s:
                return
            lasted, self.since = now - self.since, None
        log.warning("%s, after %.1fs", self.over, lasted)


REDIS_FULL = Episode(
    "Redis is full (maxmemory)",
    "fetching paused, results and acks retried until it takes writes again: free memory or raise maxmemory",
    "Redis takes writes again",
)
TOO_FEW_REPLICAS = Episode(
    "Redis refuses writes: not enough replicas (min-replicas-to-write)",
    "fetching paused, results and acks retried until a replica is back",
    "Redis takes writes again: enough replicas",
)
REPLICAS_BEHIND = Episode(
    "Results not confirmed by the replicas (TICKETQ_REPLICA_ACKS)",
    "their messages stay unacknowledged, the write and its WAIT retried until enough replicas hold them",
    "The replicas confirm results again",
    quiet_s=0.0,  # only result writes end it: an idle worker must not stay not-ready
)
_REFUSALS = {OUT_OF_MEMORY: REDIS_FULL, NOT_ENOUGH_REPLICAS: TOO_FEW_REPLICAS}


def refused(exc: BaseException, what: str) -> bool:
    """True when `exc` is Redis refusing a write (full, too few replicas): its episode begins (logged
    once). False for any other error, which the caller handles as before."""
    episode = _REFUSALS.get(write_refusal(exc))
    if episode is None:
        return False
    episode.begin(f"{what} refused ({exc})")
    return True


def refusing(reason: str, what: str) -> bool:
    """`refused` for a reason `ticketq.connections.write_problem` found (no exception to hand)."""
    episode = _REFUSALS.get(reason)
    if episode is None:
        return False
    episode.begin(f"{what} waits ({reason})")
    return True


def accepted() -> None:
    """A write that a full or replica-less Redis would refuse went through: refusal episodes end."""
    for episode in _REFUSALS.values():
        episode.end()


class DataLoss:
    """Redis found without its data (`ticketq.epoch`), as this process notices it: one log line and
    one count per loss, whichever outbox of the process notices it (`ticketq_redis_data_lost_total`)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def noticed(self, loss: Loss) -> None:
        with self._lock:
            self.count += 1
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(loss.since)) if loss.since else "earlier"
        log.error(
            "Redis lost its data (restarted without persistence, or flushed: the epoch marker set %s is gone): "
            "the queue, unacked messages, results stream, dead letters and publish-once marks it held are gone; "
            "this worker goes on, and the tickets that were waiting are answered once their producers send them "
            "again (ticketq-produce --resend-after, Producer.wait(resend_after=))", since,
        )  # fmt: skip


DATA_LOST = DataLoss()


def write_problems() -> list[str]:
    """The episodes lasting now, for /readyz."""
    return [episode.name for episode in (*_REFUSALS.values(), REPLICAS_BEHIND) if episode.active]


_UNSET = object()


class Published(NamedTuple):
    """What `Outbox.publish` did not stream: (task id, slot) of each result already published by the
    same message (a re-execution), and of each result of another message under a used task id."""

    repeats: list[tuple[str, int]]
    conflicts: list[tuple[str, int]]


DIGEST_FORMAT = "2:"  # digests of another format (an older worker's) are never taken for conflicts


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


class Outbox:
    """The worker's Redis writes: results stream, Celery backend results, attempts counters, dead letters."""

    def __init__(
        self,
        client: redis.Redis,
        stream_maxlen: int,
        result_expires_s: int,
        worst_batch_s: float,
        replica_acks: int = 0,
        replica_timeout_s: float = 1.0,
    ) -> None:
        self.redis = client
        self.stream_maxlen = stream_maxlen
        self.result_expires_s = result_expires_s
        self.worst_batch_s = worst_batch_s
        self.replica_acks = replica_acks
        self.replica_timeout_s = replica_timeout_s
        self.epoch = Epoch(whoami("worker"))

    @classmethod
    def from_settings(cls, client: redis.Redis, settings: Settings) -> Outbox:
        return cls(client, settings.stream_maxlen, settings.result_expires_s, settings.worst_batch_s,
                   settings.replica_acks, settings.replica_timeout_s)  # fmt: skip

    # ----- attempts: how often a message was delivered while unfinished ----------------------

    def attempts(self, task_ids: Sequence[str]) -> list[int | None]:
        """The delivery count of each message, None for a first delivery (one MGET, which reads the
        epoch marker too: every job checks that Redis still holds its data, at no extra round trip)."""
        if not task_ids:
            return []
        keys = [ATTEMPTS_KEY.format(task_id=task_id) for task_id in task_ids]
        *counts, marker = self.retrying(lambda: self.redis.mget([*keys, EPOCH_KEY]), write=False)
        self.judge_epoch(marker)
        return [None if count is None else int(count) for count in counts]

    def judge_epoch(self, marker: bytes | None) -> Loss | None:
        """Judge the epoch marker as just read (`ticketq.epoch.Epoch.seen`); a loss is logged and
        counted once (`DATA_LOST`). A Redis that refuses the fresh marker (full) or is cut off is
        judged again at the next check."""
        try:
            loss = self.epoch.seen(self.redis, marker)
        except redis.RedisError as exc:
            log.debug("epoch marker not checked (%s); checked again with the next job", exc)
            return None
        if loss is not None:
            DATA_LOST.noticed(loss)
        return loss

    def count_deliveries(self, task_ids: Sequence[str]) -> int:
        """INCR each message's attempts key (with its expiry) in one script call; the first one's new count."""
        keys = [ATTEMPTS_KEY.format(task_id=task_id) for task_id in task_ids]
        return int(self.retrying(lambda: self.redis.eval(COUNT_DELIVERIES, len(keys), *keys, self.result_expires_s))[0])

    # ----- results -------------------------------------------------------------------------

    def publish(self, slots: Sequence[tuple], finished: Sequence[str], review: Collection[tuple[str, int]] = ()
                ) -> Published:  # fmt: skip
        """Stream each (task id, slot, result JSON[, payload digest]) once, and drop the attempts keys
        of `finished` messages; the (task id, slot) in `review` are copied to the review stream
        (`names.REVIEW_STREAM`) with their first publication.

        One script call. EVAL, not a registered Script: redis-py checks SCRIPT EXISTS before
        every pipeline that holds a Script (a second round trip per forward batch, a third of the
        publish time in a profile); EVAL of a short body costs a few hundred bytes and Redis caches
        the compiled script. Deleting an attempts key before the backend write is safe: a crash in
        between only makes the redelivered message look fresh, and its results are published once
        anyway. The digest is the message's `payload_digest` (omitted or "": not checked); a message
        whose task id already streamed another payload's results gets nothing written, and its
        results come back as conflicts.
        """
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
            *(ATTEMPTS_KEY.format(task_id=task_id) for task_id in finished),
        ]
        groups = by_task.values()
        order = [(task_id, slot) for task_id, group in by_task.items() for slot, _ in group]
        args = [
            self.stream_maxlen,
            self.result_expires_s,
            len(by_task),
            PUBLISH_CALL_TTL_S,
            ",".join(str(at) for at, place in enumerate(order, 1) if place in review) if review else "",
            *(",".join([str(slot) for slot, _ in group]) for group in groups),
            *digests.values(),
            *(encoded for group in groups for _, encoded in group),
        ]
        # Durable only when it finishes a message: an ack follows, and must not outrun the replicas.
        command = lambda target: target.eval(PUBLISH_ONCE, len(keys), *keys, *args)  # noqa: E731
        try:
            if finished:
                repeats, conflicts = self._durable(self.redis, command)
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
        """Append results to the stream without publish-once marks: the answers of messages that
        reused another message's task id (the id's marks belong to that one)."""
        if not encoded:
            return

        def append() -> None:
            pipe = self.redis.pipeline(transaction=True)  # all or none: a retry never appends twice
            for data in encoded:
                pipe.xadd(RESULTS_STREAM, {"data": data}, maxlen=self.stream_maxlen, approximate=True)
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
        """Celery SUCCESS results for (request, value as JSON) pairs: one STORE_ONCE call on a Redis backend.

        The values come already serialised (each ticket's result JSON is the one streamed); with
        Celery's JSON result serializer the meta is assembled around them, not serialised again.
        """
        client = getattr(backend, "client", None)
        if not isinstance(client, redis.Redis):  # not a Redis backend: Celery's own write, one per task
            for request, value in successes:
                self.retrying(lambda r=request, v=json.loads(value): backend.mark_as_done(r.id, v, request=r))
            return
        expires = int(backend.expires or 0)
        done = backend.app.now().isoformat()  # one date_done for the batch (Celery's now() is not cheap)
        keys = [backend.get_key_for_task(request.id) for request, _ in successes]
        if backend.serializer == "json":
            metas = [success_meta_json(request.id, value, done) for request, value in successes]
        else:
            metas = [backend.encode(success_meta(request.id, json.loads(value), done)) for request, value in successes]
        self._durable(client, lambda target: target.eval(STORE_ONCE, len(keys), *keys, expires, *metas))

    def mark_failed(self, backend: Any, request: Any, exc: BaseException) -> None:
        """Celery FAILURE result for one request.

        On a Redis backend it is stored only where no result is yet (STORE_ONCE, as successes
        are), in Celery's format (`_get_result_meta`): a failure never overwrites the answer of a
        worker that took the message over (Celery's own check, a GET then a SET, leaves a window).
        Elsewhere Celery's mark_as_failure, with call_errbacks=False: it reads `request.errbacks`,
        which celery-batches' SimpleRequest lacks, and batch tasks carry no errbacks.
        """
        client = getattr(backend, "client", None)
        if isinstance(client, redis.Redis):  # set if absent, like a SUCCESS: never over another worker's answer
            meta = backend._get_result_meta(result=backend.prepare_exception(exc), state=states.FAILURE,
                                            traceback=None, request=request)  # fmt: skip
            meta["task_id"] = request.id
            keys, expires = [backend.get_key_for_task(request.id)], int(backend.expires or 0)
            self._durable(client, lambda target: target.eval(STORE_ONCE, 1, *keys, expires, backend.encode(meta)))
            return
        self.retrying(lambda: backend.mark_as_failure(request.id, exc, request=request, call_errbacks=False))

    # ----- dead letters --------------------------------------------------------------------

    def dead_letter(self, entry: dict[str, str]) -> None:
        """Append one entry (`ticket_entry` or `raw_entry`) to the dead-letter stream."""
        self.retrying(lambda: self.redis.xadd(DEAD_LETTER_STREAM, entry, maxlen=self.stream_maxlen))

    # ----- riding out a Redis restart ------------------------------------------------------

    def retrying(self, action: Callable[[], Any], write: bool = True) -> Any:
        """Run a Redis command, retrying with backoff while Redis is away or refuses the write.

        Connection errors, timeouts and READONLY (a master demoted under us: the next connection
        asks the sentinels again) are retried for up to worst_batch_s seconds. A refused write
        (full, too few replicas) is retried until Redis takes it, with no deadline: giving up would
        fail the batch and ack its messages, results unwritten; the refusal is logged once per
        episode (`refused`). A loop here rather than redis-py's `Retry`: that one counts attempts,
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
                if not refused(exc, "a result write"):
                    raise
            else:
                if write:
                    accepted()
                return result
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    # ----- replica acks: no ack before the replicas hold the results -----------------------

    def _durable(self, client: redis.Redis, command: Callable[[Any], Any]) -> Any:
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
                REPLICAS_BEHIND.end()
                return first
            REPLICAS_BEHIND.begin(f"{acked} of {self.replica_acks} replica(s) confirmed within "
                                  f"{self.replica_timeout_s:g}s")  # fmt: skip

    def _with_wait(self, client: redis.Redis, command: Callable[[Any], Any]) -> tuple[Any, int]:
        pipe = client.pipeline(transaction=False)
        command(pipe)
        confirm_replicas(pipe, self.replica_acks, self.replica_timeout_s)
        replies = pipe.execute()
        return replies[0], int(replies[-1])


class Unconfirmed(TicketqError, redis.ConnectionError):
    """A publish call that Redis did not answer within worst_batch_s: it may still have run (a
    command sent into a partition arrives when it heals). `Outbox.landed` finds out."""

    def __init__(self, call_key: str, order: list[tuple[str, int]], cause: BaseException) -> None:
        super().__init__(f"publishing {len(order)} result(s) unconfirmed: {cause}")
        self.call_key, self.order = call_key, order


def _published(order: list[tuple[str, int]], repeats: Sequence[int], conflicts: Sequence[int]) -> Published:
    return Published([order[p - 1] for p in repeats], [order[p - 1] for p in conflicts])


def success_meta(task_id: str, value: Any, date_done: str) -> dict:
    """Celery's result meta for a SUCCESS, as `BaseBackend._store_result` builds it (result_extended off).

    ticketq tasks have no children, group or parent, and the worker runs with
    `result_extended=False`; `worker.transport.guards.check_result_meta` checks at start-up that
    this equals what the installed Celery stores.
    """
    return {"status": "SUCCESS", "result": value, "traceback": None, "children": [], "date_done": date_done,
            "task_id": task_id}  # fmt: skip


_VALUE_MARK = "\x00ticketq-value\x00"  # stands for the value in `success_meta_json`; JSON-escaped, never a real value


def success_meta_json(task_id: str, value_json: bytes, date_done: str) -> bytes:
    """`success_meta` as JSON, around a value that is JSON already (equal to json.dumps of the meta):
    the meta's shape stays defined once, in `success_meta`."""
    head, tail = json.dumps(success_meta(task_id, _VALUE_MARK, date_done)).split(json.dumps(_VALUE_MARK))
    return head.encode() + value_json + tail.encode()


def dead_letter_bound(max_ticket_bytes: int) -> int:
    """How much of a refused payload a dead letter keeps whole: 8x TICKETQ_MAX_TICKET_BYTES (a ticket
    at the limit is at most 6x that as ASCII JSON, every byte a \\u00XX escape, plus its other
    fields), and never under DEAD_LETTER_MIN_BYTES, so an oversize ticket survives to be re-sent once
    the limit is raised."""
    return max(DEAD_LETTER_MIN_BYTES, 8 * max_ticket_bytes)


def ticket_entry(
    task_id: str, slot: int | None, reason: str, error: str, payload: Any, worker: str,
    limit: int = DEAD_LETTER_MIN_BYTES,
) -> dict[str, str]:  # fmt: skip
    """Dead-letter fields for a ticket (one slot) or a whole message (slot None) refused by the service.

    `payload` is the ticket (or the message's arguments) as decoded, written as ASCII JSON, which
    gives back exactly that value (lone surrogates included); cut at `limit` bytes only, and then
    flagged `truncated`, which `ticketq dead requeue` refuses to re-send.
    """
    dumped = _dump(payload)
    return {
        "task_id": task_id,
        "slot": "" if slot is None else str(slot),
        "reason": str(reason),
        "error": error,
        "payload": dumped[:limit],
        "truncated": str(len(dumped) > limit).lower(),
        "worker": worker,
        "at": f"{time.time():.3f}",
    }


def raw_entry(
    reason: str, exc: BaseException | None, headers: Any, content_type: Any, body: Any,
    limit: int = DEAD_LETTER_MIN_BYTES,
) -> dict[str, str]:  # fmt: skip
    """Dead-letter fields for a message refused before it became a ticket, raw bytes kept.

    Written by the transport (an unreadable queue item) and by the Celery consumer (pickle/YAML
    content, unknown or invalid task). `payload_b64` holds the message exactly as it came (up to
    `limit` bytes, else `truncated`), so nothing is lost and `ticketq dead requeue` can resend it.
    `headers` may be anything a sender put there.
    """
    headers = headers if isinstance(headers, dict) else {}
    raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "backslashreplace")
    return {
        "task_id": str(headers.get("id", "") or ""),
        "task": str(headers.get("task", "") or ""),
        "reason": str(reason),
        "error": f"{type(exc).__name__}: {exc}"[:2000] if exc else str(reason),
        "content_type": str(content_type or ""),
        "payload_b64": base64.b64encode(raw[:limit]).decode(),
        "truncated": str(len(raw) > limit).lower(),
        "at": f"{time.time():.3f}",
    }


def forget_message(client: redis.Redis, task_id: str, digest: bool = True) -> None:
    """Drop a message's attempts key (or its redelivery would be refused), and with `digest` the
    hash of its arguments (a requeue re-sends one ticket of them under the same id). Its done bits
    stay: what was streamed is never streamed again, except as `keep_failure` allows."""
    keys = [ATTEMPTS_KEY.format(task_id=task_id)]
    if digest:
        keys.append(DIGEST_KEY.format(task_id=task_id))
    client.delete(*keys)


def keep_failure(client: redis.Redis, task_id: str, slot: int, reason: str, expires_s: int) -> None:
    """Mark (task, slot) as having streamed a failure for `reason` (its done bit, and the reason in
    its failed key), before a requeue re-sends it: the same failure again is a repeat, not a second
    stream entry; an answer or another failure is streamed once (`Outbox.publish`)."""
    done, failed = DONE_KEY.format(task_id=task_id), FAILED_KEY.format(task_id=task_id)
    pipe = client.pipeline(transaction=True)
    pipe.setbit(done, slot, 1)
    pipe.expire(done, expires_s)
    pipe.hset(failed, str(slot), reason)
    pipe.expire(failed, expires_s)
    pipe.execute()


def done_count(client: redis.Redis, task_id: str) -> int:
    """How many of a message's tickets have a result in the stream (its publish-once marks)."""
    return int(client.bitcount(DONE_KEY.format(task_id=task_id)))


def mark_requeued(client: redis.Redis, entry_id: str, task_id: str) -> None:
    """Remember that a dead letter was re-sent as `task_id`; it stays until that task is answered."""
    client.hset(REQUEUED_KEY, entry_id, task_id)


def requeued(client: redis.Redis) -> dict[str, str]:
    """Dead-letter entry id -> the task id it was re-sent as, for entries awaiting that answer."""
    return {k.decode(): v.decode() for k, v in client.hgetall(REQUEUED_KEY).items()}


def drop_dead_letter(client: redis.Redis, entry_id: str) -> None:
    """Remove one dead-letter entry (its re-sent message is answered) and its requeue record."""
    pipe = client.pipeline(transaction=True)
    pipe.xdel(DEAD_LETTER_STREAM, entry_id)
    pipe.hdel(REQUEUED_KEY, entry_id)
    pipe.execute()


def _dump(raw: Any) -> str:
    try:
        return json.dumps(raw, ensure_ascii=True)
    except (TypeError, ValueError):
        return repr(raw)
