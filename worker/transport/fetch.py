"""The atomic fetch: kombu's Redis transport whose fetch never leaves a message nowhere.

Stock kombu pops a message (BRPOP) and records it as unacked in a second step; a worker killed
in between loses the message (celery/kombu#305, celery#7950). Here one Redis command moves the
message from the queue list into this consumer's own `fetching` list (BLMOVE, as Sidekiq's
reliable fetch and RQ do), and one script call moves it from there into kombu's unacked record
(`worker.transport.state`: every change to the fetch and lease state is one command of
lua/worker_state.lua). A crash
at any instant leaves the message in the queue, in a fetching list or in the unacked record,
never nowhere. A fetch takes up to 64 messages (within the prefetch window) in two round trips,
and acks are written once per event-loop turn (see QoS). Each consuming channel holds a lease
(`worker.transport.lease`). Producers and plain Celery clients are unchanged: same queue list,
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from queue import Empty
from typing import Any

import kombu
import redis
from celery.app.amqp import AMQP as CeleryAMQP
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps

from ticketq import codec, connections
from ticketq.contract import Reason
from ticketq.dead_letters import raw_entry
from ticketq.errors import TicketqError
from ticketq.lua import script
from ticketq.names import DEAD_LETTER_STREAM, FETCHING_KEY, OWNED_KEY
from worker.health import refusals
from worker.transport.guards import REDIS_MIN, IncompatibleLibrary
from worker.transport.lease import Lease
from worker.transport.state import WorkerState

log = logging.getLogger(__name__)

FETCH_MORE = script(__package__, "fetch_more")  # beside this module: fetch_more.lua
REFUSED_PAUSE_S = 1.0  # after a refused write, fetching waits this long before it tries again


class WritesRefused(TicketqError, redis.ConnectionError):
    """A channel opened on a Redis that refuses writes (full, too few replicas, a read-only replica):
    raised as a connection error, so Celery retries connecting, as for a broker that is down."""


def new_consumer_id() -> str:
    """host:pid:random, one per consuming channel (Celery opens a new channel on every reconnect)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class QoS(kombu_redis.QoS):
    """kombu's unacked record, written in the same script call that empties the fetching list.

    Per fetched batch, not per message: the channel records every message of a fetch as unacked
    in one call (`record`: the worker-state script's `claim`) before it hands any of them to
    kombu. An ack updates kombu's in-memory state at once; its Redis removal waits for the end of
    the event loop's turn (`flush_acks`, on every tick), where every ack of that turn goes in one
    call (without an event loop, as in a plain kombu consumer, an ack is written at once). A
    worker killed before a tick's flush has those messages redelivered; their results are
    published once (worker.redis.outbox).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []  # acked in memory; removed from Redis at the next tick
        self.last_appended: str | None = None

    def append(self, message: Any, delivery_tag: str) -> None:
        if not self.channel.recorded:  # not fetched by Channel's fetch (basic_get): record it now, as kombu does
            delivery = message.delivery_info
            self.record([(delivery_tag, dumps([message._raw, delivery["exchange"], delivery["routing_key"]]), None)])
        virtual.QoS.append(self, message, delivery_tag)  # the in-memory bookkeeping of kombu's QoS
        self.last_appended = delivery_tag

    @property
    def state(self) -> WorkerState:
        return WorkerState(self.unacked_index_key, self.unacked_key)

    def record(self, records: Sequence[tuple[str, str, bytes | None]], queue: str = "") -> None:
        """(delivery tag, kombu's record, fetched item) as unacked, owned by this consumer, and gone
        from its fetching list for `queue`: one script call."""
        if not records:
            return
        with self.channel.conn_or_acquire() as client:
            self.state.claim(client, self.channel.consumer, queue, time.time(), records)

    def can_consume(self) -> bool:
        """kombu's prefetch check, and no fetch while Redis refuses writes or before the lease is held."""
        return self.channel.may_fetch() and super().can_consume()

    def ack(self, delivery_tag: str) -> None:
        self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)
        if not self.channel.connection.acks_per_tick:
            self.flush_acks()

    def flush_acks(self) -> None:
        """Remove the records of every message acked since the last flush, in one script call."""
        tags, self._acked = self._acked, []
        if not tags:
            return
        try:
            with self.channel.conn_or_acquire() as client:
                acked = self.state.ack(client, self.channel.consumer, tags)
        except redis.ResponseError as exc:
            self._acked[:0] = tags  # tried again at the next tick, and at close
            if not self.channel.refused(exc, "acks"):
                raise
        except Exception:
            self._acked[:0] = tags
            raise
        if acked < len(tags):
            log.warning(
                "%d of %d acked message(s) were no longer this consumer's (%s): its lease lapsed and "
                "another worker took them over; theirs to answer and ack", len(tags) - acked, len(tags),
                self.channel.consumer,
            )  # fmt: skip

    def restore_visible(self, *args: Any, **kwargs: Any) -> Any:
        """kombu's sweep of messages past the visibility timeout; skipped while Redis refuses writes
        (its mutex is a write: a full Redis stopped the worker at start-up)."""
        try:
            return super().restore_visible(*args, **kwargs)
        except redis.ResponseError as exc:
            if not self.channel.refused(exc, "the visibility-timeout sweep"):
                raise
            return None

    def restore_unacked(self, client: Any = None) -> Any:
        try:  # acked messages must not be restored from records their flush has not removed yet
            self.flush_acks()
        except redis.RedisError as exc:
            log.warning("could not remove the records of %d acked messages (%s); they may be redelivered",
                        len(self._acked), exc)  # fmt: skip
        return super().restore_unacked(client)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        return super()._remove_from_indices(delivery_tag, pipe).srem(self.channel.owned_key, delivery_tag)


