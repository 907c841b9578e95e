"""Whether the worker's two loops move: the records its lease is a promise of.

The worker's runtime builds one record per loop (`worker.health.Health`). The service marks the
classifying one through its progress hook (`worker.service.hooks.progress`): a job begins
(work in hand), a forward batch is computed, its results are out, the job ends (nothing in hand).
The lease thread (`worker.transport.lease`) stops renewing while it is stalled, so live workers
take over the messages this worker holds;
`/readyz` and `ticketq_classifying_stalled_seconds` say so. Standard library only: the service
and the transport both import it, neither through the other.

Stalled means work in hand and no progress for longer than the bound the job began with
(TICKETQ_WORST_BATCH_S): the worst a forward batch and its publish may take. A worker with no work
in hand is idle, never stalled. Cost: a tuple stored per mark, read by the lease thread every
quarter lease and by each scrape.

The fetching side is judged the same way (`Health.fetching`, marked by the transport's consuming channel,
`worker.transport.fetch`): from its first fetch to its close it is in hand, and every turn of the
event loop that finds no fetch reply overdue is progress. A loop blocked in a Redis command, or a
fetch whose reply never comes (a half-open connection), stalls it after FETCH_STALL_S.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

# Seconds the consumer's event loop may go without a turn that finds its fetch healthy. The loop
# turns at least once a second when idle, and a fetch blocks in Redis for 1 s (kombu's
# brpop_timeout): five missed turns are a stuck loop, not a slow one.
FETCH_STALL_S = 5.0


class Progress:
    """One classifying loop's last progress: (work in hand since, last progress, bound), monotonic
    seconds, replaced whole at each mark so a reader on another thread never sees half of one."""

    def __init__(self) -> None:
        self._state: tuple[float | None, float, float] = (None, 0.0, math.inf)

    def begin(self, bound_s: float) -> None:
        """Work is in hand from now; stalled once no progress comes for longer than `bound_s`."""
        now = time.monotonic()
        self._state = (now, now, bound_s)

    def advanced(self) -> None:
        """A forward batch was computed, or its results are out."""
        since, _, bound = self._state
        if since is not None:
            self._state = (since, time.monotonic(), bound)

    def end(self) -> None:
        """Nothing in hand: idle, never stalled."""
        self._state = (None, 0.0, math.inf)

    def stalled_for(self) -> float:
        """Seconds since the last progress while work is in hand and that is past the bound; else 0."""
        since, last, bound = self._state
        quiet = time.monotonic() - last
        return quiet if since is not None and quiet > bound else 0.0

    @property
    def bound_s(self) -> float:
        """The bound of the work in hand (inf when idle)."""
        return self._state[2]


@dataclass(frozen=True)
class Stall:
    """A loop that holds work without progress past its bound, for logs and /readyz."""

    name: str  # "classifying" or "fetching"
    quiet_s: float
    bound_s: float
    setting: str  # what sets the bound

    @property
    def loop(self) -> str:
        return f"the {self.name} loop"

    def __str__(self) -> str:
        return (f"{self.name} stalled for {self.quiet_s:.0f} s (work in hand, no progress for longer than "
                f"{self.setting}={self.bound_s:g}s)")
