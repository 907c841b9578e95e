"""Every place ticketq relies on a private part of kombu, Celery or celery-batches: here, guarded.

`check_versions()` runs at worker start-up and stops the worker, naming the library, when a
version outside the range these shims were written and tested against is installed, or when an
attribute they override is gone. Nothing else in ticketq touches a private name of those libraries.

1. `Transport` (selected with TICKETQ_FETCH=atomic, the default): kombu's Redis transport with an
   atomic fetch. Stock kombu pops a message (BRPOP) and records it as unacked in a second step; a
   worker killed in between loses the message (celery/kombu#305, celery#7950). Here one Redis
   command moves the message from the queue list into this consumer's own `fetching` list
   (BLMOVE, as Sidekiq's reliable fetch and RQ do), and one MULTI moves it from there into kombu's
   unacked record. A crash at any instant leaves the message in the queue, in a fetching list or
   in the unacked record, never nowhere. A fetch takes up to 64 messages (within the prefetch
   window) in two round trips, and acks are written once per event-loop turn (see QoS). Each
   consuming channel holds a lease (`alive` key, TTL TICKETQ_LEASE_S) that a thread renews; any
   live worker hands the fetching list and the unacked messages of a consumer whose lease ran out
   back to the queue within seconds, instead of after the visibility timeout (which stays as a
   backstop). A channel lost to a broker outage is such a consumer too: its leftovers come back
   once its lease has run out. Producers and plain Celery clients are unchanged: same queue list,
   same message format. Keys: see worker.store (FETCHING_KEY,
   OWNED_KEY, ALIVE_KEY, CONSUMERS_KEY).
2. `Batches`: celery-batches' task base, holding flushes while the model is busy and handing
   them to the running job between forwards, so the engine plans over everything that waits;
   each message is acked as soon as its result is out.
3. `rearm_flush_timer`: celery-batches' flush timer, lost when Celery reconnects to the broker.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from queue import Empty
from typing import Any

import celery_batches
import redis
from celery.concurrency.thread import TaskPool as ThreadTaskPool
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import dumps, loads

from ticketq import codec
from ticketq.contract import Reason
from ticketq.names import DEAD_LETTER_STREAM
from worker import store

log = logging.getLogger(__name__)

# Library -> (lowest, first untested) versions the shims below were written and tested against.
TESTED = {"kombu": ((5, 5), (5, 8)), "celery": ((5, 4), (5, 7)), "celery-batches": ((0, 10), (0, 12))}
# Private names overridden or called below, per class.
REQUIRED = {
    kombu_redis.Channel: (
        "_brpop_start",
        "_brpop_read",
        "_in_poll",
        "_brpop_sent_at",
        "client",
        "_connparams",
        "_create_client",
        "conn_or_acquire",
        "_do_restore_message",
    ),
    kombu_redis.QoS: ("_remove_from_indices", "pipe_or_acquire", "restore_unacked", "restore_by_tag", "ack"),
    kombu_redis.Transport: ("register_with_event_loop",),
    virtual.QoS: ("can_consume_max_estimate",),
    virtual.Transport: ("_deliver",),
}
REDIS_MIN = (6, 2)  # BLMOVE

# Up to ARGV[1] more messages from the queue (KEYS[1]) into the fetching list (KEYS[2]), oldest
# first, returned in that order: the rest of a batch after the blocking fetch of its first.
FETCH_MORE = """
local items = {}
for i = 1, tonumber(ARGV[1]) do
  local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
  if not item then break end
  items[i] = item