class Channel(kombu_redis.Channel):
    """kombu's Redis channel with BLMOVE into a per-consumer fetching list instead of BRPOP."""

    QoS = QoS
    from_transport_options = (*kombu_redis.Channel.from_transport_options, "ticketq_lease_s", "ticketq_stream_maxlen")
    # One list per queue: a restored or re-sent message always goes back where BLMOVE reads.
    # Messages a plain Celery client sent with a priority land in kombu's priority lists; the lease
    # thread moves them into the queue list (see Lease.collect_priority_lists).
    priority_steps = [0]  # noqa: RUF012  (kombu's own class attribute)
    ticketq_lease_s = 10.0
    ticketq_stream_maxlen = 100_000
    ticketq_fetch_max = 64  # messages one fetch takes at most (and never more than the prefetch room)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
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
        self._fetch_queue: str | None = None
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
            self._lease = Lease(self)
            try:  # registered before its first fetch, or nobody would look (may_fetch waits for it)
                with self.conn_or_acquire() as client:
                    self._lease.beat(client)
            except redis.ResponseError as exc:
                if not self.refused(exc, "the lease"):
                    raise
            self._lease.start()
        return result

    def may_fetch(self) -> bool:
        """Not while Redis refuses writes (for REFUSED_PAUSE_S after a refusal), nor before this
        consuming channel's lease is registered."""
        if self._lease is None:
            return True
        return self._lease.registered and time.monotonic() >= self._refused_until

    def refused(self, exc: BaseException, what: str) -> bool:
        """True when `exc` is Redis refusing a write (worker.health.refusals.refused): fetching pauses."""
        if not refusals.refused(exc, what):
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

    def _brpop_start(self, timeout: float | None = None) -> None:
        # BLMOVE reads one list; with several queues the cycle watches each in turn (1 s each).
        queues = self._queue_cycle.consume(len(self.active_queues))
        if not queues:
            return
        queue = self._fetch_queue = queues[0]
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        command = ("BLMOVE", queue, self.fetching_key(queue), "RIGHT", "LEFT", timeout or self.brpop_timeout or 0)
        self.client.connection.send_command(*command)

    def _brpop_read(self, **options: Any) -> bool:
        queue = self._fetch_queue
        try:
            try:
                item = self.client.parse_response(self.client.connection, "BLMOVE", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next poll reconnects, as kombu's BRPOP does
                raise
            except redis.ResponseError as exc:
                if str(exc).startswith("UNBLOCKED"):  # the master turned replica under the blocked fetch
                    self.client.connection.disconnect()
                    raise redis.ConnectionError(f"the fetch was cut: {exc}") from exc
                if not self.refused(exc, "fetching"):
                    raise
                raise Empty() from None
            refusals.accepted()
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
        """Every turn of the event loop: the turn's acks, and fetched messages a refused write left
        unrecorded, once Redis may take writes again."""
        if self._lease is None:  # not a consuming channel
            return
        self.qos.flush_acks()
        if self._held and time.monotonic() >= self._refused_until:
            for queue in sorted(self._held):
                self._held.discard(queue)
                # LPUSHed by the fetch, so the oldest is last: delivered first, as it would have been.
                with self.conn_or_acquire() as client:
                    items = client.lrange(self.fetching_key(queue), 0, -1)
                if items:
                    self._deliver_batch(queue, items[::-1])

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
            self.qos.record(records, queue)
        except redis.ResponseError as exc:
            if not self.refused(exc, "recording fetched messages"):
                raise
            self._held.add(queue)
            return
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
    """kombu's Redis transport with the atomic fetch (`broker_transport = "worker.transport:Transport"`)."""

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

