"""The Python API for sending tickets to ticketq workers and collecting their results.

`Producer` owns a minimal Celery app (JSON only) and a Redis client on the broker. It imports
no torch and nothing from `worker/`, only the shared contract (`ticketq`), so a web app can
embed it.

The message and ticket rules are `ticketq.contract`'s (the worker applies the same validator):
a ticket is checked here before anything is sent, `submit_many` also refuses a repeated id, and
each message goes to task `ticketq.names.TASK_CLASSIFY` on queue `settings.queue`, one ticket or a
packed list. `wait()` gives one dict per ticket: the worker's `Classified` or `Failed` result;
a failed task becomes `{"id", "task_id", "status": "failed", "error"}` for each of its tickets,
and a task with no result by the deadline `status: "timeout"`.

A Redis that goes away (a restart, a Sentinel failover) is asked again, sending and waiting alike,
for up to `retry_for_s` (RETRY_FOR_S by default): a bulk send then sends again the pipeline it was
flushing, under the same task ids. Past that, or when Redis refuses a send's writes (full),
`SendStopped` / `WaitStopped` say what was sent and what came back. `wait(resend_after=S)` sends
again what is plausibly lost, with a budget (`producer.resends`).

`submit_many(..., idempotent=True)` (what `ticketq-produce file` sends) derives each message's task
id from its queue and ticket ids, and does not send again a message that already has a result: a
re-sent ticket is a re-execution of the same task, which the worker publishes once.

The broker may be Redis Sentinel (`sentinel://h1:26379;sentinel://h2:26379` with
TICKETQ_SENTINEL_MASTER): every client here follows the master through a failover. With
TICKETQ_REPLICA_ACKS, a send returns once that many replicas hold it (WAIT), else raises
`NotReplicated`, which carries what was sent.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import kombu.exceptions
import redis
from celery import Celery, states
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, ResultSet
from tqdm import tqdm

from producer.resends import Resends, Whereabouts, next_send
from ticketq import codec, connections
from ticketq.config import ClientSettings, is_redis_url, is_sentinel_url, mask_url
from ticketq.connections import SOCKET_TIMEOUT_S, RedisUnavailable, connect, redis_client
from ticketq.contract import Failed, Reason, Status, TicketRejected, UniqueIds, validate_ticket
from ticketq.epoch import Epoch, whoami
from ticketq.names import RESULTS_STREAM, TASK_CLASSIFY, queue_lists
from ticketq.process import paused_gc

log = logging.getLogger(__name__)

Ticket = str | Mapping[str, object]
ResultCallback = Callable[[list[dict]], None]

_CONNECTION_ERRORS = (kombu.exceptions.OperationalError, redis.exceptions.RedisError, OSError)
# kombu >= 5.7's pipelined publish wraps what failed (its __cause__) in this
_BATCH_ERRORS = tuple(getattr(kombu.exceptions, name) for name in ("BatchPublishError",)
                      if hasattr(kombu.exceptions, name))  # fmt: skip
PUBLISH_BATCH = 500  # messages per Redis pipeline in submit_many (kombu >= 5.7's Producer.batch)
POLL_WINDOW = 200  # result keys read per MGET while waiting: the oldest pending, and a window rotating over the rest
POLL_PAUSE_S = (0.005, 0.1)  # pause between reads: the shortest after a read that found results, the longest
RECONNECT_PAUSE_S = (0.1, 2.0)  # while Redis is away: the first pause before asking again, the longest
# How long sending and waiting ask a Redis that went away again (a Sentinel promotion takes a few seconds)
RETRY_FOR_S = 30.0
# uuid5 namespace of idempotent task ids: the same (queue, tickets of the message) always names the same task
TASK_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://ticketq/task-id")


class BulkRedisBackend(RedisBackend):
    """Celery's Redis result backend, without a pub/sub subscription for every message sent.

    Celery subscribes to each task's result channel as it sends the task (`on_task_call`), and the
    subscriber must then read every PUBLISH and unsubscribe task by task: for a bulk send, most of
    the producer's time (py-spy: 47% waiting, 7% subscribing). `Producer.wait` reads result keys
    with MGET instead (`Producer._poll_ready`). `AsyncResult.get()` still works: Celery subscribes
    when it is called, then reads the key once.
    """

    stopped = False

    def on_task_call(self, producer: object, task_id: str) -> None:
        return None

    def stop_consumer(self) -> None:
        """Close the result pub/sub for good. Every AsyncResult unsubscribes in `__del__` (through
        `on_result_fulfilled`), reconnecting if needed; after close, and at interpreter exit, that
        would fail noisily: once stopped it does nothing."""
        self.stopped = True
        self.result_consumer.stop()

    def on_result_fulfilled(self, result: object) -> None:
        if not self.stopped:
            super().on_result_fulfilled(result)


class BulkSentinelBackend(BulkRedisBackend, SentinelBackend):
    """`BulkRedisBackend` on the master Redis Sentinel names (a sentinel:// result backend)."""


class BrokerUnavailable(RedisUnavailable):
    """Redis (broker or result backend) cannot be used; the message says where and what to do."""

    fix = "set TICKETQ_BROKER_URL (and TICKETQ_RESULT_BACKEND if results live elsewhere)"


class NotReplicated(BrokerUnavailable):
    """Redis took the send, but fewer replicas than TICKETQ_REPLICA_ACKS confirmed it in time.

    The messages are in the queue and will likely be classified, but a failover now could lose
    them. `results` are what was sent: wait on them with `resend_after` (a lost one is sent again
    under its task id, and a duplicate is published once), rather than submitting the tickets anew.
    """

    def __init__(self, url: str, results: list[TicketResult], acked: int, wanted: int, timeout_s: float) -> None:
        self.results, self.acked, self.wanted = results, acked, wanted
        tickets = sum(len(result.ticket_ids) for result in results)
        self._text = (
            f"Redis at {mask_url(url)} took {tickets} ticket(s), but only {acked} of {wanted} replica(s) "
            f"(TICKETQ_REPLICA_ACKS) confirmed them within {timeout_s:g} s: they are queued, and may or may not "
            "survive a failover. Check the replicas (INFO replication); wait for the results with resend_after "
            "(ticketq-produce --wait --resend-after S) instead of sending them again"
        )
        super().__init__(url, "not replicated")

    def _message(self, detail: str) -> str:
        return self._text


class SendStopped(BrokerUnavailable):
    """Redis stopped a bulk send: unreachable for longer than `retry_for_s`, or refusing its writes
    (full, too few replicas). `results` are the messages Redis took, `unconfirmed` those of the
    pipeline it failed, which it may or may not hold; the tickets after them were not sent. Sent
    again with the same task ids (idempotent sends), each is answered once. `str()` is the cause."""

    def __init__(self, error: BrokerUnavailable, results: list[TicketResult], unconfirmed: list[TicketResult]) -> None:
        ConnectionError.__init__(self, str(error))
        self.url, self.reason = error.url, error.reason
        self.refused, self.write_refused = error.refused, error.write_refused
        self.results, self.unconfirmed = results, unconfirmed


class WaitStopped(BrokerUnavailable):
    """Redis stayed unreachable for longer than `retry_for_s` while `wait` waited: `results` has a
    row for every ticket, as `wait` returns them (`status: "timeout"` for those without a result).
    `str()` is the cause."""

    def __init__(self, error: BrokerUnavailable, results: list[dict]) -> None:
        ConnectionError.__init__(self, str(error))
        self.url, self.reason = error.url, error.reason
        self.refused, self.write_refused = error.refused, error.write_refused
        self.results = results


class SendInterrupted(KeyboardInterrupt):
    """Ctrl-C during `submit_many`: `results` are the messages Redis took (their pipelines were
    flushed), `unconfirmed` the ones of the pipeline being flushed when it came, which Redis may or
    may not hold. Sent again with the same task ids (idempotent sends), they are classified and
    published once either way."""

    def __init__(self, results: list[TicketResult], unconfirmed: list[TicketResult]) -> None:
        super().__init__(f"interrupted after {len(results)} message(s) sent ({len(unconfirmed)} unconfirmed)")
        self.results, self.unconfirmed = results, unconfirmed


def idempotent_task_id(queue: str, ticket_ids: Sequence[str], packed: bool) -> str:
    """The task id of a message that carries `ticket_ids` to `queue`, the same on every run.

    A message sent again under it is a re-execution of the same task, which the worker publishes
    once per (task id, slot): so the same ticket, alone or in the same pack, is answered once.
    """
    return str(uuid.uuid5(TASK_ID_NAMESPACE, json.dumps([queue, packed, list(ticket_ids)])))


class TicketResult(AsyncResult):
    """The `AsyncResult` of one message, remembering which tickets it carried."""

    ticket_ids: tuple[str, ...] = ()
    packed: bool = False
    message_args: tuple = ()  # what was sent, so `wait(resend_after=...)` can send it again
    sent_seq: int | None = None  # `producer.resends.next_send()` of its latest send; None: sent by an earlier run
    sent_before: bool = False  # an idempotent send found it sent (or answered) already, and did not send it


class Producer:
    """Sends tickets to the classify task and collects per-ticket results.

    Build it from `ClientSettings` (read from `TICKETQ_*` by default; a worker's `Settings` will
    do too) or override the URLs:
    `Producer(broker_url="redis://:secret@redis:6379/0")`. The first send checks the broker once
    and raises `BrokerUnavailable` within about `connect_timeout_s` instead of retrying; once
    sending or waiting has begun, a Redis that went away is asked again for up to `retry_for_s`.
    """

    def __init__(
        self,
        settings: ClientSettings | None = None,
        *,
        broker_url: str | None = None,
        backend_url: str | None = None,
        connect_timeout_s: float = 3.0,
        retry_for_s: float = RETRY_FOR_S,
    ) -> None:
        settings = settings if settings is not None else ClientSettings()
        # Checked as TICKETQ_BROKER_URL is: SettingsError (a ValueError), one line per problem.
        self.settings = settings.with_overrides(broker_url=broker_url or None, result_backend=backend_url or None)
        if retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0 seconds, got {retry_for_s!r}")
        self.connect_timeout_s, self.retry_for_s = connect_timeout_s, retry_for_s
        self.app = _make_app(self.settings, connect_timeout_s)
        self._result_cls = self.app.subclass_with_self(TicketResult)
        self._redis: redis.Redis | None = None
        self._checked = False
        self.epoch = Epoch(whoami("producer"))  # notices a Redis that came back without its data

    # --- lifecycle ---

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release this producer's connections (a later call opens new ones)."""
        if self._redis is not None:
            connections.close(self._redis)
            self._redis = None
        if isinstance(self.app.backend, BulkRedisBackend):
            self.app.backend.stop_consumer()
        self.app.close()

    @property
    def redis(self) -> redis.Redis:
        """A redis-py client on the broker (queue depth, results stream)."""
        if self._redis is None:
            timeouts = {"connect_timeout_s": self.connect_timeout_s,
                        "socket_timeout_s": max(self.connect_timeout_s, SOCKET_TIMEOUT_S)}  # fmt: skip
            self._redis = redis_client(self.settings.broker_url, **self.settings.sentinel, **timeouts)
        return self._redis

    def check_connection(self) -> None:
        """PING the broker and the Redis result backend once; raise `BrokerUnavailable` if down."""
        for url in dict.fromkeys((self.settings.broker_url, self.settings.backend_url)):
            if not is_redis_url(url):
                continue  # other transports (memory://, tests) have nothing to ping
            client = connect(url, **self.settings.sentinel, connect_timeout_s=self.connect_timeout_s,
                             error=BrokerUnavailable)  # fmt: skip
            connections.close(client)
        self._checked = True

    # --- sending ---

    def validate(self, text: object, id: object = None) -> tuple[str, str]:
        """Check one ticket at the edge with the contract's rule; `(id, text)`, a missing id assigned.

        Raises `TicketRejected` (a `ValueError`; `.reason` says why), or `TypeError` for a text or
        id of the wrong type. An integer id comes back as its decimal string.
        """
        return self._validate({"id": id, "text": text})[:2]

    def _validate(self, raw: Mapping[str, object], schema: str | None = None) -> tuple[str, str, str | None]:
        """(id, text, schema): the ticket's own `schema`, else `schema`."""
        if schema is not None and raw.get("schema") is None:
            raw = {**raw, "schema": schema}
        try:
            ticket = validate_ticket(raw, self.settings.max_ticket_bytes)
        except TicketRejected as exc:
            if exc.reason == Reason.WRONG_TYPE:
                raise TypeError(str(exc)) from None  # what Python callers expect for a wrong type
            raise
        return ticket.id or uuid.uuid4().hex, ticket.text, ticket.schema

    def submit(self, text: str, id: str | int | None = None, idempotent: bool = False,
               schema: str | None = None) -> TicketResult:  # fmt: skip
        """Send one ticket as its own message; returns its Celery `AsyncResult` (`NotReplicated`
        with it when TICKETQ_REPLICA_ACKS replicas did not confirm it).

        `idempotent=True` (with an `id`): the task id comes from (queue, id), and a ticket that
        already has a result is not sent again; its result is returned as the first time.
        `schema`: the name of the schema (fields) the worker answers it with (default: the worker's first).
        """
        ticket = self._validate({"id": id, "text": text}, schema)
        if idempotent:
            return self.submit_many([{"id": ticket[0], "text": ticket[1]}], idempotent=True, schema=schema)[0]
        result = self._send([ticket], packed=False)
        self._confirm_replicas([result])
        return result

    def submit_many(
        self,
        tickets: Iterable[Ticket],
        pack: int = 1,
        progress: bool = False,
        idempotent: bool = False,
        already_sent: Iterable[str] = (),
        schema: str | None = None,
    ) -> list[TicketResult]:
        """Send tickets (strings or `{"id"?, "text", "schema"?}` mappings), `pack` per message;
        `schema` names the schema of those that name none (default: the worker's first).

        Every ticket is validated before the first is sent, so one bad ticket (or an id given
        twice in `tickets`) sends nothing. With TICKETQ_REPLICA_ACKS, one WAIT after the last send
        covers them all.

        `idempotent=True`: each message's task id comes from (queue, its ticket ids), see
        `idempotent_task_id`, and a message whose task already has a result in the backend is not
        sent again (it is in the returned list, and `wait` reads its result at once), nor is one
        whose task id is in `already_sent` (the task ids an interrupted run reported as sent).
        Tickets without an id get a random one, so only tickets with ids are idempotent.
        Ctrl-C raises `SendInterrupted`, which says what was sent.
        """
        if not isinstance(pack, int) or pack < 1:
            raise ValueError(f"pack must be an integer >= 1, got {pack!r}")
        checked, problems, ids = [], [], UniqueIds()
        for index, ticket in enumerate(tickets):
            try:
                valid = self._validate(_as_mapping(ticket), schema)
                ids.add(valid[0], f"at #{index}")
                checked.append(valid)
            except (ValueError, TypeError) as exc:
                problems.append(f"#{index}: {exc}")
        if problems:
            shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
            raise ValueError(f"{len(problems)} of {len(checked) + len(problems)} tickets are invalid, none sent: "
                             f"{shown}")

        if not self._checked:
            self.check_connection()
        packed = pack > 1
        chunks = [checked[start : start + pack] for start in range(0, len(checked), pack)]
        if not idempotent:
            results = self._send_chunks(chunks, [None] * len(chunks), packed, progress)
            self._confirm_replicas(results)
            return results
        task_ids = [idempotent_task_id(self.settings.queue, [i for i, *_ in chunk], packed) for chunk in chunks]
        skipped = self._answered(task_ids) | (set(already_sent) & set(task_ids))
        if skipped:
            log.info("%d message(s) were sent before: not sent again", len(skipped))
        todo = [index for index, task_id in enumerate(task_ids) if task_id not in skipped]
        before = [self._result_of(task_ids[i], chunks[i], packed) for i in range(len(chunks)) if task_ids[i] in skipped]
        try:
            sent = self._send_chunks([chunks[i] for i in todo], [task_ids[i] for i in todo], packed, progress)
        except (SendInterrupted, SendStopped) as stop:
            stop.results[:0] = before  # what an earlier run sent is sent too
            raise
        self._confirm_replicas(sent)
        by_id = {result.id: result for result in (*before, *sent)}
        return [by_id[task_id] for task_id in task_ids]

    def _send_chunks(self, chunks: list, task_ids: list, packed: bool, progress: bool) -> list[TicketResult]:
        """Publish `chunks` one message each, PUBLISH_BATCH per Redis pipeline.

        A pipeline per block of PUBLISH_BATCH, each flushed before the next starts, so what Redis
        took is known exactly when the run stops part way: Ctrl-C (`SendInterrupted`), or Redis
        lost for longer than `retry_for_s` or refusing the writes (`SendStopped`). A block whose
        pipeline failed on a lost connection is sent again whole once Redis answers, under the
        same task ids (fixed here, before the first try): at worst a duplicate, published once.
        """
        task_ids = [task_id or str(uuid.uuid4()) for task_id in task_ids]
        results: list[TicketResult] = []
        with tqdm(total=sum(map(len, chunks)), unit="ticket", desc="enqueue", disable=not progress) as bar:
            for first in range(0, len(chunks), PUBLISH_BATCH):
                block = range(first, min(first + PUBLISH_BATCH, len(chunks)))
                results += self._send_block([chunks[i] for i in block], [task_ids[i] for i in block], packed, results)
                bar.update(sum(len(chunks[index]) for index in block))
        return results

    def _send_block(self, chunks: list, task_ids: list[str], packed: bool, before: list[TicketResult]
                    ) -> list[TicketResult]:  # fmt: skip
        """One pipeline of messages, tried again through an outage (`_Outage`, up to `retry_for_s`);
        `before`: what the run sent so far, for the exceptions that say so."""
        outage = _Outage("sending", None, self.retry_for_s, refusals=False)
        maybe: list[TicketResult] = []  # the most of the block any try handed to Redis
        try:
            while True:
                attempted: list[TicketResult] = []
                try:
                    with self._acquire_producer() as kombu_producer, _publish_batch(kombu_producer):
                        for chunk, task_id in zip(chunks, task_ids, strict=True):
                            attempted.append(self._send(chunk, packed, kombu_producer, task_id))
                            maybe = max(maybe, attempted, key=len)
                    outage.over()
                    return attempted
                except (*_CONNECTION_ERRORS, *_BATCH_ERRORS) as exc:  # a pipeline flushed at the end of the block
                    self._checked = False
                    if len(attempted) < len(chunks):  # the message whose publish met the error flushed the pipeline
                        at = len(attempted)
                        maybe = max(maybe, [*attempted, self._result_of(task_ids[at], chunks[at], packed)], key=len)
                    error = self._unreachable(exc, sent=len(before))
                    if not outage.ride_out(error, raises=False):
                        raise SendStopped(error, before, maybe) from None
        except KeyboardInterrupt:
            raise SendInterrupted(before, maybe) from None

    def _answered(self, task_ids: Sequence[str]) -> set[str]:
        """The task ids among `task_ids` that have a finished result in the Redis result backend."""
        backend = self.app.backend
        if not isinstance(backend, BulkRedisBackend) or not task_ids:
            return set()
        answered = set()
        try:
            for first in range(0, len(task_ids), 10 * POLL_WINDOW):
                window = task_ids[first : first + 10 * POLL_WINDOW]
                raws = backend.mget([backend.get_key_for_task(task_id) for task_id in window])
                for task_id, raw in zip(window, raws, strict=True):
                    if raw is not None and backend.decode_result(raw)["status"] in states.READY_STATES:
                        answered.add(task_id)
        except _CONNECTION_ERRORS as exc:
            raise self._unreachable(exc) from None
        return answered

    def _result_of(self, task_id: str, chunk: Sequence[tuple[str, str, str | None]], packed: bool) -> TicketResult:
        """The result of a message sent before (under `task_id`), as if this producer had just sent it."""
        result = self._result_cls(task_id)
        payload = [_payload(ticket) for ticket in chunk]
        result.ticket_ids, result.packed = tuple(ticket_id for ticket_id, *_ in chunk), packed
        result.message_args = (payload if packed else payload[0],)
        result.sent_before = True
        return result

    def _confirm_replicas(self, results: list[TicketResult]) -> None:
        """With TICKETQ_REPLICA_ACKS: `NotReplicated` unless that many replicas hold every send so far.

        WAIT counts the replicas that hold the writes the master had taken when it ran (see
        `ticketq.connections.confirm_replicas`): one call covers every message sent before it.
        """
        wanted = self.settings.replica_acks
        if not wanted or not results or not is_redis_url(self.settings.broker_url):
            return
        try:
            acked = connections.replicated(self.redis, wanted, self.settings.replica_timeout_s)
        except (redis.exceptions.RedisError, OSError) as exc:  # sent, then the broker went away
            acked = 0
            log.warning("could not ask Redis how many replicas hold the sent tickets (%s)", exc)
        if acked < wanted:
            raise NotReplicated(self.settings.broker_url, results, acked, wanted, self.settings.replica_timeout_s)

    def _acquire_producer(self):
        try:
            return self.app.producer_or_acquire()
        except _CONNECTION_ERRORS as exc:
            self._checked = False
            raise self._unreachable(exc) from None

    def _send(
        self, tickets: Sequence[tuple[str, str, str | None]], packed: bool, producer: object = None,
        task_id: str | None = None,
    ) -> TicketResult:
        """Publish one message. `submitted_at` (the send time, for the queue-wait figures) is left
        out of the worker's comparison of an idempotent message (`task_id` given) sent again: the
        same tickets under the same id are one message, other tickets under it another message
        reusing the id (answered `duplicate_task_id`)."""
        if not self._checked:
            self.check_connection()
        now = time.time()
        payload = [{**_payload(ticket), "submitted_at": now} for ticket in tickets]
        ticket_ids = tuple(ticket_id for ticket_id, *_ in tickets)
        args = (payload if packed else payload[0],)
        return self._publish(task_id or str(uuid.uuid4()), args, ticket_ids, packed, producer)

    def _publish(
        self, task_id: str, args: tuple, ticket_ids: tuple[str, ...], packed: bool, producer: object = None
    ) -> TicketResult:
        try:
            result = self.app.send_task(
                TASK_CLASSIFY,
                args=list(args),
                queue=self.settings.queue,
                task_id=task_id,
                result_cls=self._result_cls,
                # Celery copies repr(args) into the message headers, where logs and Flower show it;
                # tickets carry customer text, so the headers name the ticket ids only.
                argsrepr=_argsrepr(list(ticket_ids), packed),
                producer=producer,  # None: Celery acquires one from its pool for this message
            )
        except (*_CONNECTION_ERRORS, RuntimeError) as exc:
            self._checked = False
            raise self._unreachable(exc) from None
        result.ticket_ids, result.packed, result.message_args = ticket_ids, packed, args
        result.sent_seq = next_send()
        return result

    def resend(self, result: TicketResult) -> TicketResult:
        """Send a message again with its original task id; the worker publishes each ticket once.

        For a message that may have been lost after it was sent (a worker or Redis that lost it);
        when both copies arrive, the second is classified and recognised as a duplicate.
        """
        if not result.message_args:
            raise ValueError(f"task {result.id} was not sent by this producer: nothing to resend")
        again = self._publish(result.id, result.message_args, result.ticket_ids, result.packed)
        self._confirm_replicas([again])
        return again

    def _unreachable(self, exc: BaseException, sent: int | None = None) -> BaseException:
        """Name the Redis that failed and why (not reachable, credentials, a refused write);
        give back any other error unchanged. `sent`: messages of a bulk send before the failure."""
        if isinstance(exc, BrokerUnavailable):
            return exc  # said already (a check of the connection before a send)
        if isinstance(exc, RuntimeError):
            # The result backend's pub/sub gave up reconnecting; Celery wraps the connection error.
            if isinstance(exc.__cause__, _CONNECTION_ERRORS):
                return BrokerUnavailable(self.settings.backend_url, exc.__cause__)
            return exc
        if isinstance(exc, _BATCH_ERRORS) and exc.__cause__ is not None:
            exc = exc.__cause__  # what the pipeline met; some of its messages may be queued
        note = f"the {sent} message(s) sent before it may be queued" if sent else ""
        return BrokerUnavailable(self.settings.broker_url, exc, self._memory_detail(exc), note=note)

    def _memory_detail(self, exc: BaseException) -> str:
        """The server's maxmemory and policy, for an out-of-memory refusal; "" if not one, or unknown."""
        if connections.write_refusal(exc) != connections.OUT_OF_MEMORY:
            return ""
        try:
            return connections.describe_memory(connections.memory_state(self.redis))
        except (redis.exceptions.RedisError, OSError):
            return ""

    # --- collecting ---

    def wait(
        self,
        results: Sequence[AsyncResult],
        timeout: float | None = None,
        progress: bool = False,
        on_result: ResultCallback | None = None,
        resend_after: float | None = None,
    ) -> list[dict]:
        """Per-ticket result dicts for `results`, in submission order.

        Blocks until every task is done or `timeout` seconds pass overall; unfinished tickets come
        back as `status: "timeout"`. `on_result` gets each task's ticket dicts as they arrive.
        A Redis that goes away meanwhile (a restart, a failover) is asked again, pausing 0.1 s
        doubling up to 2 s, for up to `retry_for_s` (within the timeout); results stored meanwhile
        are read once it is back. Past `retry_for_s` it raises `WaitStopped` with every row;
        refused credentials raise `BrokerUnavailable` at once.
        With `resend_after`, a message still without a result after that many seconds is sent
        again with the same task id when it is plausibly lost (not queued, not fetched by a
        worker), with backoff per message and a budget per period tied to the answer rate; the
        rule, its cost per period and the bound on a lost message are in `producer.resends`.
        """
        if resend_after is not None and resend_after <= 0:
            raise ValueError(f"resend_after must be > 0 seconds, got {resend_after!r}")
        by_task: dict[str, list[dict]] = {}
        sent = {result.id: result for result in results}
        total = sum(len(_ticket_ids(result)) or 1 for result in results)
        deadline = None if timeout is None else time.monotonic() + timeout
        outage = _Outage("waiting for results", deadline, self.retry_for_s)
        resends = _resends_for(results, resend_after)
        with tqdm(total=total, unit="ticket", desc="results", disable=not progress) as bar, paused_gc():
            try:
                while len(by_task) < len(sent):
                    pending = [result for result in results if result.id not in by_task]
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    periods = [p for p in (remaining, resends and resends.period) if p is not None]
                    try:
                        for task_id, state, value in self._iter_ready(pending, min(periods) if periods else None):
                            outage.over()
                            tickets = ticket_results(sent[task_id], state, value)
                            by_task[task_id] = tickets
                            if resends is not None:
                                resends.answered(task_id)
                            bar.update(len(tickets))
                            if on_result is not None:
                                on_result(tickets)
                            if len(by_task) == len(sent):
                                # ResultSet can miss that it is complete when some results arrived
                                # over pub/sub during an earlier wait; stop once every task is in.
                                break
                        outage.over()
                    except CeleryTimeoutError:
                        outage.over()  # what is missing is re-sent below, or reported as a timeout
                        if resends is None:
                            break
                    except (*_CONNECTION_ERRORS, RuntimeError) as exc:
                        if not outage.ride_out(self._unreachable(exc)):
                            break
                        continue
                    if resends is None or len(by_task) == len(sent):
                        break
                    try:
                        self._resend_lost(resends, sent)
                    except (*_CONNECTION_ERRORS, RuntimeError) as exc:
                        if not outage.ride_out(self._unreachable(exc)):
                            break
            finally:
                self._unsubscribe(result for result in results if result.id not in by_task)
        collected = _in_order(results, by_task, timeout)
        if outage.gave_up is not None:
            raise WaitStopped(outage.gave_up, collected)
        return collected

    def ready_now(self, results: Sequence[AsyncResult]) -> list[dict]:
        """Per-ticket result dicts of those of `results` that are finished now: one pass of MGETs,
        no waiting (what a wait stopped by Ctrl-C had not read yet). On a Redis backend only; what
        cannot be read (Redis away) is simply not there."""
        backend = self.app.backend
        if not isinstance(backend, BulkRedisBackend) or not results:
            return []
        sent = {result.id: result for result in results}
        task_ids = list(sent)
        keys = {task_id: backend.get_key_for_task(task_id) for task_id in task_ids}
        rows: list[dict] = []
        try:
            for first in range(0, len(task_ids), 10 * POLL_WINDOW):
                for task_id, state, value in self._read_ready(task_ids[first : first + 10 * POLL_WINDOW], keys):
                    rows.extend(ticket_results(sent[task_id], state, value))
        except _CONNECTION_ERRORS as exc:
            log.debug("could not read the results ready now: %s", exc)
        return rows

    def _resend_lost(self, resends: Resends, sent: Mapping[str, AsyncResult]) -> None:
        """Send again the due messages that are plausibly lost, within the period's budget (see
        `producer.resends`): where the messages are, read at one instant, then their results read
        again, so one answered since is not taken for lost."""
        allowed, now = resends.budget(), time.monotonic()
        self._notice_data_loss(resends, now)
        due = resends.due(now)
        if not due:
            return
        lost = resends.lost(due, Whereabouts.read(self.redis, self.settings.queue, resends.sends()))
        answered = self._answered(lost[:allowed])
        chosen = [task_id for task_id in lost[:allowed] if task_id not in answered]
        if not chosen:
            return
        again: list[TicketResult] = []
        with self._acquire_producer() as kombu_producer, _publish_batch(kombu_producer):
            for task_id in chosen:
                result = sent[task_id]
                # No replica check here: the wait goes on, and sends again what still has no result.
                again.append(self._publish(task_id, result.message_args, result.ticket_ids, result.packed,
                                           kombu_producer))  # fmt: skip
        for result in again:
            resends.resent(result.id, result.sent_seq or 0, now)
        waiting = len(lost) - len(answered) - len(chosen)
        log.warning("re-sent %d message(s) found lost (no result, not queued, not fetched by a worker; same task "
                    "ids)%s", len(chosen), f"; {waiting} more wait for the re-send budget" if waiting > 0 else "")

    def _notice_data_loss(self, resends: Resends, now: float) -> None:
        """A Redis that came back without its data (`ticketq.epoch`) lost every message waited for:
        said once, and each is due at once (past its backoff; the budget still paces them)."""
        try:
            loss = self.epoch.check(self.redis)
        except _CONNECTION_ERRORS as exc:
            log.debug("epoch marker not checked (%s)", exc)
            return
        if loss is not None:
            waiting = resends.all_due(now)
            log.warning("Redis lost its data (restarted without persistence, or flushed): the %d message(s) still "
                        "waited for are re-sent under their task ids", waiting)  # fmt: skip

    def _unsubscribe(self, results: Iterable[AsyncResult]) -> None:
        """Stop listening for results we gave up on (a later `wait` subscribes again).

        Otherwise `AsyncResult.__del__` unsubscribes at interpreter exit, over a dead connection.
        """
        if not self.app.backend.supports_native_join or isinstance(self.app.backend, BulkRedisBackend):
            return
        try:
            for result in results:
                self.app.backend.remove_pending_result(result)
        except (*_CONNECTION_ERRORS, RuntimeError) as exc:  # best effort: the connection is gone anyway
            log.debug("could not unsubscribe from pending results: %s", exc)

    def _iter_ready(
        self, results: Sequence[AsyncResult], timeout: float | None
    ) -> Iterator[tuple[str, str, object]]:
        """`(task_id, state, result_or_exception)` for each task as it finishes."""
        if not results:
            return
        if isinstance(self.app.backend, BulkRedisBackend):
            yield from self._poll_ready(results, timeout)
            return
        if self.app.backend.supports_native_join:
            # Redis: results arrive over pub/sub as they are stored, in completion order.
            for task_id, meta in ResultSet(list(results), app=self.app).iter_native(timeout=timeout):
                yield task_id, meta["status"], meta["result"]
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for result in results:  # other backends: Celery polls each result in turn
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            value = result.get(timeout=remaining, propagate=False)
            yield result.id, result.state, value

    def _poll_ready(self, results: Sequence[AsyncResult], timeout: float | None) -> Iterator[tuple[str, str, object]]:
        """`_iter_ready` on a Redis backend: MGET the oldest POLL_WINDOW pending result keys, again
        at once while results come, pausing (5 ms, doubling up to 100 ms) while none does. Results
        mostly finish in send order, so the oldest window finds most of them in one read. When it
        finds none (its messages are slow, or lost), the same read also takes the next window of
        one that rotates over the other pending keys: every result behind a head that never comes
        is found, in one pass over the pending per POLL_WINDOW of them."""
        backend = self.app.backend
        keys = {result.id: backend.get_key_for_task(result.id) for result in results}
        pending = list(keys)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = POLL_PAUSE_S[0]
        cursor = POLL_WINDOW  # where the rotating window starts, in `pending`
        rotate = False  # the last read of the oldest window found nothing
        while pending:
            if cursor >= len(pending):
                cursor = POLL_WINDOW
            window = pending[:POLL_WINDOW]
            if rotate:
                window += pending[cursor : cursor + POLL_WINDOW]
                cursor += POLL_WINDOW
            ready = self._read_ready(window, keys)
            yield from ready
            done = {task_id for task_id, _, _ in ready}
            rotate = not any(task_id in done for task_id in window[:POLL_WINDOW])
            if done:
                head = sum(task_id in done for task_id in pending[:cursor])
                pending = [task_id for task_id in pending if task_id not in done]
                cursor -= head  # the rotating window keeps its place among the pending that remain
                pause = POLL_PAUSE_S[0]
            else:
                pause = min(2 * pause, POLL_PAUSE_S[1])
            if not pending:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise CeleryTimeoutError(f"{len(pending)} results not ready within {timeout:g} s")
            time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))

    def _read_ready(self, window: list[str], keys: Mapping[str, str]) -> list[tuple[str, str, object]]:
        """`(task_id, state, result)` of the finished tasks among `window`: one MGET."""
        backend = self.app.backend
        ready = []
        for task_id, raw in zip(window, backend.mget([keys[task_id] for task_id in window]), strict=True):
            if raw is not None:
                meta = backend.decode_result(raw)
                if meta["status"] in states.READY_STATES:
                    ready.append((task_id, meta["status"], meta["result"]))
        return ready

    # --- observing ---

    def results_stream(self, since_id: str = "0", follow: bool = False) -> Iterator[tuple[str, dict]]:
        """`(entry_id, result)` from the results stream on the broker's Redis, after `since_id`.

        Stops at the end of the stream, or with `follow=True` waits for new entries forever (the
        caller breaks out). Resume later by passing the last `entry_id` as `since_id`.
        """
        last = since_id
        while True:
            try:
                # Block in short reads: each must finish well inside the client's socket timeout.
                reply = self.redis.xread({RESULTS_STREAM: last}, count=500, block=1000 if follow else None)
            except (redis.exceptions.RedisError, OSError) as exc:
                raise BrokerUnavailable(self.settings.broker_url, exc) from None
            if not reply:
                if not follow:
                    return
                continue
            for raw_id, fields in reply[0][1]:
                last = raw_id.decode()
                try:
                    yield last, codec.loads(fields[b"data"])
                except (KeyError, ValueError):
                    log.warning("skipping results stream entry %s without a JSON 'data' field", last)

    def queue_depth(self) -> int:
        """Messages waiting in the queue (not yet taken by a worker), over kombu's priority lists."""
        keys = queue_lists(self.settings.queue)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.llen(key)
            return sum(pipe.execute())
        except (redis.exceptions.RedisError, OSError) as exc:
            raise BrokerUnavailable(self.settings.broker_url, exc) from None


