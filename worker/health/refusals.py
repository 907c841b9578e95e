"""Redis refusing writes, as episodes: one per reason (`Refusals`), shared by every thread of the
process (the outbox, the transport's fetch and acks, the lease), logged once when it begins and
once when it ends, and named by /readyz while it lasts (`Refusals.write_problems`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ticketq.connections import NOT_ENOUGH_REPLICAS, OUT_OF_MEMORY, write_refusal

log = logging.getLogger(__name__)


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


class Refusals:
    """This process's refusal episodes, one per reason, shared by every thread that writes (the
    outbox, the transport's fetch and acks, the lease): built once by the worker's runtime and
    handed to each of them."""

    def __init__(self) -> None:
        self.redis_full = Episode(
            "Redis is full (maxmemory)",
            "fetching paused, results and acks retried until it takes writes again: free memory or raise maxmemory",
            "Redis takes writes again",
        )
        self.too_few_replicas = Episode(
            "Redis refuses writes: not enough replicas (min-replicas-to-write)",
            "fetching paused, results and acks retried until a replica is back",
            "Redis takes writes again: enough replicas",
        )
        self.replicas_behind = Episode(
            "Results not confirmed by the replicas (TICKETQ_REPLICA_ACKS)",
            "their messages stay unacknowledged, the write and its WAIT retried until enough replicas hold them",
            "The replicas confirm results again",
            quiet_s=0.0,  # only result writes end it: an idle worker must not stay not-ready
        )
        self._by_reason = {OUT_OF_MEMORY: self.redis_full, NOT_ENOUGH_REPLICAS: self.too_few_replicas}

    def refused(self, exc: BaseException, what: str) -> bool:
        """True when `exc` is Redis refusing a write (full, too few replicas): its episode begins (logged
        once). False for any other error, which the caller handles as before."""
        episode = self._by_reason.get(write_refusal(exc))
        if episode is None:
            return False
        episode.begin(f"{what} refused ({exc})")
        return True

    def refusing(self, reason: str, what: str) -> bool:
        """`refused` for a reason `ticketq.connections.write_problem` found (no exception to hand)."""
        episode = self._by_reason.get(reason)
        if episode is None:
            return False
        episode.begin(f"{what} waits ({reason})")
        return True

    def accepted(self) -> None:
        """A write that a full or replica-less Redis would refuse went through: refusal episodes end."""
        for episode in self._by_reason.values():
            episode.end()

    def write_problems(self) -> list[str]:
        """The episodes lasting now, for /readyz."""
        return [episode.name for episode in (*self._by_reason.values(), self.replicas_behind) if episode.active]
