"""The scheduler: tickets, each with the engine that computes it, run one planned forward at a time.

An engine is anything with `encode`, `plan` and `forward_batch` (`BatchEngine`): the single-field
`model.Engine`, or one `fields.FieldsEngine` per schema, each with its own cached prefix. Plain
records cross the boundary: `Ticketed` (engine, encoded ticket, key) in, a `Forward` (one
engine's batch) chosen by `schedule`, and a `Step` per forward out: its `BatchReport` and the
answers it finished, keyed by ticket. The step is three calls, made by the loop's owner
(`worker.service.loop` in a worker, `drain` offline): `schedule`, `engine.forward_batch`, `update`.
The scheduler never calls out: arrivals come in through `add`, answers go out as `update` returns.

Each engine carries a precision `policy` (`worker.engine.policy`), and the scheduler consults it
twice: `policy.route(encoded)` when a ticket joins (the engine that computes it first: a fast
precision's float32 twin where the fast answer would likely be wasted), and `policy.screen(engine,
answers)` after a forward. Then two things happen between a forward and its answers going out:

- **Duplicates are computed once.** A ticket encoded exactly as one already in the run, for the
  same engine (the same token ids: the same computation), is not planned; it gets that ticket's
  answer when it has one, under its own key.
- **Unsettled answers are computed again.** A policy may screen an answer as `Unsettled(answer,
  recheck)`: a fast precision's answer within its error bound (`worker.engine.precision`). The
  ticket then waits for `recheck` (a `deferred` engine, float32) and its answer is
  `recheck.settle(fast, exact)`. Re-checks are batched like any other tickets (planned together,
  length-sorted) and run when nothing else waits, or when they fill half a token budget, or once
  the oldest has waited DEFER_FORWARDS other forwards, whichever comes first: that bounds a
  re-checked ticket's wait.

No torch: the scheduler is plain Python over the planner (`batching`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol, TypeVar

from worker.engine.batching import Batch, Plan
from worker.results import BatchReport, RunTally

Answer = TypeVar("Answer", covariant=True)

BatchCallback = Callable[[BatchReport], None]
# on_answers(indices into the run's tickets, their answers): one call per forward (`drain`)
AnswersCallback = Callable[[Sequence[int], Sequence[Any]], None]
MoreCallback = Callable[[], Sequence[object]]  # tickets that arrived since the last call (or the start)


class BatchEngine(Protocol[Answer]):
    """What the scheduler needs of an engine: its tickets encoded, planned and computed a batch at a
    time; `deferred`: its tickets wait to be batched (a re-check, `DeferredEngine`)."""

    deferred: bool

    def encode(self, texts: Sequence[object]) -> list[Any]: ...

    def plan(self, encoded: Sequence[Any]) -> Plan: ...

    def forward_batch(self, tickets: Sequence[Any], width: int | None = None) -> list[Answer]: ...


class Policy(Protocol):
    """How an engine's precision is held to float32's labels (`worker.engine.policy`)."""

    checked: bool  # whether answers may be computed again (a fast precision's twin)

    def route(self, encoded: Any) -> BatchEngine[Any]: ...

    def screen(self, engine: BatchEngine[Any], answers: list) -> list: ...

    def reference(self, text: object) -> Any: ...


class Runner(BatchEngine[Answer], Protocol):
    """An engine a ticket is given to (`Ticketed`): its `policy` routes and screens its tickets."""

    policy: Policy


class Exact:
    """The policy of an engine whose answers are final (float32's, or a fast one's served unchecked):
    it computes its own tickets and every answer is settled."""

    checked = False

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def route(self, encoded: Any) -> Any:
        return self.engine

    def screen(self, engine: Any, answers: list) -> list:
        return answers

    def reference(self, text: object) -> Any:
        return self.engine.reference(text)


class DeferredEngine(BatchEngine[Answer], Protocol):
    """An engine whose tickets are re-checks: batched under half its token budget, each answer
    settling the fast answer it re-checks."""

    max_batch_tokens: int

    def settle(self, fast: Any, exact: Any) -> Answer: ...


class OwnEngine(Runner[Answer], Protocol):
    """An engine that runs its own tickets (`run_planned`): it says whether a run computes duplicates once."""

    dedup: bool


# A deferred engine's tickets run after at most this many other forwards (its latency bound).
DEFER_FORWARDS = 4


class Unsettled(NamedTuple):
    """An answer the engine could not settle: `recheck` computes the ticket again."""

    answer: Any
    recheck: DeferredEngine[Any]


class Ticketed(NamedTuple):
    """A ticket of a run: the engine given it (its policy routes it), the ticket as that engine
    encoded it, and the key its answer comes back under (None: its index in the run)."""

    engine: Runner[Any]
    encoded: Hashable
    key: Hashable = None


@dataclass(frozen=True)
class Forward:
    """The next forward the scheduler chose: one engine's batch (indices into the run's tickets)."""

    engine: BatchEngine[Any]
    batch: Batch
    tickets: tuple[Any, ...]


class Step(NamedTuple):
    """What one forward finished: its report, and the answers of the tickets it settled (copies
    included), by key."""

    report: BatchReport
    answers: dict[Hashable, Any]


class PlannedRun:
    """Tickets of one or more engines, run one planned forward at a time.

    Each engine's waiting tickets are planned together (`engine.plan`); a forward holds one
    engine's tickets only. The next forward is the next one planned for the engine whose oldest
    waiting ticket came first, so no schema waits behind another's stream of arrivals. Tickets
    added between forwards join their engine's waiting ones and those are planned again: every
    forward is chosen from everything waiting at its start.

    Cost: an `add` replans each joining engine's waiting tickets (`batching.plan_optimal`,
    O(waiting x max_batch_size)); `schedule` scans the waiting batches, O(waiting). At worst
    (tickets arriving one per forward) a run of n tickets replans n times. A duplicate costs one
    dict lookup; an unsettled answer replans its re-check engine's waiting tickets.
    """

    def __init__(self, dedup: bool = True, runs: RunTally | None = None) -> None:
        self.dedup = dedup  # duplicates computed once (TICKETQ_DEDUP)
        self.runs = runs if runs is not None else RunTally()  # the worker's tally (its metrics read it)
        self.encoded: list[Any] = []
        self.keys: list[Hashable] = []  # index -> the key its answer goes out under
        self.results: list[Any] = []
        self.reports: list[BatchReport] = []
        self._plans: dict[int, tuple[BatchEngine[Any], list[Batch]]] = {}  # id(engine) -> its batches
        self._twins: dict[tuple[int, Hashable], int] = {}  # (engine, ticket) -> the index that computes it
        self._followers: dict[int, list[int]] = {}  # an index computed -> the duplicates waiting for its answer
        self._first_of: dict[int, int] = {}  # a duplicate's index -> the index that computes it
        self._fast: dict[int, Any] = {}  # index -> the fast answer its re-check will settle
        self._forwards = 0  # forwards run so far
        self._deferred_since: dict[int, int] = {}  # id(deferred engine) -> forwards run when its oldest joined
        self._policies: dict[int, Policy] = {}  # id(engine) -> the policy that routed tickets to it
        self._straight: set[int] = set()  # engines a policy routed tickets to in place of the one given
        self.duplicates = 0  # tickets answered with another's answer, not computed
        self.rechecked = 0  # tickets computed again by a deferred engine

    def add(self, tickets: Sequence[Ticketed], plan: Plan | None = None) -> dict[Hashable, Any]:
        """Tickets (engine, encoded, key) join the run, indexed after those before them. `plan`: the
        plan of the first tickets of a one-engine run (indices into `tickets`), else planned here.
        Returns the answers of copies of tickets already answered, by key."""
        start = len(self.encoded)
        joining: dict[int, list[int]] = {}
        copies: list[int] = []
        for index, (given, encoded, key) in enumerate(tickets, start):
            engine = given.policy.route(encoded)
            self._policies.setdefault(id(engine), given.policy)
            if engine is not given:
                self._straight.add(id(engine))
                plan = None  # the given plan was the given engine's
            self.encoded.append(encoded)
            self.keys.append(index if key is None else key)
            self.results.append(None)
            first = self._twins.setdefault((id(engine), encoded), index) if self.dedup else index
            if first != index:  # the same computation as a ticket already in the run
                self._followers.setdefault(first, []).append(index)
                self._first_of[index] = first
                copies.append(index)
                continue
            joining.setdefault(id(engine), []).append(index)
            self._plans.setdefault(id(engine), (engine, []))
        if copies:
            self.duplicates += len(copies)
            self.runs.add(deduplicated=len(copies))
            plan = None  # the given plan's indices counted the copies
        for key, indices in joining.items():
            self._replan(key, indices, plan if len(joining) == 1 else None)
        # a copy of a ticket already answered gets that answer now
        return self._answer([], [i for i in copies if self.results[self._first_of[i]] is not None])

    def _replan(self, key: int, indices: list[int], plan: Plan | None = None) -> None:
        """Plan `indices` with the engine `key`'s waiting tickets (`plan`: theirs, where none wait)."""
        engine, batches = self._plans[key]
        if plan is not None and not batches:
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
        undeferred = any(not self._plans[key][0].deferred for key in oldest)
        ready = {key: index for key, index in oldest.items() if self._ready(key, undeferred)}
        key = min(ready, key=ready.__getitem__)
        engine, batches = self._plans[key]
        batch = batches.pop(0)
        if not batches:
            self._deferred_since.pop(key, None)
        return Forward(engine, batch, tuple(self.encoded[i] for i in batch.indices))

    def _ready(self, key: int, others_wait: bool) -> bool:  # others_wait: an engine not deferred has tickets
        """Whether engine `key` may run now: any engine not deferred; a deferred one when nothing else
        waits, its tickets fill half its token budget, or its oldest has waited DEFER_FORWARDS forwards."""
        engine, batches = self._plans[key]
        if not engine.deferred or not others_wait:
            return True
        waiting = sum(b.rows * b.width for b in batches)
        budget = engine.max_batch_tokens  # a deferred engine is a DeferredEngine
        return waiting * 2 >= budget or self._forwards - self._deferred_since.get(key, self._forwards) >= DEFER_FORWARDS

    def update(self, forward: Forward, answers: Sequence[Any], seconds: float) -> Step:
        """Record a computed forward's answers; returns its report and the answers it settled, by key."""
        batch, engine = forward.batch, forward.engine
        report = BatchReport(batch.rows, batch.width, batch.real_tokens, seconds, recheck=engine.deferred,
                             straight=id(engine) in self._straight)  # fmt: skip
        if not engine.deferred:
            answers = self._policies[id(engine)].screen(engine, list(answers))
        self._forwards += 1
        settled, unsettled = [], {}
        for index, answer in zip(batch.indices, answers, strict=True):
            if isinstance(answer, Unsettled):
                self._fast[index] = answer.answer
                unsettled.setdefault(id(answer.recheck), (answer.recheck, []))[1].append(index)
                continue
            if engine.deferred and index in self._fast:
                answer = engine.settle(self._fast.pop(index), answer)
                self.rechecked += 1
                self.runs.add(rechecked=1)
            self.results[index] = answer
            settled.append(index)
        for key, (recheck, indices) in unsettled.items():
            self._plans.setdefault(key, (recheck, []))
            self._deferred_since.setdefault(key, self._forwards)
            self._replan(key, indices)
        self.reports.append(report)
        return Step(report, self._answer(settled, [i for first in settled for i in self._followers.get(first, ())]))

    def forwards(self, forward: Forward, indices: Sequence[int]) -> list[Forward]:
        """`indices` (some of `forward`'s tickets) planned alone on its engine: the forwards that
        compute them again after `forward` failed (the caller's retry), outside the run's plans."""
        engine = forward.engine
        plan = engine.plan([self.encoded[i] for i in indices])
        return [Forward(engine, replace(b, indices=tuple(indices[j] for j in b.indices)),
                        tuple(self.encoded[indices[j]] for j in b.indices)) for b in plan.batches]  # fmt: skip

    def give_up(self, index: int) -> list[Hashable]:
        """Ticket `index` will not be computed: the keys of it and of the copies waiting for it."""
        self._fast.pop(index, None)
        # a copy arriving later is computed, not left waiting for this one
        self._twins = {ticket: first for ticket, first in self._twins.items() if first != index}
        return [self.keys[i] for i in (index, *self._followers.pop(index, ()))]

    def _answer(self, computed: list[int], copies: list[int]) -> dict[Hashable, Any]:
        """`computed` tickets' answers, and those of their waiting `copies`, by key."""
        for index in copies:
            self.results[index] = self.results[self._first_of[index]]
        return {self.keys[i]: self.results[i] for i in computed + copies}


