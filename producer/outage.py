"""Riding out a Redis that went away (a restart, a Sentinel failover) while sending or waiting.

Cost: one pause per try, from RECONNECT_PAUSE_S[0] doubling up to RECONNECT_PAUSE_S[1], and one
try of what failed after each. Worst case: `limit_s` (`Producer(retry_for_s=...)`, RETRY_FOR_S by
default) of pauses before giving up, or less when the wait's deadline comes first.
"""

from __future__ import annotations

import logging
import time

from producer.errors import BrokerUnavailable

log = logging.getLogger(__name__)

RECONNECT_PAUSE_S = (0.1, 2.0)  # while Redis is away: the first pause before asking again, the longest
# How long sending and waiting ask a Redis that went away again (a Sentinel promotion takes a few seconds)
RETRY_FOR_S = 30.0


class Outage:
    """While Redis cannot be reached (sending, or waiting for results): how long to pause before
    asking again, until the wait's `deadline` or `limit_s` into the outage, whichever comes first."""

    def __init__(self, doing: str, deadline: float | None, limit_s: float, refusals: bool = True,
                 met: str = "lost Redis") -> None:  # fmt: skip
        """`refusals`: a Redis refusing writes (full, too few replicas) is waited out too. `met`: what
        the first line says happened (`met while doing`)."""
        self.doing, self.deadline, self.limit_s, self.refusals = doing, deadline, limit_s, refusals
        self.met = met
        self.pause, self.since = RECONNECT_PAUSE_S[0], None
        self.gave_up: BrokerUnavailable | None = None  # the error, once `limit_s` passed

    def ride_out(self, error: BaseException, raises: bool = True) -> bool:
        """Pause before the next try: True. False when the deadline or the limit leaves no time
        for one (`gave_up` is set past the limit), or when asking again cannot help (refused
        credentials; a refused write when `refusals` is off), which raises `error` at once unless
        `raises` is off."""
        if not is_lost_connection(error) or (not self.refusals and error.write_refused):
            if raises:
                raise error
            return False
        if self.limit_s <= 0:  # no time to ask again: nothing to say, the caller reports `error`
            self.gave_up = error
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning("%s while %s (%s); trying again for up to %g s", self.met, self.doing,
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


def is_lost_connection(error: BaseException) -> bool:
    """Worth asking again: Redis went away (a restart, a failover) or refuses writes for now (full,
    too few replicas), as the worker's outbox rides them out; refused credentials are not."""
    return isinstance(error, BrokerUnavailable) and not error.refused