end
return items
"""


class IncompatibleLibrary(RuntimeError):
    """A library changed under a shim of this module."""


def check_versions() -> None:
    """Fail loudly at start-up when kombu, Celery or celery-batches moved under these shims."""
    for name, (low, high) in TESTED.items():
        found = version(name)
        parts = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
        if not low <= parts < high:
            raise IncompatibleLibrary(
                f"{name} {found} is outside the range ticketq's shims were tested with "
                f"({'.'.join(map(str, low))} <= version < {'.'.join(map(str, high))}); install a tested "
                f"version (pip install 'ticketq') or review worker/internals.py for this release"
            )
    for cls, names in REQUIRED.items():
        missing = [name for name in names if not hasattr(cls, name)]
        if missing:
            where = f"{cls.__module__}.{cls.__name__}"
            raise IncompatibleLibrary(f"{where} no longer has {missing}: see worker/internals.py")
    for name in ("_do_flush", "flush", "Strategy"):  # Strategy sets the `_pool` that Batches.flush uses
        if not hasattr(celery_batches.Batches, name):
            raise IncompatibleLibrary(f"celery_batches.Batches no longer has {name}: see worker/internals.py")
    for name in ("apply_batches_task", "SimpleRequest"):
        if not hasattr(celery_batches, name):
            raise IncompatibleLibrary(f"celery_batches no longer has {name}: see worker/internals.py")


class Batches(celery_batches.Batches):
    """celery-batches' Batches, feeding the running job with everything that arrives while it runs.

    Stock, every flush (each `flush_every` messages, or the `flush_interval` timer) becomes its own
    pool job; with the one model thread busy they queue behind the running forward and each is
    planned alone, so under load the engine ran many 1-3-ticket jobs (the demo: 238 forwards,
    2.5 tickets each) and latency grew with the queue of tiny jobs. Here a flush that comes while
    a job runs is held; the running job takes what is held between two forwards (`more`), so the
    engine plans every forward over everything waiting at its start, and a message is acked the
    moment its result is out (`done`), which frees its prefetch slot while the job goes on.
    Whatever is still held when the job returns goes as the next job.

    Only for the threads pool (ticketq's worker runs one model thread); any other pool gets the
    stock behaviour. Held requests are unacknowledged (acks_late), like the buffer's: a worker
    that dies holding them has them redelivered.
    """

    def __init__(self) -> None:
        super().__init__()
        self._job_lock = threading.Lock()
        self._job_running = False
        self._held: list[Any] = []
        self._unacked: dict[str, list[Any]] = {}  # task id -> requests of the running job, until acked

    def flush(self, requests: Any) -> Any:
        if not isinstance(self._pool, ThreadTaskPool):
            return super().flush(requests)
        with self._job_lock:
            if self._job_running:
                self._held.extend(requests)
                return None
            self._job_running = True
        return self._submit(list(requests))

    def more(self) -> list[Any]:
        """For the running job, between two forwards: the requests held since it started (as
        celery-batches' SimpleRequests), now part of it; acked by `done` or when it returns."""
        with self._job_lock:
            held, self._held = self._held, []
            for request in held:
                self._unacked.setdefault(request.id, []).append(request)
        return [celery_batches.SimpleRequest.from_request(request) for request in held]

    def done(self, task_ids: Any) -> None:
        """The results of these messages are out (stream and backend): acknowledge them now.

        Never raises: a message whose ack fails (Celery logs a broker error itself) stays unacked
        and comes back; its results are published once, so a redelivery only costs a recompute.
        """
        with self._job_lock:
            requests = [request for task_id in task_ids for request in self._unacked.pop(task_id, ())]
        _acknowledge(requests)

    def _submit(self, requests: list[Any]) -> Any:
        """celery_batches.Batches.flush, with `_run_job` as the pool target so we learn when it ends."""
        acks_early = [request for request in requests if not request.task.acks_late]
        simple = ([celery_batches.SimpleRequest.from_request(request) for request in requests],)
        job: dict[str, list[Any]] = {}  # this job's own: the next one may start before its on_return runs
        for request in requests:
            job.setdefault(request.id, []).append(request)
        with self._job_lock:
            self._unacked = job

        def on_accepted(pid: int, time_accepted: float) -> None:
            for request in acks_early:
                request.acknowledge()

        def on_return(result: Any) -> None:  # what `done` did not ack: failures, ignored results
            with self._job_lock:
                rest = [request for requests in job.values() for request in requests]
                job.clear()
            _acknowledge(rest)

        try:
            return self._pool.apply_async(self._run_job, (simple,), accept_callback=on_accepted, callback=on_return)
        except RuntimeError as exc:  # the pool is shutting down: the requests stay unacked and come back
            log.warning("could not start a batch of %d requests (%s); they will be redelivered", len(requests), exc)
            with self._job_lock:
                self._job_running = False
            return None

    def _run_job(self, simple: tuple[list[Any]]) -> Any:
        try:
            return celery_batches.apply_batches_task(self, simple, 0, None)
        finally:
            self._next_job()

    def _next_job(self) -> None:
        """The running job ended: send everything still held as one job, or go idle."""
        with self._job_lock:
            held, self._held = self._held, []
            if not held:
                self._job_running = False
                return
        log.debug("batch of %d requests held while the model was busy", len(held))
        self._submit(held)


def _acknowledge(requests: list[Any]) -> None:
    """Ack late-acked requests; one that fails (Celery logs broker errors itself) is logged and comes back."""
    for request in requests:
        if request.task.acks_late:
            try:
                request.acknowledge()
            except Exception:
                log.exception("could not acknowledge task %s; it will be redelivered", request.id)


def rearm_flush_timer(task: Any, timer: Any) -> None:
    """Re-arm a celery-batches task's flush timer after a broker (re)connect.

    On a lost connection Celery's event loop clears every hub timer, celery-batches' flush_interval
    timer included, but the task keeps its stale `_tref` and never arms a new one: after the
    reconnect a buffer below flush_every waited for more traffic, forever at the tail of a burst.
    """
    if getattr(task, "_tref", None) is not None:
        task._tref.cancel()
        task._tref = timer.call_repeatedly(task.flush_interval, task._do_flush)


# ------------------------------------------------------------------------------------------------
# the atomic fetch


def new_consumer_id() -> str:
    """host:pid:random, one per consuming channel (Celery opens a new channel on every reconnect)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class QoS(kombu_redis.QoS):
    """kombu's unacked record, written in the same MULTI that empties the fetching list.

    Per fetched batch, not per message: the channel records every message of a fetch as unacked
    in one MULTI before it hands any of them to kombu (`record`). An ack updates kombu's
    in-memory state at once; its Redis removal waits for the end of the event loop's turn
    (`flush_acks`, on every tick), where every ack of that turn goes in one MULTI (without an
    event loop, as in a plain kombu consumer, an ack is written at once). A worker killed before
    a tick's flush has those messages redelivered; their results are published once (worker.store).
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

    def record(self, records: Sequence[tuple[str, str, bytes | None]], fetching_key: str = "") -> None:
        """(delivery tag, kombu's record, fetched item) as unacked, owned by this consumer, and gone
        from its fetching list: one MULTI (redis-py pipelines are MULTI/EXEC transactions)."""
        if not records:
            return
        with self.pipe_or_acquire() as pipe:
            now = time.time()
            pipe.zadd(self.unacked_index_key, {tag: now for tag, _, _ in records})
            pipe.hset(self.unacked_key, mapping={tag: record for tag, record, _ in records})
            pipe.sadd(self.channel.owned_key, *(tag for tag, _, _ in records))
            for _, _, item in records:
                if item is not None:
                    pipe.lrem(fetching_key, 1, item)
            pipe.execute()

    def ack(self, delivery_tag: str) -> None:
        self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)
        if not self.channel.connection.acks_per_tick:
            self.flush_acks()

    def flush_acks(self) -> None:
        """Remove the records of every message acked since the last flush, in one MULTI."""
        tags, self._acked = self._acked, []
        if not tags:
            return
        try:
            with self.pipe_or_acquire() as pipe:
                pipe.zrem(self.unacked_index_key, *tags)
                pipe.hdel(self.unacked_key, *tags)
                pipe.srem(self.channel.owned_key, *tags)
                pipe.execute()
        except Exception:
            self._acked[:0] = tags  # tried again at the next tick, and at close
            raise

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
            raise IncompatibleLibrary("kombu's Redis channel changed (_queue_cycle/handlers): see worker/internals.py")
        if self.global_keyprefix:
            self._disconnect_pools()
            raise IncompatibleLibrary("TICKETQ_FETCH=atomic does not support kombu's global_keyprefix")
        self.consumer = new_consumer_id()
        self.owned_key = store.OWNED_KEY.format(consumer=self.consumer)
        self.recorded = False  # True while a fetched batch, recorded already, is handed to kombu
        self._fetch_queue: str | None = None
        self._lease: Lease | None = None
        self._shared_client: redis.Redis | None = None

    def fetching_key(self, queue: str, consumer: str | None = None) -> str:
        return store.FETCHING_KEY.format(consumer=consumer or self.consumer, queue=queue)

    def basic_consume(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        result = super().basic_consume(queue, *args, **kwargs)
        if self._lease is None and queue in self.active_queues:  # fetches with BLMOVE (not a fanout queue)
            _check_redis_version(self.client)
            self._lease = Lease(self)
            with self.conn_or_acquire() as client:  # registered before its first fetch, or nobody would look
                self._lease.beat(client)
            self._lease.start()
        return result

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
        with self.conn_or_acquire() as client:
            return client.eval(FETCH_MORE, 2, queue, self.fetching_key(queue), extra)

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
        if self._lease is not None:  # a consuming channel
            self.qos.flush_acks()

    def _deliver_batch(self, queue: str, items: list[bytes]) -> None:
        """Record every readable fetched item as unacked (one MULTI), then hand each to kombu.

        A message is handed over only once it is recorded. An item that is not a kombu message is
        dead-lettered, never recorded; one kombu cannot turn into a message is dead-lettered and its
        record removed. If handing one over raises, the recorded ones not handed over yet go back
        to the queue at once (a live consumer's records are not recovered before its channel closes).
        """
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
        self.qos.record(records, self.fetching_key(queue))
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

    def _refuse(self, queue: str, item: bytes, exc: Exception, tag: str | None = None) -> None:
        log.error("refused an unreadable item on queue %r (not a kombu message): %r", queue, exc)
        entry = store.raw_entry(Reason.UNREADABLE_MESSAGE, exc, {}, "", item)
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


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with the atomic fetch (`broker_transport = "worker.internals:Transport"`)."""

    Channel = Channel
    acks_per_tick = False  # True once on an event loop (Celery's worker): acks are written once per turn

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        super().register_with_event_loop(connection, loop)
        loop.on_tick.add(self._flush_acks)  # after the turn's ready callbacks (Celery's acks), before polling
        self.acks_per_tick = True

    def _flush_acks(self) -> None:
        for channel in list(self.channels):
            channel.flush_acks()


def _check_redis_version(client: redis.Redis) -> None:
    found = client.info("server").get("redis_version", "0")
    parts = tuple(int(p) for p in str(found).split(".")[:2])
    if parts < REDIS_MIN:
        raise IncompatibleLibrary(
            f"TICKETQ_FETCH=atomic needs Redis >= {'.'.join(map(str, REDIS_MIN))} (BLMOVE); this server is "
            f"{found}. Upgrade Redis, or set TICKETQ_FETCH=kombu (stock fetch, can lose a message on kill -9)"
        )


class Lease(threading.Thread):
    """This consumer's lease, renewed every lease/4 s, and the recovery of consumers whose lease ran out.

    A consumer is recovered only by a worker that has itself held its lease for a full lease
    period since it last (re)connected: after a Redis restart every live worker gets one period to
    renew its lease before anyone counts it dead.
    """

    def __init__(self, channel: Channel) -> None:
        super().__init__(name="ticketq-lease", daemon=True)
        self.channel = channel
        self.lease_s = float(channel.ticketq_lease_s)
        self.alive_key = store.ALIVE_KEY.format(consumer=channel.consumer)
        self.started = time.time()
        self._queues: set[str] = set()
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)

    def run(self) -> None:
        steady_since: float | None = None
        # Its own pool: kombu disconnects the channel's pools on close, under a running command.
        pool = redis.ConnectionPool(**self.channel._connparams())
        with self.channel.Client(connection_pool=pool) as client:
            while True:
                try:
                    self.beat(client)
                    steady_since = steady_since or time.monotonic()
                    if time.monotonic() - steady_since >= self.lease_s:
                        self.recover_expired(client)
                except redis.RedisError as exc:
                    if steady_since is not None:
                        log.warning("lease not renewed, Redis unavailable (%s)", exc)
                    steady_since = None
                if self._stopped.wait(self.lease_s / 4):
                    break
        pool.disconnect()

    @property
    def queues(self) -> list[str]:
        """Every queue this channel has consumed (kept after close, which cancels its consumers)."""
        self._queues.update(self.channel.active_queues)
        return sorted(self._queues)

    def beat(self, client: redis.Redis) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "queues": self.queues,
                "since": round(self.started, 3)}  # fmt: skip
        pipe = client.pipeline()
        pipe.set(self.alive_key, json.dumps(info), px=int(self.lease_s * 1000))
        pipe.hset(store.CONSUMERS_KEY, self.channel.consumer, json.dumps(info))
        pipe.execute()

    def recover_expired(self, client: redis.Redis) -> None:
        consumers = {bytes_to_str(k): json.loads(v) for k, v in client.hgetall(store.CONSUMERS_KEY).items()}
        others = [name for name in consumers if name != self.channel.consumer]
        pipe = client.pipeline(transaction=False)
        for name in others:
            pipe.exists(store.ALIVE_KEY.format(consumer=name))
        for name, alive in zip(others, pipe.execute(), strict=True):
            if not alive:
                self.recover(client, name, consumers[name].get("queues", []))
        self.collect_priority_lists(client)

    def recover(self, client: redis.Redis, consumer: str, queues: list[str]) -> None:
        """Put a dead consumer's fetched and unacked messages back in their queues (safe to race)."""
        started = time.monotonic()
        fetched = sum(self.requeue_fetching(client, consumer, queue) for queue in queues)
        owned_key = store.OWNED_KEY.format(consumer=consumer)
        tags = [bytes_to_str(tag) for tag in client.smembers(owned_key)]
        restored = sum(self.restore_owned(client, owned_key, tag) for tag in tags)
        pipe = client.pipeline()
        pipe.delete(owned_key)
        pipe.hdel(store.CONSUMERS_KEY, consumer)
        pipe.execute()
        if fetched or restored:
            log.warning(
                "recovered %d unacked and %d fetched message(s) of consumer %s (lease expired) in %.3fs",
                restored, fetched, consumer, time.monotonic() - started,
            )  # fmt: skip

    def restore_owned(self, client: redis.Redis, owned_key: str, tag: str) -> bool:
        """Put one unacked message of a dead consumer back in its queue, if that consumer still owns it.

        One WATCH/MULTI on the dead consumer's set: of two workers recovering the same consumer, one
        restores the message (the other's EXEC fails, and on retry the tag is gone from the set); a
        message restored, fetched again and recorded by a live consumer (same delivery tag) is no
        longer in the dead one's set. Watching kombu's unacked hash too would be just as correct and
        never succeed under load: every fetch and ack of every worker writes it.
        """
        qos, restored = self.channel.qos, False

        def transaction(pipe: Any) -> None:
            nonlocal restored
            owned, record = pipe.sismember(owned_key, tag), pipe.hget(qos.unacked_key, tag)
            pipe.multi()
            pipe.srem(owned_key, tag)
            if owned and record:
                pipe.zrem(qos.unacked_index_key, tag)
                pipe.hdel(qos.unacked_key, tag)
                message, exchange, routing_key = loads(bytes_to_str(record))
                self.channel._do_restore_message(message, exchange, routing_key, pipe)
            restored = bool(owned and record)

        client.transaction(transaction, owned_key)
        return restored

    def collect_priority_lists(self, client: redis.Redis) -> None:
        """Messages a plain Celery client sent with a priority wait in kombu's per-priority lists
        (`<queue>\\x06\\x16<n>`), which BLMOVE does not read: move them into the queue list."""
        sep = self.channel.sep
        for queue in self.queues:
            for step in kombu_redis.PRIORITY_STEPS[1:]:
                while client.lmove(f"{queue}{sep}{step}", queue, "RIGHT", "LEFT"):
                    pass

    def release(self, client: redis.Redis) -> None:
        """Clean shutdown: give back what was fetched, drop the lease (kombu restored the unacked)."""
        try:
            for queue in self.queues:
                self.requeue_fetching(client, self.channel.consumer, queue)
            pipe = client.pipeline()
            pipe.delete(self.alive_key)
            if not client.scard(self.channel.owned_key):
                pipe.hdel(store.CONSUMERS_KEY, self.channel.consumer)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not release the lease (%s); live workers recover it after %.0fs", exc, self.lease_s)

    def requeue_fetching(self, client: redis.Redis, consumer: str, queue: str) -> int:
        source, moved = self.channel.fetching_key(queue, consumer), 0
        while client.lmove(source, queue, "RIGHT", "RIGHT"):  # back at the consuming end: it was next
            moved += 1
        return moved
