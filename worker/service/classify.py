"""The engine call: a job's open slots classified, each forward batch's results published the
moment it is computed, an engine error retried by the policy in `retry`. A publish error is
never an engine error: it stops the job (`PublishFailed`), it is not retried."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ticketq.contract import Reason, TicketRejected
from ticketq.errors import TicketqError
from ticketq.schema import TicketFields
from worker.results import Prediction
from worker.service.answer_cache import CachedAnswers
from worker.service.answers import raw_ticket
from worker.service.hooks import Hook
from worker.service.publish import Publisher
from worker.service.records import Slot, Work
from worker.service.retry import retry_in_halves
from worker.service.routing import Routing


class PublishFailed(TicketqError, RuntimeError):
    """Publishing a forward batch's results failed (Redis away too long): not an engine error to retry."""


class Classify:
    def __init__(self, routing: Routing, publisher: Publisher, hooks: Hook, max_retries: int,
                 cached: CachedAnswers | None = None) -> None:  # fmt: skip
        self.routing, self.publisher, self.hooks, self.max_retries = routing, publisher, hooks, max_retries
        self.cached = cached  # the answer cache, where TICKETQ_ANSWER_CACHE_S keeps computed answers

    def run(self, work: Work, slots: list[Slot], more: Callable[[], list] | None = None) -> None:
        """Classify `slots` (and what `more` adds to them between forwards) and publish their results."""
        if not slots:
            return
        self.hooks.on_compute(slots)
        self._attempt(work, slots, 1, more)

    def _attempt(self, work: Work, slots: list[Slot], attempt: int, more: Callable[[], list] | None = None) -> None:
        def publish(indices: Sequence[int], predictions: list) -> None:
            try:
                self.answered(work, [slots[i] for i in indices], predictions)
            except Exception as exc:  # surfaced as PublishFailed so it is never retried as an engine error
                raise PublishFailed(f"publishing {len(indices)} results failed: {exc!r}") from exc

        try:
            answers = self.routing.classify(self.routing.items(slots), self.hooks.on_forward, publish, more)
        except PublishFailed:
            raise
        except Exception as exc:
            retry = lambda part, n: self._attempt(work, part, n)  # noqa: E731
            give_up = lambda slot, n, error: self._give_up(work, slot, n, error)  # noqa: E731
            retry_in_halves([s for s in slots if s.result is None], attempt, self.max_retries, exc, retry, give_up)
            return
        # A classifier that does not call on_predictions still gets its answers published here.
        rest = [(slot, answer) for slot, answer in zip(slots, answers, strict=True) if slot.result is None]
        if rest:
            self.answered(work, [s for s, _ in rest], [a for _, a in rest])

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
