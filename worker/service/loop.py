"""The classifying loop: the service owns the step, as vLLM's `EngineCore.step` does.

One job's open slots, and what its arrivals add between forwards, go round

    admit what arrived -> scheduler.add -> scheduler.schedule() -> engine.forward_batch
    -> scheduler.update(...) -> publish the answers it finished, keyed by slot -> hooks

until nothing waits. The scheduler (`worker.engine.scheduler.PlannedRun`) and the engine only
compute and return plain records; nothing below calls back into the service. An engine error
fails one forward: its tickets are retried in halves (`retry`), each half planned and run as
forwards of its own, while every other forward goes on. A publish error is never an engine
error: it stops the job (`PublishFailed`), it is not retried.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping

from ticketq.contract import Reason, TicketRejected
from ticketq.errors import TicketqError
from ticketq.schema import TicketFields
from worker.engine.scheduler import Forward, PlannedRun
from worker.results import Prediction, RunTally
from worker.service.answer_cache import CachedAnswers
from worker.service.answers import raw_ticket
from worker.service.hooks import Hook
from worker.service.publish import Publisher
from worker.service.records import Slot, Work
from worker.service.retry import retry_in_halves
from worker.service.routing import Routing

Arrivals = Callable[[], list[Slot]]  # slots admitted since the last call, to compute in this job


class PublishFailed(TicketqError, RuntimeError):
    """Publishing a forward batch's results failed (Redis away too long): not an engine error to retry."""


class Loop:
    def __init__(self, routing: Routing, publisher: Publisher, hooks: Hook, max_retries: int,
                 cached: CachedAnswers | None = None, runs: RunTally | None = None) -> None:  # fmt: skip
        self.routing, self.publisher, self.hooks, self.max_retries = routing, publisher, hooks, max_retries
        self.cached = cached  # the answer cache, where TICKETQ_ANSWER_CACHE_S keeps computed answers
        self.runs = runs  # the worker's tally of duplicates and re-checks (None: the run keeps its own)

    def run(self, work: Work, slots: list[Slot], arrivals: Arrivals | None = None) -> None:
        """Classify `slots`, and what `arrivals()` brings before each forward, publishing each
        forward's answers as it finishes."""
        if not slots:
            return
        run = PlannedRun(dedup=self.routing.classifier.dedup, runs=self.runs)
        self._add(work, run, slots)
        while True:
            if arrivals is not None:
                self._add(work, run, arrivals())
            forward = run.schedule()
            if forward is None:
                return
            self._step(work, run, forward, 1)

    def _add(self, work: Work, run: PlannedRun, slots: list[Slot]) -> None:
        if slots:
            self.hooks.on_compute(slots)
            self._publish(work, run.add(self.routing.ticketed(slots)))

    def _step(self, work: Work, run: PlannedRun, forward: Forward, attempt: int) -> None:
        """One forward computed and its answers published; on an engine error, its tickets retried."""
        start = time.perf_counter()
        try:
            answers = forward.engine.forward_batch(forward.tickets, width=forward.batch.width)
        except Exception as exc:
            def retry(part: list[int], n: int) -> None:
                for again in run.forwards(forward, part):
                    self._step(work, run, again, n)

            def give_up(index: int, n: int, error: Exception) -> None:
                for slot in run.give_up(index):
                    self._give_up(work, slot, n, error)

            retry_in_halves(list(forward.batch.indices), attempt, self.max_retries, exc, retry, give_up)
            return
        step = run.update(forward, answers, time.perf_counter() - start)
        self.hooks.on_forward(step.report)
        self._publish(work, step.answers)

    def _publish(self, work: Work, answers: Mapping[Hashable, Prediction | TicketFields]) -> None:
        if not answers:
            return
        try:
            self.answered(work, list(answers), list(answers.values()))
        except Exception as exc:  # surfaced as PublishFailed so it is never taken for an engine error
            raise PublishFailed(f"publishing {len(answers)} results failed: {exc!r}") from exc

    def answered(self, work: Work, slots: list[Slot], answers: list[Prediction | TicketFields],
                 computed: bool = True) -> None:  # fmt: skip
        """One forward batch is computed (or its answers were cached: not `computed`): its results go out now."""
        now, build = time.time(), self.publisher.answers.answer
        for slot, answer in zip(slots, answers, strict=True):
            slot.result = build(slot, answer, now)
            self.hooks.on_answer(slot, answer)
        self.publisher.publish(work, slots)
        if computed and self.cached is not None:
            self.cached.remember(slots, answers)

    def _give_up(self, work: Work, slot: Slot, attempt: int, exc: Exception) -> None:
        rejection = TicketRejected(Reason.ENGINE_ERROR, f"{type(exc).__name__}: {exc} (after {attempt} attempts)")
        slot.result = self.publisher.reject(slot, raw_ticket(slot.ticket), rejection)
        self.publisher.publish(work, [slot])