class _Outage:
    """While Redis cannot be reached (sending, or waiting for results): how long to pause before
    asking again, until the wait's `deadline` or `limit_s` into the outage, whichever comes first."""

    def __init__(self, doing: str, deadline: float | None, limit_s: float, refusals: bool = True) -> None:
        """`refusals`: a Redis refusing writes (full, too few replicas) is waited out too."""
        self.doing, self.deadline, self.limit_s, self.refusals = doing, deadline, limit_s, refusals
        self.pause, self.since = RECONNECT_PAUSE_S[0], None
        self.gave_up: BrokerUnavailable | None = None  # the error, once `limit_s` passed

    def ride_out(self, error: BaseException, raises: bool = True) -> bool:
        """Pause before the next try: True. False when the deadline or the limit leaves no time
        for one (`gave_up` is set past the limit), or when asking again cannot help (refused
        credentials; a refused write when `refusals` is off), which raises `error` at once unless
        `raises` is off."""
        if not _is_lost_connection(error) or (not self.refusals and error.write_refused):
            if raises:
                raise error
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("lost Redis while %s (%s); trying again for up to %g s", self.doing,
                        getattr(error, "reason", error), self.limit_s)  # fmt: skip
        ends = [self.since + self.limit_s] + ([self.deadline] if self.deadline is not None else [])
        if now >= min(ends):
            if now >= self.since + self.limit_s:
                self.gave_up = error
            return False
        time.sleep(min(self.pause, min(ends) - now))
        self.pause = min(2 * self.pause, RECONNECT_PAUSE_S[1])
        return True

    def over(self) -> None:
        if self.since is not None:
            log.warning("Redis is back after %.1f s; %s again", time.monotonic() - self.since, self.doing)
            self.since, self.pause = None, RECONNECT_PAUSE_S[0]


