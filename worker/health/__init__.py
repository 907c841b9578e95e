"""What this worker process knows of its own health, below every other worker layer.

- `progress` — whether the classifying and fetching loops move: the service and the transport
  mark them, the lease holds back while one is stalled.
- `refusals` — Redis refusing writes (full, too few replicas, results not on the replicas), as
  episodes shared by every thread: the outbox, the transport's fetch and acks, the lease.
- `data_loss` — Redis found without its data, as this process noticed it.

`Health` holds one of each: the worker's runtime builds it once and hands it to every reader and
writer through its constructor (the service's progress hook, the outbox, the consuming channel and
its lease, the metrics, `/readyz`), so no module keeps process-wide state and a test builds its own.
Standard library and `ticketq` only: the transport, the Redis store, the service and the metrics
all import these records, none through another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.health.data_loss import DataLoss
from worker.health.progress import FETCH_STALL_S, Progress, Stall
from worker.health.refusals import Refusals

__all__ = ["FETCH_STALL_S", "DataLoss", "Health", "Progress", "Refusals", "Stall"]


@dataclass(frozen=True)
class Health:
    """One worker process's health: its two loops' progress, Redis's refusals, data lost."""

    classifying: Progress = field(default_factory=Progress)  # the one classifying loop (concurrency 1)
    fetching: Progress = field(default_factory=Progress)  # the consuming channel's event loop
    refusals: Refusals = field(default_factory=Refusals)
    data_loss: DataLoss = field(default_factory=DataLoss)

    def stalls(self) -> list[Stall]:
        """Each of the two loops that is stalled now (what /readyz names)."""
        found = []
        for name, progress, setting in (("classifying", self.classifying, "TICKETQ_WORST_BATCH_S"),
                                        ("fetching", self.fetching, "FETCH_STALL_S")):  # fmt: skip
            quiet = progress.stalled_for()
            if quiet:
                found.append(Stall(name, quiet, progress.bound_s, setting))
        return found

    def stalled(self) -> Stall | None:
        """The stall the lease is held back for, or None. Never while Redis refuses writes or the
        replicas lag (`Refusals.write_problems`): the loops then wait on Redis by design, with no
        deadline, and any worker taking their messages over would wait the same way."""
        if self.refusals.write_problems():
            return None
        return next(iter(self.stalls()), None)

    def problems(self) -> list[str]:
        """Why this process is not ready, as far as its health knows: refused writes, stalled loops."""
        return [*self.refusals.write_problems(), *(str(stall) for stall in self.stalls())]

    def __json__(self) -> dict[str, list[str]]:
        """What Celery's `inspect stats` shows of it: it travels in the broker's transport options,
        which the stats reply serialises with kombu's JSON (an object it cannot encode drops the reply)."""
        return {"problems": self.problems()}