def drain(run: PlannedRun, on_batch: BatchCallback | None = None, on_answers: AnswersCallback | None = None,
          more: Callable[[], Sequence[Ticketed]] | None = None) -> tuple[list[Any], list[BatchReport]]:  # fmt: skip
    """The offline loop (the CLI, the bench, the tests): every forward until nothing waits, `more()`
    asked before the first and after each one. Returns the answers in ticket order, and one
    report per forward. A worker's loop is `worker.service.loop`, which publishes as it goes."""
    while True:
        _tell(on_answers, run.add(more() if more else ()))  # arrivals: the next forward sees them too
        forward = run.schedule()
        if forward is None:
            break
        start = time.perf_counter()
        answers = forward.engine.forward_batch(forward.tickets, width=forward.batch.width)
        step = run.update(forward, answers, time.perf_counter() - start)
        if on_batch:
            on_batch(step.report)
        _tell(on_answers, step.answers)
    assert all(r is not None for r in run.results), "the plan must cover every ticket"
    return run.results, run.reports


def _tell(on_answers: AnswersCallback | None, answers: dict[Hashable, Any]) -> None:
    if answers and on_answers:
        on_answers(list(answers), list(answers.values()))


def run_planned(engine: OwnEngine[Answer], encoded: Sequence[Any], plan: Plan | None,
                on_batch: BatchCallback | None, on_answers: AnswersCallback | None,
                more: MoreCallback | None) -> tuple[list[Answer], list[BatchReport]]:  # fmt: skip
    """`drain` of one engine's tickets: `plan` (default `engine.plan(encoded)`) one forward at a time;
    between two forwards, tickets `more()` returns join the ones not yet computed and the rest is
    planned again. Answers come back in the order of `encoded` then of the arrivals."""
    run = PlannedRun(dedup=engine.dedup)
    run.add([Ticketed(engine, e) for e in encoded], plan)
    arrivals = None
    if more is not None:
        def arrivals() -> list[Ticketed]:
            texts = more()
            return [Ticketed(engine, e) for e in engine.encode(texts)] if texts else []
    return drain(run, on_batch, on_answers, arrivals)