def _is_lost_connection(error: BaseException) -> bool:
    """Worth asking again: Redis went away (a restart, a failover) or refuses writes for now (full,
    too few replicas), as the worker's outbox rides them out; refused credentials are not."""
    return isinstance(error, BrokerUnavailable) and not error.refused


def _make_app(settings: ClientSettings, connect_timeout_s: float) -> Celery:
    """A Celery app that can only publish JSON and read JSON results, and gives up quickly."""
    backend = settings.backend_url
    if is_redis_url(backend):  # Celery's `class+url` form: see BulkRedisBackend
        bulk = "BulkSentinelBackend" if is_sentinel_url(backend) else "BulkRedisBackend"
        backend = f"{__name__}:{bulk}+{backend}"
    codec.install()  # results (packed: a hundred objects each) decoded in C
    app = Celery("ticketq-producer", broker=settings.broker_url, backend=backend, set_as_current=False)
    few_retries = {"max_retries": 1, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5}
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_default_queue=settings.queue,
        result_expires=settings.result_expires_s,
        # A producer is not a worker: a dead broker is an error to report, not a reason to wait.
        broker_connection_retry_on_startup=False,
        broker_connection_retry=False,
        broker_connection_max_retries=1,
        broker_connection_timeout=connect_timeout_s,
        task_publish_retry_policy=few_retries,
        broker_transport_options={
            "socket_connect_timeout": connect_timeout_s,
            # Must match the worker's: Redis redelivers unacked messages after this.
            "visibility_timeout": settings.visibility_timeout_s,
            **connections.transport_options(settings.broker_url, **settings.sentinel),  # the master's name
        },
        redis_socket_connect_timeout=connect_timeout_s,
        result_backend_transport_options={
            "retry_policy": few_retries, **connections.transport_options(settings.backend_url, **settings.sentinel)
        },
    )
    return app


