"""Whether the classifying loop moves: the record its lease is a promise of.

The service marks it through its progress hook (`worker.service.hooks.progress`): a job begins
(work in hand), a forward batch is computed, its results are out, the job ends (nothing in hand).
The lease thread (`worker.transport.lease`) stops renewing while it is stalled, so live workers
take over the messages this worker holds;
`/readyz` and `ticketq_classifying_stalled_seconds` say so. Standard library only: the service
and the transport both import it, neither through the other.

Stalled means work in hand and no progress for longer than the bound the job began with
(TICKETQ_WORST_BATCH_S): the worst a forward batch and its publish may take. A worker with no work
in hand is idle, never stalled. Cost: a tuple stored per mark, read by the lease thread every
quarter lease and by each scrape.
"""

from __future__ import annotations

import math
import time


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


# The worker's one classifying loop (concurrency 1: one model thread per process).
CLASSIFYING = Progress()