class Offline:
    """`classify` for an engine that runs its own tickets (`run_planned`): the CLI, the bench, the tests."""

    def classify(self: Any, texts: Sequence[object], plan: Plan | None = None, on_batch: BatchCallback | None = None,
                 on_answers: AnswersCallback | None = None,
                 more: MoreCallback | None = None) -> tuple[list[Any], list[BatchReport]]:  # fmt: skip
        """`texts` answered in their order through the planned, cached path: one report per forward.

        `on_answers(indices, answers)` gets each forward's answers as soon as it is computed (indices
        into `texts`), so a caller can publish them without waiting for the rest of the plan. `more()`,
        asked before the first forward and after every one, returns tickets that arrived meanwhile:
        they join the ones not yet computed and the rest is planned again, so every forward is chosen
        from everything waiting at its start. Their indices follow `texts` (the first returned is
        `len(texts)`), and so do their answers."""
        return self.classify_encoded(self.encode(texts), plan, on_batch, on_answers, more)

    def classify_encoded(self: Any, encoded: Sequence[Any], plan: Plan | None = None,
                         on_batch: BatchCallback | None = None, on_answers: AnswersCallback | None = None,
                         more: MoreCallback | None = None) -> tuple[list[Any], list[BatchReport]]:  # fmt: skip
        return run_planned(self, encoded, plan, on_batch, on_answers, more)