def _resends_for(results: Sequence[AsyncResult], resend_after: float | None) -> Resends | None:
    """The re-send plan of a wait: every message this producer can send again (None without `resend_after`)."""
    if resend_after is None:
        return None
    messages = [(result.id, getattr(result, "sent_seq", None)) for result in results
                if getattr(result, "message_args", ())]  # fmt: skip
    return Resends(messages, resend_after, time.monotonic())


def _in_order(results: Sequence[AsyncResult], by_task: Mapping[str, list[dict]], timeout: float | None) -> list[dict]:
    """Every ticket's row in submission order; `status: "timeout"` for a task without a result."""
    collected = []
    for result in results:
        if result.id in by_task:
            collected.extend(by_task[result.id])
        else:
            error = f"no result within {timeout:g} s" if timeout is not None else "no result"
            collected.extend(_failed(result.id, _ticket_ids(result) or [None], error, status="timeout"))
    return collected


def ticket_results(result: AsyncResult, state: str, value: object) -> list[dict]:
    """Expand one finished message into per-ticket dicts (see the module docstring).

    `value` is the task's return value, or its exception when `state` is not SUCCESS.
    """
    ids = _ticket_ids(result)
    if state != states.SUCCESS:
        # A message this producer did not send has no known ticket ids: report it once.
        rows = _failed(result.id, ids or [None], str(value) or state)
        reason = getattr(value, "reason", None)  # a worker's TicketRejected, rebuilt by Celery
        if isinstance(reason, str) and reason in Reason._value2member_map_:
            for row in rows:
                row["reason"] = reason
        return rows
    packed = getattr(result, "packed", isinstance(value, list))
    rows = value if packed else [value]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        return _failed(result.id, ids or [None], f"worker returned an unexpected result: {value!r:.200}")
    rows = [{**row, "task_id": row.get("task_id") or result.id} for row in rows]
    returned = {row.get("id") for row in rows}
    missing = [ticket_id for ticket_id in ids if ticket_id not in returned]
    return rows + _failed(result.id, missing, "worker returned no result for this ticket")


