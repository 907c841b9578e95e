"""Each consuming channel's lease (`alive` key, TTL TICKETQ_LEASE_S), renewed by a thread of its own.

A lease is a promise of progress: while the classifying loop holds work without progress for
longer than its bound (TICKETQ_WORST_BATCH_S), or the consumer's event loop stops turning or waits
on a fetch reply that never comes (FETCH_STALL_S) — both judged by the process's
`worker.health.Health`, handed in with the `LeaseHolder` — the thread stops renewing and the
channel stops fetching, so live workers take over what it holds once the lease runs out; it renews
again at the first progress, and the late results are published once (the outbox's rules). Every
quarter lease it also runs the recovery of consumers whose lease ran out (`worker.transport.recovery`).

The lease knows its channel only through a `LeaseHolder`, a plain record the channel builds: no
import of the channel, no reach into kombu.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis

from ticketq import connections
from worker.health import Health, Stall
from worker.transport.recovery import Recovery
from worker.transport.state import WorkerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseHolder:
    """What a lease needs of the consuming channel that holds it."""

    consumer: str
    lease_s: float
    state: WorkerState
    connect: Callable[[float], redis.Redis]  # a client on a pool of its own, each command within that many seconds
    queues: Callable[[], Iterable[str]]  # the queues the channel consumes now
    recovery: Recovery
    health: Health  # the process's: the loops' progress (held back while one stalls), Redis's refusals


class Lease(threading.Thread):
    """This consumer's lease, renewed every lease/4 s while both loops make progress, and the
    recovery of consumers whose lease ran out.

    A consumer is recovered only by a worker that has itself held its lease for a full lease
    period since it last (re)connected: after a Redis restart every live worker gets one period to
    renew its lease before anyone counts it dead.
    """

    def __init__(self, holder: LeaseHolder) -> None:
        super().__init__(name="ticketq-lease", daemon=True)
        self.holder = holder
        self.consumer = holder.consumer
        self.lease_s = float(holder.lease_s)
        self.started = time.time()
        self._registered = False  # the consumer is in CONSUMERS_KEY
        self.renewed_at: float | None = None  # monotonic time of the last renewal
        self.lapsed = False  # not renewed for a whole lease period: others may recover this consumer
        self.stall: Stall | None = None  # held back: a loop holds work without progress
        self._queues: set[str] = set()
        self._stopped = threading.Event()

    @property
    def registered(self) -> bool:
        """The consumer is in CONSUMERS_KEY and its lease is not held back: it may fetch."""
        return self._registered and self.stall is None

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)

    def run(self) -> None:
        steady_since: float | None = None
        # Its own pool: kombu disconnects the channel's pools on close, under a running command.
        # Each command within half a lease: cut off, the thread knows its lease is lapsing.
        client = self.holder.connect(max(1.0, self.lease_s / 2))
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
                self.holder.recovery.recover_expired(client, self.queues)
            return steady_since
        except redis.RedisError as exc:
            if not self.holder.health.refusals.refused(exc, "the lease") and steady_since is not None:
                log.warning("lease not renewed, Redis unavailable (%s)", exc)
            self.check_lapse()
            return None

    @property
    def queues(self) -> list[str]:
        """Every queue this channel has consumed (kept after close, which cancels its consumers)."""
        self._queues.update(self.holder.queues())
        return sorted(self._queues)

    def held_back(self) -> bool:
        """Whether a loop is stalled (`Health.stalled`), so that this lease must not be renewed;
        logs once when a stall begins and when it ends."""
        stall = self.holder.health.stalled()
        if stall and not self.stall:
            log.warning(
                "lease of consumer %s no longer renewed: %s has held work for %.1fs without progress (bound %gs, "
                "%s); live workers take over the messages it holds once the lease runs out (%gs), and this "
                "worker fetches nothing until it makes progress again",
                self.consumer, stall.loop, stall.quiet_s, stall.bound_s, stall.setting, self.lease_s,
            )  # fmt: skip
        elif not stall and self.stall:
            log.warning("%s moves again: renewing the lease of consumer %s, fetching resumes",
                        self.stall.loop, self.consumer)  # fmt: skip
        self.stall = stall
        return stall is not None

    def beat(self, client: redis.Redis) -> None:
        info = {"host": socket.gethostname(), "pid": os.getpid(), "queues": self.queues,
                "since": round(self.started, 3)}  # fmt: skip
        new = self.holder.state.beat(client, self.consumer, int(self.lease_s * 1000), json.dumps(info))
        now = time.monotonic()
        if self._registered and (new or self.lapsed):
            gap = now - (self.renewed_at or now)
            if new:
                log.warning(
                    "lease of consumer %s renewed after %.1fs (lease %.0fs): another worker had recovered "
                    "it as dead and answers the messages it held; their acks here are skipped",
                    self.consumer, gap, self.lease_s,
                )  # fmt: skip
            else:  # a beat sent into the partition may have landed late and registered it again
                log.warning("lease of consumer %s renewed after %.1fs (lease %.0fs): other workers may have "
                            "recovered the messages it held meanwhile; its acks of those are skipped",
                            self.consumer, gap, self.lease_s)  # fmt: skip
        self._registered, self.renewed_at, self.lapsed = True, now, False
        self.holder.health.refusals.accepted()

    def check_lapse(self) -> None:
        """Log once when the lease has gone a whole period without renewal."""
        if self.lapsed or self.renewed_at is None or time.monotonic() - self.renewed_at < self.lease_s:
            return
        self.lapsed = True
        log.warning(
            "lease of consumer %s lapsed: not renewed for %.1fs (lease %.0fs); other workers may now "
            "recover the messages it holds, and this worker leaves those to them",
            self.consumer, time.monotonic() - self.renewed_at, self.lease_s,
        )  # fmt: skip

    def release(self, client: redis.Redis) -> None:
        """Clean shutdown: give back what was fetched, drop the lease (kombu restored the unacked)."""
        try:
            for queue in self.queues:
                self.holder.state.requeue(client, self.consumer, queue)
            self.holder.state.release(client, self.consumer)
        except redis.RedisError as exc:
            log.warning("could not release the lease (%s); live workers recover it after %.0fs", exc, self.lease_s)
