"""The job: one drained buffer of Celery requests (and what the feed adds while it runs) through
the stages — admission, the classifying loop (`loop`), publish — with the last line of defence
around each run.

Celery-free by design (requests only need `.id`, `.args` and optionally `.request_dict`): the
glue in `worker.app` hands each buffer to `TicketService.process`, which never raises — every
request ends marked done or failed by us, because whatever a job has not acknowledged when the
batch function returns is acked then, whatever happened (a raised exception would lose every
result).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ticketq.dead_letters import dead_letter_bound
from worker.redis.answer_cache import AnswerCache
from worker.results import RunTally
from worker.service.admission import Admission
from worker.service.answer_cache import CachedAnswers
from worker.service.answers import Answers
from worker.service.failing import Defence
from worker.service.hooks import Hook, Hooks
from worker.service.loop import Loop
from worker.service.ports import Backend, Classifier, Feed, Outbox
from worker.service.publish import Publisher
from worker.service.records import Deliveries, Slot, Work
from worker.service.routing import Routing
from worker.settings import Settings


class TicketService:
    """One worker's pipeline: a classifier, the outbox its results go out through, and its hooks."""

    def __init__(self, settings: Settings, classifier: Classifier, outbox: Outbox,
                 hooks: Iterable[Hook] = (), routing: Routing | None = None,
                 cache: AnswerCache | None = None, runs: RunTally | None = None) -> None:  # fmt: skip
        """`hooks` observe the pipeline (`worker.service.hooks`); `routing` the schemas served
        (built from TICKETQ_SCHEMAS on `classifier` when not given); `cache` the answer cache
        (TICKETQ_ANSWER_CACHE_S), None: every ticket computed; `runs` the worker's tally of
        duplicates and re-checks (its metrics read it)."""
        self.settings, self.classifier, self.outbox = settings, classifier, outbox
        self.hooks = Hooks(hooks)
        self.routing = routing or Routing.of(classifier, settings)
        self.answers = Answers(settings, classifier)
        self.publisher = Publisher(outbox, self.answers, self.hooks, dead_letter_bound(settings.max_ticket_bytes))
        self.admission = Admission(settings, outbox, self.routing, self.publisher)
        self.cached = CachedAnswers(cache, self.routing, classifier, settings) if cache is not None else None
        self.loop = Loop(self.routing, self.publisher, self.hooks, settings.max_retries, self.cached, runs)
        self.defence = Defence(outbox, self.publisher, self.hooks, settings.worst_batch_s)
        self.job_limit = 4 * settings.effective_prefetch  # tickets one job takes in before it ends

    def process(self, requests: Sequence[Any], backend: Backend, feed: Feed | None = None) -> None:
        """Classify and publish one buffer (and what `feed` adds while it runs); never raises (see
        module docstring). Work is in hand meanwhile (`on_job_start` to `on_job_end`)."""
        self.hooks.on_job_start()
        try:
            deliveries = self._split_or_fail(requests, backend, feed)
            if deliveries is None:
                return
            fresh, redelivered = deliveries
            self._guarded(fresh, backend, feed, lambda work: self._run_batch(work, fresh, redelivered))
            for request in redelivered:
                self._guarded([request], backend, feed, lambda work, request=request: self._run_alone(work, request))
        finally:
            self.hooks.on_job_end()

    def _guarded(self, requests: Sequence[Any], backend: Backend, feed: Feed | None,
                 run: Callable[[Work], None]) -> None:  # fmt: skip
        """`run` on a new Work for `requests`; on an unexpected error fail what it has not finished."""
        if not requests:
            return
        work: Work | None = None
        try:
            work = Work(backend, time.time(), feed)
            run(work)
        except Exception as exc:  # last line of defence: what is already published stays published
            self.defence.fail_batch(requests if work is None else work.unfinished(), backend, exc, feed)
            if work is not None:
                self.defence.settle_unconfirmed(work, exc)

    def _run_batch(self, work: Work, requests: Sequence[Any], redelivered: list[Any]) -> None:
        """First deliveries as one batch; arrivals through the feed join it between forwards (the
        redelivered among them are appended to `redelivered`, to run alone after)."""
        arrivals = self._arrivals(work, redelivered) if work.feed is not None else None
        self.loop.run(work, self._admit(work, requests), arrivals)

    def _run_alone(self, work: Work, request: Any) -> None:
        """A redelivered message, alone, its delivery counted now: past max_retries it is dead-lettered."""
        if not self.admission.too_many_deliveries(request, work.backend):
            self.loop.run(work, self._admit(work, [request]))

    def _admit(self, work: Work, requests: Sequence[Any]) -> list[Slot]:
        """Admit `requests` into `work`; refused and expired tickets are answered now. Returns the
        slots to classify."""
        slots = self.admission.admit(work, requests)
        self.publisher.publish(work, [s for s in slots if s.result is not None])
        return self._from_cache(work, [s for s in slots if s.result is None])

    def _from_cache(self, work: Work, slots: list[Slot]) -> list[Slot]:
        """Answer the slots the answer cache knows; the others, to compute."""
        if self.cached is None or not slots:
            return slots
        known = self.cached.lookup(slots)
        hits = [(slot, answer) for slot, answer in zip(slots, known, strict=True) if answer is not None]
        self.hooks.on_cache_lookup(len(hits), len(slots) - len(hits))
        if hits:
            self.loop.answered(work, [slot for slot, _ in hits], [answer for _, answer in hits], computed=False)
        return [slot for slot, answer in zip(slots, known, strict=True) if answer is None]

    def _arrivals(self, work: Work, redelivered: list[Any]) -> Callable[[], list[Slot]]:
        """The loop's arrivals: requests that came through the feed during the last forward,
        admitted into `work`; the slots to compute are returned."""

        def arrivals() -> list[Slot]:
            # A job under steady traffic would never end: bound it, so redelivered messages (which
            # run alone, after) do not wait for a lull and `work` does not grow without end.
            if redelivered or len(work.slots) >= self.job_limit:
                return []
            requests = work.feed.more()
            if not requests:
                return []
            deliveries = self._split_or_fail(requests, work.backend, work.feed)
            if deliveries is None:
                return []
            redelivered.extend(deliveries.redelivered)
            return self._admit(work, deliveries.fresh)

        return arrivals

    def _split_or_fail(self, requests: Sequence[Any], backend: Backend, feed: Feed | None) -> Deliveries | None:
        """`Admission.split`, or None once every request is failed (Redis away for longer than worst_batch_s)."""
        try:
            return self.admission.split(requests)
        except Exception as exc:
            self.defence.fail_batch(requests, backend, exc, feed)
            return None
