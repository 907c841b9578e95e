"""Each consuming channel's lease (`alive` key, TTL TICKETQ_LEASE_S) that a thread renews, and the
recovery of consumers whose lease ran out.

Any live worker hands the fetching list and the unacked messages of a consumer whose lease ran
out back to the queue within seconds, instead of after kombu's visibility timeout (which stays
as a backstop). A channel lost to a broker outage is such a consumer too: its leftovers come
back once its lease has run out. The thread has a client of its own (`Channel.own_client`: on
Sentinel, one that follows the master), and rides out a Redis that refuses writes like any outage.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from ticketq import connections
from ticketq.names import queue_lists
from worker import store

if TYPE_CHECKING:
    from worker.transport.fetch import Channel

log = logging.getLogger(__name__)


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
        self.registered = False  # the consumer is in CONSUMERS_KEY: it may fetch (Channel.may_fetch)
        self._queues: set[str] = set()
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)

    def run(self) -> None:
        steady_since: float | None = None
        # Its own pool: kombu disconnects the channel's pools on close, under a running command.
        client = self.channel.own_client()
        try:
            while True:
                try:
                    self.beat(client)
                    steady_since = steady_since or time.monotonic()
                    if time.monotonic() - steady_since >= self.lease_s:
                        self.recover_expired(client)
                except redis.RedisError as exc:
                    if not store.refused(exc, "the lease") and steady_since is not None:
                        log.warning("lease not renewed, Redis unavailable (%s)", exc)
                    steady_since = None
                if self._stopped.wait(self.lease_s / 4):
                    break
        finally:
            connections.close(client)

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
        self.registered = True
        store.accepted()

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
        """Messages a plain Celery client sent with a priority wait in kombu's per-priority lists,
        which BLMOVE does not read: move them into the queue list."""
        for queue in self.queues:
            for source in queue_lists(queue)[1:]:
                while client.lmove(source, queue, "RIGHT", "LEFT"):
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

