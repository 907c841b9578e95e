"""The scheduler: tickets, each with the engine that computes it, run one planned forward at a time.

An engine is anything with `encode`, `plan` and `forward_batch` (`BatchEngine`): the single-field
`model.Engine`, or one `fields.FieldsEngine` per schema, each with its own cached prefix. Plain
records cross the boundary: `Ticketed` (engine, encoded ticket) in, a `Forward` (one engine's
batch) chosen by `schedule`, the engine's answers and a `BatchReport` per forward out. The step
loop is three calls: `schedule`, `engine.forward_batch`, `finish`.

No torch: the scheduler is plain Python over the planner (`batching`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, TypeVar

from worker.engine.batching import Batch, Plan
from worker.engine.prompt import EncodedTicket
from worker.results import BatchReport

Answer = TypeVar("Answer", covariant=True)

BatchCallback = Callable[[BatchReport], None]
# on_answers(indices into the run's tickets, their answers): one call per forward
AnswersCallback = Callable[[Sequence[int], Sequence[Any]], None]
MoreCallback = Callable[[], Sequence[object]]  # tickets that arrived since the last call (or the start)


class BatchEngine(Protocol[Answer]):
    """What the scheduler needs of an engine: its tickets encoded, planned and computed a batch at a time."""

    def encode(self, texts: Sequence[object]) -> list[EncodedTicket]: ...

    def plan(self, encoded: Sequence[EncodedTicket]) -> Plan: ...

    def forward_batch(self, tickets: Sequence[EncodedTicket], width: int | None = None) -> list[Answer]: ...


class Ticketed(NamedTuple):
    """A ticket of a run: the engine that computes it and the ticket as that engine encoded it."""

    engine: BatchEngine[Any]
    encoded: EncodedTicket


@dataclass(frozen=True)
class Forward:
    """The next forward the scheduler chose: one engine's batch (indices into the run's tickets)."""

    engine: BatchEngine[Any]
    batch: Batch
    tickets: tuple[EncodedTicket, ...]


def run_planned(engine: BatchEngine[Answer], encoded: Sequence[EncodedTicket], plan: Plan | None,
                on_batch: BatchCallback | None, on_answers: AnswersCallback | None,
                more: MoreCallback | None) -> tuple[list[Answer], list[BatchReport]]:  # fmt: skip
    """Run `plan` (default `engine.plan(encoded)`) one forward at a time; between two forwards,
    tickets `more()` returns join the ones not yet computed and the rest is planned again. Answers
    come back in the order of `encoded` then of the arrivals."""
    run = PlannedRun(on_batch, on_answers)
    run.add([Ticketed(engine, e) for e in encoded], plan)
    arrivals = None
    if more is not None:
        def arrivals() -> list[Ticketed]:
            texts = more()
            return [Ticketed(engine, e) for e in engine.encode(texts)] if texts else []
    return run.run(arrivals)


class PlannedRun:
    """Tickets of one or more engines, run one planned forward at a time.

    Each engine's waiting tickets are planned together (`engine.plan`); a forward holds one
    engine's tickets only. The next forward is the next one planned for the engine whose oldest
    waiting ticket came first, so no schema waits behind another's stream of arrivals. Tickets
    added between forwards join their engine's waiting ones and those are planned again: every
    forward is chosen from everything waiting at its start.

    Cost: an `add` replans each joining engine's waiting tickets (`batching.plan_optimal`,
    O(waiting x max_batch_size)); `schedule` scans the waiting batches, O(waiting). At worst
    (tickets arriving one per forward) a run of n tickets replans n times.
    """

    def __init__(self, on_batch: BatchCallback | None = None, on_answers: AnswersCallback | None = None) -> None:
        self.on_batch, self.on_answers = on_batch, on_answers
        self.encoded: list[EncodedTicket] = []
        self.results: list[Any] = []
        self.reports: list[BatchReport] = []
        self._plans: dict[int, tuple[BatchEngine[Any], list[Batch]]] = {}  # id(engine) -> its batches

    def add(self, tickets: Sequence[Ticketed], plan: Plan | None = None) -> None:
        """Tickets (engine, encoded) join the run, indexed after those before them. `plan`: the
        plan of the first tickets of a one-engine run (indices into `tickets`), else planned here."""
        start = len(self.encoded)
        joining: dict[int, list[int]] = {}
        for index, (engine, encoded) in enumerate(tickets, start):
            self.encoded.append(encoded)
            self.results.append(None)
            joining.setdefault(id(engine), []).append(index)
            self._plans.setdefault(id(engine), (engine, []))
        for key, indices in joining.items():
            engine, batches = self._plans[key]
            if plan is not None and not batches and len(joining) == 1:
                given = plan.batches
            else:
                indices = [i for batch in batches for i in batch.indices] + indices
                given = engine.plan([self.encoded[i] for i in indices]).batches
            self._plans[key] = (engine, [replace(b, indices=tuple(indices[j] for j in b.indices)) for b in given])

    def schedule(self) -> Forward | None:
        """The next forward: the next batch of the engine whose oldest waiting ticket came first (None: none waits)."""
        oldest = {key: min(i for b in batches for i in b.indices) for key, (_, batches) in self._plans.items()
                  if batches}  # fmt: skip
        if not oldest:
            return None
        engine, batches = self._plans[min(oldest, key=oldest.__getitem__)]
        batch = batches.pop(0)
        return Forward(engine, batch, tuple(self.encoded[i] for i in batch.indices))

    def finish(self, forward: Forward, answers: Sequence[Any], seconds: float) -> BatchReport:
        """Record a computed forward's answers and report, and tell the callbacks."""
        batch = forward.batch
        report = BatchReport(batch.rows, batch.width, batch.real_tokens, seconds)
        for index, answer in zip(batch.indices, answers, strict=True):
            self.results[index] = answer
        self.reports.append(report)
        if self.on_batch:
            self.on_batch(report)
        if self.on_answers:
            self.on_answers(batch.indices, answers)
        return report

    def run(self, more: Callable[[], Sequence[Ticketed]] | None = None) -> tuple[list[Any], list[BatchReport]]:
        """Every forward until nothing waits; `more()` is asked before the first and after each one.
        Returns the answers in ticket order, and one report per forward."""
        self.add(more() if more else ())  # what came while the caller set up: the first forward sees it too
        while (forward := self.schedule()) is not None:
            start = time.perf_counter()
            answers = forward.engine.forward_batch(forward.tickets, width=forward.batch.width)
            self.finish(forward, answers, time.perf_counter() - start)
            self.add(more() if more else ())
        assert all(r is not None for r in self.results), "the plan must cover every ticket"
        return self.results, self.reports