def _argsrepr(ticket_ids: list[str], packed: bool, shown: int = 5) -> str:
    if not packed:
        return f"[<ticket {ticket_ids[0]}>]"
    more = ", ..." if len(ticket_ids) > shown else ""
    return f"[<{len(ticket_ids)} tickets: {', '.join(ticket_ids[:shown])}{more}>]"


def _ticket_ids(result: AsyncResult) -> tuple[str, ...]:
    return getattr(result, "ticket_ids", ())


def _payload(ticket: tuple[str, str, str | None]) -> dict[str, object]:
    """A checked (id, text, schema) as the ticket a message carries (no `schema` key when it names none)."""
    ticket_id, text, schema = ticket
    return {"id": ticket_id, "text": text} if schema is None else {"id": ticket_id, "text": text, "schema": schema}


def _as_mapping(ticket: Ticket) -> Mapping[str, object]:
    if isinstance(ticket, str):
        return {"text": ticket}
    if not isinstance(ticket, Mapping):
        raise TypeError(f"a ticket must be a str or a mapping with 'text', got {type(ticket).__name__}")
    return ticket


def _failed(task_id: str, ticket_ids: Iterable[str | None], error: str, status: Status = "failed") -> list[Failed]:
    return [{"id": ticket_id, "task_id": task_id, "status": status, "error": error} for ticket_id in ticket_ids]


def _publish_batch(producer: object) -> AbstractContextManager:
    """kombu >= 5.7 buffers a `batch()` block's publishes in Redis pipelines, flushed every
    `max_size` messages and at the block's end (a block that raises discards what is not flushed
    yet). Older kombu, or a transport that cannot batch, publishes each message at once."""
    batch = getattr(producer, "batch", None)
    return batch(max_size=PUBLISH_BATCH) if batch is not None else nullcontext()
