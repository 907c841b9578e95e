"""Each consuming channel's lease (`alive` key, TTL TICKETQ_LEASE_S) that a thread renews, and the
recovery of consumers whose lease ran out.

Any live worker hands the fetching list and the unacked messages of a consumer whose lease ran
out back to the queue within seconds, instead of after kombu's visibility timeout (which stays
as a backstop). A channel lost to a broker outage is such a consumer too: its leftovers come
back once its lease has run out. The thread has a client of its own (`Channel.own_client`: on
Sentinel, one that follows the master), and rides out a Redis that refuses writes like any outage.

A lease is a promise of progress: while the classifying loop holds work without progress for
longer than its bound (`worker.health.progress`, TICKETQ_WORST_BATCH_S) the thread stops renewing and the
channel stops fetching, so live workers take over what it holds once the lease runs out; it
renews again at the first progress, and the late results are published once (the outbox's rules).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import redis
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

from ticketq import connections
from ticketq.names import ALIVE_KEY, CONSUMERS_KEY, OWNED_KEY, queue_lists
from worker.health import refusals
from worker.health.progress import CLASSIFYING
from worker.transport.state import PushRecorder, WorkerState

if TYPE_CHECKING:
    from worker.transport.fetch import Channel

log = logging.getLogger(__name__)


class Lease(threading.Thread):
    """This consumer's lease, renewed every lease/4 s while the classifying loop makes progress, and
    the recovery of consumers whose lease ran out.

    A consumer is recovered only by a worker that has itself held its lease for a full lease
    period since it last (re)connected: after a Redis restart every live worker gets one period to
    renew its lease before anyone counts it dead.
    """

    def __init__(self, channel: Channel) -> None:
        super().__init__(name="ticketq-lease", daemon=True)
        self.channel = channel
        self.lease_s = float(channel.ticketq_lease_s)
        self.started = time.time()
        self._registered = False  # the consumer is in CONSUMERS_KEY
        self.renewed_at: float | None = None  # monotonic time of the last renewal
        self.lapsed = False  # not renewed for a whole lease period: others may recover this consumer
        self.stalled = False  # held back: the classifying loop holds work without progress
        self._queues: set[str] = set()
        self._stopped = threading.Event()

    @property
    def registered(self) -> bool:
        """The consumer is in CONSUMERS_KEY and its lease is not held back: it may fetch (Channel.may_fetch)."""
        return self._registered and not self.stalled

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)

    def run(self) -> None:
        steady_since: float | None = None
        # Its own pool: kombu disconnects the channel's pools on close, under a running command.
        # Each command within half a lease: cut off, the thread knows its lease is lapsing.
        client = self.channel.own_client(timeout_s=max(1.0, self.lease_s / 2))
        try:
            while True:
                steady_since = self.tick(client, steady_since)
                if self._stopped.wait(self.lease_s / 4):
                    break
        finally:
            connections.close(client)

    def tick(self, client: redis.Redis, steady_since: float | None) -> float | None:
        """One quarter-lease turn: renew (unless held back), and recover the consumers whose lease ran
        out once this one has held its own for a full period. Returns when that period began (None:
        the lease was not renewed)."""
        if self.held_back():
            self.check_lapse()
            return None
        try:
            self.beat(client)
            steady_since = steady_since or time.monotonic()
            if time.monotonic() - steady_since >= self.lease_s:
                self.recover_expired(client)
            return steady_since
        except redis.RedisError as exc:
            if not refusals.refused(exc, "the lease") and steady_since is not None:
                log.warning("lease not renewed, Redis unavailable (%s)", exc)
            self.check_lapse()
            return None

    @property
    def queues(self) -> list[str]:
        """Every queue this channel has consumed (kept after close, which cancels its consumers)."""
        self._queues.update(self.channel.active_queues)
        return sorted(self._queues)

    @property
    def state(self) -> WorkerState:
        return self.channel.qos.state

    def held_back(self) -> bool:
        """Whether the classifying loop is stalled, so that this lease must not be renewed; logs once
        when a stall begins and when it ends. Not while Redis refuses writes or the replicas lag
        (`refusals.write_problems`): the loop then waits on Redis by design, with no deadline, and any
        worker taking its messages over would wait the same way."""
        quiet = 0.0 if refusals.write_problems() else CLASSIFYING.stalled_for()
        if quiet and not self.stalled:
            log.warning(
                "lease of consumer %s no longer renewed: the classifying loop has held work for %.1fs without "
                "progress (bound %gs, TICKETQ_WORST_BATCH_S); live workers take over the messages it holds once "
                "the lease runs out (%gs), and this worker fetches nothing until it makes progress again",
                self.channel.consumer, quiet, CLASSIFYING.bound_s, self.lease_s,
            )  # fmt: skip
        elif not quiet and self.stalled:
            log.warning("the classifying loop moves again: renewing the lease of consumer %s, fetching resumes",
                        self.channel.consumer)  # fmt: skip
        self.stalled = bool(quiet)
        return self.stalled

    def beat(self, client: redis.Redis) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "queues": self.queues,
                "since": round(self.started, 3)}  # fmt: skip
        new = self.state.beat(client, self.channel.consumer, int(self.lease_s * 1000), json.dumps(info))
        now = time.monotonic()
        if self._registered and (new or self.lapsed):
            gap = now - (self.renewed_at or now)
            if new:
                log.warning(
                    "lease of consumer %s renewed after %.1fs (lease %.0fs): another worker had recovered "
                    "it as dead and answers the messages it held; their acks here are skipped",
                    self.channel.consumer, gap, self.lease_s,
                )  # fmt: skip
            else:  # a beat sent into the partition may have landed late and registered it again
                log.warning("lease of consumer %s renewed after %.1fs (lease %.0fs): other workers may have "
                            "recovered the messages it held meanwhile; its acks of those are skipped",
                            self.channel.consumer, gap, self.lease_s)  # fmt: skip
        self._registered, self.renewed_at, self.lapsed = True, now, False
        refusals.accepted()

    def check_lapse(self) -> None:
        """Log once when the lease has gone a whole period without renewal."""
        if self.lapsed or self.renewed_at is None or time.monotonic() - self.renewed_at < self.lease_s:
            return
        self.lapsed = True
        log.warning(
            "lease of consumer %s lapsed: not renewed for %.1fs (lease %.0fs); other workers may now "
            "recover the messages it holds, and this worker leaves those to them",
            self.channel.consumer, time.monotonic() - self.renewed_at, self.lease_s,
        )  # fmt: skip

    def recover_expired(self, client: redis.Redis) -> None:
        consumers = {bytes_to_str(k): json.loads(v) for k, v in client.hgetall(CONSUMERS_KEY).items()}
        others = [name for name in consumers if name != self.channel.consumer]
        pipe = client.pipeline(transaction=False)
        for name in others:
            pipe.exists(ALIVE_KEY.format(consumer=name))
        for name, alive in zip(others, pipe.execute(), strict=True):
            if not alive:
                self.recover(client, name, consumers[name].get("queues", []))
        self.collect_priority_lists(client)

    def recover(self, client: redis.Redis, consumer: str, queues: list[str]) -> None:
        """Put a dead consumer's fetched and unacked messages back in their queues (safe to race)."""
        started = time.monotonic()
        fetched = sum(self.state.requeue(client, consumer, queue) for queue in queues)
        tags = [bytes_to_str(tag) for tag in client.smembers(OWNED_KEY.format(consumer=consumer))]
        restored = sum(self.restore_owned(client, consumer, tag) for tag in tags)
        self.state.forget(client, consumer)
        if fetched or restored:
            log.warning(
                "recovered %d unacked and %d fetched message(s) of consumer %s (lease expired) in %.3fs",
                restored, fetched, consumer, time.monotonic() - started,
            )  # fmt: skip

    def restore_owned(self, client: redis.Redis, consumer: str, tag: str) -> bool:
        """Put one unacked message of a dead consumer back in its queue, if that consumer still owns it.

        kombu's restore (`_do_restore_message`: the redelivered flag, the priority list) is worked
        out here, and made in one script call that checks ownership (`WorkerState.restore`): of two
        workers recovering the same consumer one restores the message; a message restored, fetched
        again and recorded by a live consumer (same delivery tag) is the live one's.
        """
        record = client.hget(self.channel.qos.unacked_key, tag)
        pushes = PushRecorder()
        if record is not None:
            message, exchange, routing_key = loads(bytes_to_str(record))
            self.channel._do_restore_message(message, exchange, routing_key, pushes)
            if not pushes.pushes:  # kombu could not work it out (it logged why): keep the record
                log.error("unacked message %s of consumer %s kept: it could not be restored", tag, consumer)
                return False
        return self.state.restore(client, consumer, tag, pushes.pushes)

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
                self.state.requeue(client, self.channel.consumer, queue)
            self.state.release(client, self.channel.consumer)
        except redis.RedisError as exc:
            log.warning("could not release the lease (%s); live workers recover it after %.0fs", exc, self.lease_s)

