"""The atomic fetch: kombu's Redis transport whose fetch never leaves a message nowhere.

Stock kombu pops a message (BRPOP) and records it as unacked in a second step; a worker killed
in between loses the message (celery/kombu#305, celery#7950). Here one Redis command moves the
message from the queue list into this consumer's own `fetching` list (BLMOVE, as Sidekiq's
reliable fetch and RQ do), and one script call moves it from there into kombu's unacked record
(`worker.transport.state`: every change to the fetch and lease state is one command of
worker_state.lua). A crash at any instant leaves the message in the queue, in a fetching list or
in the unacked record, never nowhere. A fetch takes up to 64 messages (within the prefetch window)
in two round trips, and acks are written once per event-loop turn (`worker.transport.qos`). Each
consuming channel holds a lease (`worker.transport.lease`).

Nothing waits in a fetching list without an owner that is fetching: a fetch whose reply never came
(kombu drops a stale connection and the channel fetches again under the same consumer) or whose
record Redis refused is delivered from the list before the next fetch; a record claims only what
is still in the list (another worker may have recovered it). Every command has a socket timeout
(COMMAND_TIMEOUT_S), and every turn of the event loop that finds no fetch reply overdue marks the
fetching loop's progress (`ticketq_health.fetching`): a loop stuck on Redis stops renewing
the lease and answers 503 on /readyz. Producers and plain Celery clients are unchanged: same queue list,
same message format. Keys: ticketq.names (FETCHING_KEY, OWNED_KEY, ALIVE_KEY, CONSUMERS_KEY), each
listed with its meaning in worker.redis.keys.

`SentinelTransport` is the same on a master that Redis Sentinel names (sentinel:// URLs): kombu's
SentinelChannel builds the pools, so every connection asks the sentinels where the master is.
A master that vanished, answers READONLY or cuts the blocked fetch (UNBLOCKED: demoted in a
failover) is a lost connection here, on any URL: Celery reconnects and the channel finds the
master anew, instead of stopping the worker.

A Redis that refuses writes (full under noeviction, too few replicas for min-replicas-to-write)
pauses fetching: a refused fetch or record leaves its messages in the queue or in this consumer's
fetching list, where they are recorded and delivered once Redis takes writes again; acks are a
script of deletions, which a full Redis still runs. Each refusal is an episode of worker.health.refusals.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty
from typing import Any

import kombu
import redis
from celery.app.amqp import AMQP as CeleryAMQP
from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from ticketq import codec, connections
from ticketq.contract import Reason
from ticketq.dead_letters import raw_entry
from ticketq.errors import TicketqError
from ticketq.lua import script
from ticketq.names import DEAD_LETTER_STREAM, FETCHING_KEY, OWNED_KEY
from worker.health import FETCH_STALL_S, Health
from worker.transport.guards import REDIS_MIN, IncompatibleLibrary
from worker.transport.lease import Lease, LeaseHolder
from worker.transport.qos import QoS
from worker.transport.recovery import Recovery
from worker.transport.state import PushRecorder

log = logging.getLogger(__name__)

FETCH_MORE = script(__package__, "fetch_more")  # beside this module: fetch_more.lua
REFUSED_PAUSE_S = 1.0  # after a refused write, fetching waits this long before it tries again
# Every command on a worker connection answers within this, or the connection counts as lost (kombu's
# channel sets no socket timeout: a half-open connection held the event loop for good). The fetch's
# own block (kombu's brpop_timeout, 1 s) is far inside it.
COMMAND_TIMEOUT_S = 10.0
# kombu's checks of the fetch and pub/sub connections run this often: a fetch whose reply is overdue
# by more than brpop_timeout + this is dropped and sent again, within brpop_timeout + 2x this (11 s).
HEALTH_CHECK_S = 5
# A fetch reply this late past its block is overdue: the turn that finds it so is no progress.
FETCH_REPLY_GRACE_S = 1.0
CHANNEL_OPTIONS = ("ticketq_lease_s", "ticketq_stream_maxlen", "ticketq_health")  # from broker_transport_options


class WritesRefused(TicketqError, redis.ConnectionError):
    """A channel opened on a Redis that refuses writes (full, too few replicas, a read-only replica):
    raised as a connection error, so Celery retries connecting, as for a broker that is down."""


def new_consumer_id() -> str:
    """host:pid:random, one per consuming channel (Celery opens a new channel on every reconnect)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Channel(kombu_redis.Channel):
    """kombu's Redis channel with BLMOVE into a per-consumer fetching list instead of BRPOP."""

    QoS = QoS
    from_transport_options = (*kombu_redis.Channel.from_transport_options, *CHANNEL_OPTIONS)
    # One list per queue: a restored or re-sent message always goes back where BLMOVE reads.
    # Messages a plain Celery client sent with a priority land in kombu's priority lists; the lease
    # thread moves them into the queue list (see Lease.collect_priority_lists).
    priority_steps = [0]  # noqa: RUF012  (kombu's own class attribute)
    ticketq_lease_s = 10.0
    ticketq_stream_maxlen = 100_000
    ticketq_health: Health | None = None  # the worker's (runtime's); a channel built without one keeps its own
    ticketq_fetch_max = 64  # messages one fetch takes at most (and never more than the prefetch room)
    socket_timeout = COMMAND_TIMEOUT_S
    socket_connect_timeout = COMMAND_TIMEOUT_S
    health_check_interval = HEALTH_CHECK_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.health = self.ticketq_health or Health()
        if not hasattr(self, "_queue_cycle") or self.handlers.get("BRPOP") != self._brpop_read:
            raise IncompatibleLibrary("kombu's Redis channel changed (_queue_cycle/handlers): see worker/transport/")
        if self.global_keyprefix:
            self._disconnect_pools()
            raise IncompatibleLibrary("TICKETQ_FETCH=atomic does not support kombu's global_keyprefix")
        problem = connections.write_problem(self.client)
        if problem:  # kombu has added the channel to its poller: take it out again
            self.connection.cycle.discard(self)
            self._disconnect_pools()
            raise WritesRefused(f"Redis refuses writes ({problem}); ticketq waits until it takes them again")
        self.consumer = new_consumer_id()
        self.owned_key = OWNED_KEY.format(consumer=self.consumer)
        self.recorded = False  # True while a fetched batch, recorded already, is handed to kombu
        self._fetch_queue: str | None = None  # the queue of the last fetch sent
        self._awaiting = False  # that fetch's reply has not been read
        self._judged = False  # on an event loop, whose turns are the fetching loop's progress
        self._lease: Lease | None = None
        self._shared_client: redis.Redis | None = None
        self._refused_until = 0.0  # monotonic: no fetch before this, after a refused write
        self._held: set[str] = set()  # queues whose fetched messages wait, unrecorded, in the fetching list

    def fetching_key(self, queue: str, consumer: str | None = None) -> str:
        return FETCHING_KEY.format(consumer=consumer or self.consumer, queue=queue)

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        result = super().basic_consume(queue, *args, **kwargs)
        if self._lease is None and queue in self.active_queues:  # fetches with BLMOVE (not a fanout queue)
            _check_redis_version(self.client)
            self._lease = Lease(self._lease_holder())
            try:  # registered before its first fetch, or nobody would look (may_fetch waits for it)
                with self.conn_or_acquire() as client:
                    self._lease.beat(client)
            except redis.ResponseError as exc:
                if not self.refused(exc, "the lease"):
                    raise
            self._lease.start()
        return result

    def _lease_holder(self) -> LeaseHolder:
        state = self.qos.state
        return LeaseHolder(consumer=self.consumer, lease_s=float(self.ticketq_lease_s), state=state,
                           connect=self.own_client, queues=lambda: self.active_queues,
                           recovery=Recovery(self.consumer, state, self.restore_owned), health=self.health)  # fmt: skip

    def restore_owned(self, client: redis.Redis, consumer: str, tag: str) -> bool:
        """Put one unacked message of a dead consumer back in its queue, if that consumer still owns it.

        kombu's restore (`_do_restore_message`: the redelivered flag, the priority list) is worked
        out here, and made in one script call that checks ownership (`WorkerState.restore`): of two
        workers recovering the same consumer one restores the message; a message restored, fetched
        again and recorded by a live consumer (same delivery tag) is the live one's.
        """
        record = client.hget(self.qos.unacked_key, tag)
        pushes = PushRecorder()
        if record is not None:
            message, exchange, routing_key = loads(bytes_to_str(record))
            self._do_restore_message(message, exchange, routing_key, pushes)
            if not pushes.pushes:  # kombu could not work it out (it logged why): keep the record
                log.error("unacked message %s of consumer %s kept: it could not be restored", tag, consumer)
                return False
        return self.qos.state.restore(client, consumer, tag, pushes.pushes)

    def owns(self, tags: list[str]) -> list[bool]:
        """Whether this consumer still owns each of these delivery tags (another worker may have
        recovered them while its lease lapsed). Raises Redis's errors."""
        with self.conn_or_acquire() as client:
            return self.qos.state.owned(client, self.consumer, tags)

    def queue_declare(self, *args: Any, **kwargs: Any) -> Any:
        with self._refusal_is_an_outage("declaring a queue"):
            return super().queue_declare(*args, **kwargs)

    def queue_bind(self, *args: Any, **kwargs: Any) -> Any:
        with self._refusal_is_an_outage("binding a queue"):
            return super().queue_bind(*args, **kwargs)

    @contextmanager
    def _refusal_is_an_outage(self, what: str) -> Iterator[None]:
        """A write Redis refuses while Celery's consumer starts (its control queue's declare) is a
        lost connection to Celery, which connects again, not an unrecoverable error."""
        try:
            yield
        except redis.ResponseError as exc:
            if not self.refused(exc, what):
                raise
            raise WritesRefused(f"Redis refuses writes ({exc}); ticketq waits until it takes them again") from exc

    def may_fetch(self) -> bool:
        """Not while Redis refuses writes (for REFUSED_PAUSE_S after a refusal), nor before this
        consuming channel's lease is registered."""
        return self._lease is None or (self._lease.registered and time.monotonic() >= self._refused_until)

    def refused(self, exc: BaseException, what: str) -> bool:
        """True when `exc` is Redis refusing a write (`Refusals.refused`): fetching pauses."""
        if not self.health.refusals.refused(exc, what):
            return False
        self._refused_until = time.monotonic() + REFUSED_PAUSE_S
        return True

    def maybe_refresh_binding_expiry(self) -> None:
        """kombu >= 5.7 refreshes the bindings of expiring queues (Celery's pidbox) every few
        seconds, by script, and logs a traceback each time Redis refuses it. A refused write is an
        episode here, logged once; kombu refreshes again once Redis takes writes (an expired
        binding table is re-created by the next refresh)."""
        try:
            super().maybe_refresh_binding_expiry()
        except redis.ResponseError as exc:
            if not self.refused(exc, "refreshing the control bindings"):
                raise

    def own_client(self, timeout_s: float | None = None) -> redis.Redis:
        """A client on a pool of its own, as the channel's: for a thread whose commands must not be
        cut by kombu, which disconnects the channel's pools on close. `timeout_s`: for connecting
        and for each command (kombu's channel sets none: across a partition a command would wait
        for as long as TCP holds the connection)."""
        return self.Client(connection_pool=redis.ConnectionPool(**self._own_params(timeout_s)))

    def _own_params(self, timeout_s: float | None) -> dict[str, Any]:
        params = self._connparams()
        if timeout_s is not None:
            params.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return params

    def _lost_reply(self) -> None:
        """If kombu dropped the connection of the fetch in flight (no reply within its health
        check), what that fetch moved waits in the fetching list: deliver it from there."""
        connection = self._in_poll
        if not self._awaiting or (connection and connection._sock is not None):
            return
        log.warning("the reply to a fetch from %r never came (connection dropped): what it moved into the "
                    "fetching list of consumer %s is delivered from there", self._fetch_queue, self.consumer)
        if self._fetch_queue is not None:
            self._held.add(self._fetch_queue)
        self._awaiting, self._in_poll = False, None

    def _brpop_start(self, timeout: float | None = None) -> None:
        self._lost_reply()
        if self._redeliver_held():
            return  # the next turn fetches: the delivered messages may have filled the prefetch window
        # BLMOVE reads one list; with several queues the cycle watches each in turn (1 s each).
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        queue = self._fetch_queue = queues[0]
        self._awaiting = True
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        command = ("BLMOVE", queue, self.fetching_key(queue), "RIGHT", "LEFT", timeout or self.brpop_timeout or 0)
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        queue, awaiting, self._awaiting = self._fetch_queue, self._awaiting, False
        try:
            try:
                item = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                if awaiting and queue is not None:  # the reply is lost: what the fetch moved waits in the list
                    self._held.add(queue)
                self.client.connection.disconnect()  # the next poll reconnects, as kombu's BRPOP does
                raise
            except redis.ResponseError as exc:
                if str(exc).startswith("UNBLOCKED"):  # the master turned replica under the blocked fetch
                    self.client.connection.disconnect()
                    raise redis.ConnectionError(f"the fetch was cut: {exc}") from exc
                if not self.refused(exc, "fetching"):
                    raise
                raise Empty() from None
            self.health.refusals.accepted()
            self._queue_cycle.rotate(queue)
            if item is None:
                raise Empty()
            self._deliver_batch(queue, [item, *self._fetch_more(queue)])
            return True
        finally:
            self._in_poll = None
            flush_reauth = getattr(self, "_flush_brpop_reauth", None)  # kombu >= 5.7
            if flush_reauth is not None:
                flush_reauth()

    def _fetch_more(self, queue: str) -> list[bytes]:
        """After a fetch, up to the prefetch window's free room more items at once (one round trip)."""
        room = self.qos.can_consume_max_estimate()
        extra = min(self.ticketq_fetch_max, self.ticketq_fetch_max if room is None else room) - 1
        if extra <= 0:
            return []
        try:
            with self.conn_or_acquire() as client:
                return client.eval(FETCH_MORE, 2, queue, self.fetching_key(queue), extra)
        except redis.ResponseError as exc:  # nothing moved: the first message goes on alone
            if not self.refused(exc, "fetching"):
                raise
            return []

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        """kombu builds a new redis-py client (a copy of ~200 response callbacks) for every
        command it sends outside the poll: a sixth of the event loop's time. Reuse one per pool."""
        if client is not None:
            yield client
            return
        pool = self.pool
        if self._shared_client is None or self._shared_client.connection_pool is not pool:
            self._shared_client = self._create_client()
        yield self._shared_client

    def flush_acks(self) -> None:
        """Every turn of the event loop: the turn's acks, fetched messages left unrecorded (a refused
        write, a lost reply), and the fetching loop's progress when no fetch reply is overdue."""
        if self._lease is None:  # not a consuming channel
            return
        self.qos.flush_acks()
        self._lost_reply()
        self._redeliver_held()
        sent_at = self._brpop_sent_at if self._awaiting else None
        if not self._judged:  # the first turn: from now on a loop that stops turning is stalled
            self.health.fetching.begin(FETCH_STALL_S)
            self._judged = True
        elif sent_at is None or time.monotonic() - sent_at <= self.brpop_timeout + FETCH_REPLY_GRACE_S:
            self.health.fetching.advanced()

    def _redeliver_held(self) -> bool:
        """Deliver what waits in this consumer's fetching lists (fetched, then its record refused or
        its reply lost), once Redis may take writes again and while no fetch is in flight (one would
        add to the list under the read). True when it tried."""
        if not self._held or self._in_poll or time.monotonic() < self._refused_until:
            return False
        for queue in sorted(self._held):
            self._held.discard(queue)
            # LPUSHed by the fetch, so the oldest is last: delivered first, as it would have been.
            with self.conn_or_acquire() as client:
                items = client.lrange(self.fetching_key(queue), 0, -1)
            if items:
                self._deliver_batch(queue, items[::-1])
        return True

    def _deliver_batch(self, queue: str, items: list[bytes]) -> None:
        """Record every readable fetched item as unacked (one script call), then hand each to kombu.

        A message is handed over only once it is recorded. An item that is not a kombu message is
        dead-lettered, never recorded; one kombu cannot turn into a message is dead-lettered and its
        record removed. If handing one over raises, the recorded ones not handed over yet go back
        to the queue at once (a live consumer's records are not recovered before its channel closes).
        If Redis refuses the record (or a dead letter), nothing is delivered: what is still in the
        fetching list is recorded at a later turn (`flush_acks`).
        """
        try:
            batch, records = self._readable(queue, items)
            claimed = self.qos.record(records, queue)
        except redis.ResponseError as exc:
            if not self.refused(exc, "recording fetched messages"):
                raise
            self._held.add(queue)
            return
        if not all(claimed):
            log.warning("%d fetched message(s) were no longer in the fetching list of consumer %s: another worker "
                        "recovered them, and answers them", claimed.count(False), self.consumer)  # fmt: skip
            batch = [entry for entry, flag in zip(batch, claimed, strict=True) if flag]
        self.recorded = True
        try:
            while batch:
                item, payload, tag = batch.pop(0)
                try:
                    self.connection._deliver(payload, queue)
                except (redis.ConnectionError, redis.TimeoutError):
                    raise
                except Exception as exc:
                    if self.qos.last_appended == tag:  # handed to Celery: not ours to refuse
                        raise
                    self._refuse(queue, item, exc, tag)
        finally:
            self.recorded = False
            for _, _, tag in batch:
                try:
                    self.qos.restore_by_tag(tag)
                except redis.RedisError as exc:  # its lease runs out once the channel closes: recovered then
                    log.warning("could not put message %s back in %r (%s)", tag, queue, exc)

    def _readable(self, queue: str, items: list[bytes]) -> tuple[list, list]:
        """(item, payload, tag) of each fetched item kombu can deliver, and its unacked record;
        the others are dead-lettered."""
        batch, records = [], []
        for item in items:
            try:
                text = bytes_to_str(item)
                payload = codec.kombu_loads(item)  # the bytes: orjson parses them without a copy
                properties = payload["properties"]
                tag, info = properties["delivery_tag"], properties["delivery_info"]
                if isinstance(tag, bool) or not isinstance(tag, str | int | float):  # keys the unacked record:
                    raise TypeError(f"delivery_tag must be a string, got {type(tag).__name__}")  # fail alone
                route = dumps([info["exchange"], info["routing_key"]])[1:]  # kombu's record, message as fetched
            except Exception as exc:
                self._refuse(queue, item, exc)
                continue
            records.append((tag, f"[{text}, {route}", item))
            batch.append((item, payload, tag))
        return batch, records

    def _refuse(self, queue: str, item: bytes, exc: Exception, tag: str | None = None) -> None:
        log.error("refused an unreadable item on queue %r (not a kombu message): %r", queue, exc)
        entry = raw_entry(Reason.UNREADABLE_MESSAGE, exc, {}, "", item)
        with self.conn_or_acquire() as client:
            pipe = client.pipeline()  # dead letter and removal in one transaction: kept exactly once
            pipe.xadd(DEAD_LETTER_STREAM, entry, maxlen=self.ticketq_stream_maxlen)
            if tag is None:
                pipe.lrem(self.fetching_key(queue), 1, item)
            else:  # recorded with its batch
                self.qos._remove_from_indices(tag, pipe)
            pipe.execute()

    def close(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            try:  # kombu restores only what is not acked in memory: acked records must go first
                self.qos.flush_acks()
            except redis.RedisError as exc:
                log.warning("could not remove the records of acked messages (%s); they may be redelivered", exc)
        self._shared_client = None
        if lease is not None:
            if self._judged:
                self.health.fetching.end()
            lease.stop()
            client = self._create_client()  # kombu's close drops the channel's connection and pools
        super().close()  # kombu puts this channel's unacked messages back in the queue
        if lease is not None:
            lease.release(client)


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The atomic fetch on the master Redis Sentinel names: kombu's SentinelChannel builds the
    pools (from the `sentinel://` list and the `master_name` transport option)."""

    from_transport_options = (
        *Channel.from_transport_options,
        *(name for name in kombu_redis.SentinelChannel.from_transport_options
          if name not in Channel.from_transport_options),
    )  # fmt: skip
    master_name: str | None = None
    sentinel_kwargs: dict | None = None
    min_other_sentinels = 0

    def own_client(self, timeout_s: float | None = None) -> redis.Redis:
        params = self._own_params(timeout_s)
        host, port = params.pop("host"), params.pop("port")
        urls = self.connection.client.alt  # kombu's list of the `;`-separated URLs (empty for one)
        sentinels = connections.parse_sentinel_url(";".join(urls)).sentinels if urls else ((host, port),)
        return connections.master_for(sentinels, self.master_name, sentinel_kwargs=self.sentinel_kwargs,
                                      min_other_sentinels=self.min_other_sentinels, redis_class=self.Client,
                                      **params)  # fmt: skip


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the atomic fetch (`broker_transport = "worker.transport:Transport"`).
    `TRANSPORT_OPTIONS` go with it in `broker_transport_options`: kombu reads some from there only."""

    Channel = Channel
    acks_per_tick = False  # True once on an event loop (Celery's worker): acks are written once per turn
    # READONLY: the node was demoted (a failover) or is a replica. A broken connection, not a
    # broken channel: Celery reconnects, and on Sentinel the next connection finds the master.
    connection_errors = (*kombu_redis.Transport.connection_errors, redis.exceptions.ReadOnlyError)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(self._flush_acks)  # after the turn's ready callbacks (Celery's acks), before polling
        self.acks_per_tick = True

    def _flush_acks(self) -> None:
        for channel in list(self.channels):
            channel.flush_acks()


# Socket timeouts on every connection and kombu's connection checks at HEALTH_CHECK_S.
TRANSPORT_OPTIONS = {"socket_timeout": COMMAND_TIMEOUT_S, "socket_connect_timeout": COMMAND_TIMEOUT_S,
                     "health_check_interval": HEALTH_CHECK_S}


class SentinelTransport(Transport):
    """The atomic fetch through Redis Sentinel (`broker_transport = "worker.transport:SentinelTransport"`)."""

    Channel = SentinelChannel
    default_port = kombu_redis.SentinelTransport.default_port


class PinnedConnection(kombu.Connection):
    """A kombu connection that keeps its transport when it fails over to the next URL of a `;` list.

    kombu's `switch` parses the next URL and takes its scheme for the transport: after one failed
    reconnect to `sentinel://a;sentinel://b` the worker would run kombu's SentinelTransport, BRPOP
    and all, not this module's.
    """

    def switch(self, conn_str: str) -> None:
        transport = self.transport_cls
        super().switch(conn_str)
        self.transport_cls = transport


class AMQP(CeleryAMQP):
    """Celery's AMQP helpers with `PinnedConnection` (`Celery(amqp="worker.transport:AMQP")`)."""

    Connection = PinnedConnection


def _check_redis_version(client: redis.Redis) -> None:
    found = client.info("server").get("redis_version", "0")
    parts = tuple(int(p) for p in str(found).split(".")[:2])
    if parts < REDIS_MIN:
        raise IncompatibleLibrary(
            f"TICKETQ_FETCH=atomic needs Redis >= {'.'.join(map(str, REDIS_MIN))} (BLMOVE); this server is "
            f"{found}. Upgrade Redis, or set TICKETQ_FETCH=kombu (stock fetch, can lose a message on kill -9)"
        )

