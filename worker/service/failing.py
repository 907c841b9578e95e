"""The job's last line of defence: what an unexpected error (or Redis away for longer than
TICKETQ_WORST_BATCH_S) left unanswered is failed, except what is answered after all or is
another worker's now; a publish that gave up but ran anyway is counted."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis

from ticketq.contract import Reason, TicketRejected
from ticketq.publishing import Unconfirmed
from worker.service.hooks import Hook
from worker.service.loop import PublishFailed
from worker.service.ports import Feed, Outbox
from worker.service.publish import Publisher
from worker.service.records import Message, Work

log = logging.getLogger(__name__)


class Defence:
    def __init__(self, outbox: Outbox, publisher: Publisher, hooks: Hook, worst_batch_s: float) -> None:
        self.outbox, self.publisher, self.hooks, self.worst_batch_s = outbox, publisher, hooks, worst_batch_s

    def fail_batch(self, requests: Sequence[Any], backend: Any, exc: Exception, feed: Feed | None) -> None:
        """Log why the job stopped (an outage without a traceback) and fail what is open."""
        cause = exc.__cause__ if isinstance(exc, PublishFailed) else exc
        if isinstance(cause, redis.ConnectionError | redis.TimeoutError):  # an outage, not a bug: no traceback
            log.error("batch of %d requests stopped: Redis unreachable for longer than TICKETQ_WORST_BATCH_S "
                      "(%ss): %s", len(requests), self.worst_batch_s, cause)  # fmt: skip
        else:
            log.exception("batch of %d requests failed outside the engine", len(requests))
        self.fail_open(requests, backend, exc, feed)

    def fail_open(self, requests: Sequence[Any], backend: Any, exc: Exception, feed: Feed | None = None) -> None:
        """FAILURE and a dead letter for each request without a final result, except where another
        worker has it. A worker cut off from Redis for longer than its lease meets requests that a
        live worker took over (recovered as a dead consumer's) and may have answered meanwhile:
        those are left to it, answered or not (a FAILURE would overwrite or pre-empt its answer, a
        requeue of the dead letter repeat it). One whose every ticket is in the results stream but
        whose backend result is not written yet is left alone too: a FAILURE would contradict the
        stream and block the SUCCESS that follows."""
        error = TicketRejected(Reason.WORKER_ERROR, f"{type(exc).__name__}: {exc}")
        counts = [(request.id, Message.of(request).ticket_count) for request in requests]
        try:
            answered = self.outbox.answered(backend, counts)
        except Exception:  # Redis away past worst_batch_s: nothing to check against; each failure below logs its own
            answered = set()
        if answered:
            log.info("not failing %d message(s) answered meanwhile: %s", len(answered), sorted(answered)[:5])
        taken = self._taken_over(feed, [request.id for request in requests if request.id not in answered])
        if taken:
            log.warning("not failing %d message(s) another worker took over while this worker's lease had "
                        "lapsed (theirs to answer): %s", len(taken), sorted(taken)[:5])  # fmt: skip
        for request in (request for request in requests if request.id not in answered and request.id not in taken):
            try:
                self.outbox.mark_failed(backend, request, error)
                self.publisher.dead_letter(request, None, request.args, error)
            except Exception:  # Redis gone too: the message is acked; log loudly so it is visible
                log.exception("could not mark task %s failed", request.id)

    def settle_unconfirmed(self, work: Work, exc: Exception) -> None:
        """A publish that gave up may have run after all (sent into a partition, it arrives when
        the link heals): count the results it streamed, which every later publish finds repeated."""
        cause = exc.__cause__ if isinstance(exc, PublishFailed) else exc
        if not isinstance(cause, Unconfirmed):
            return
        try:
            landed = self.outbox.landed(cause)
        except Exception as error:  # Redis still away: those results are counted by no one
            log.warning("could not learn whether %d unconfirmed result(s) were published (%s)", len(cause.order), error)
            return
        if landed is None:
            return
        skipped = {*landed.repeats, *landed.conflicts}
        by_place = {(slot.request.id, slot.index): slot for slot in work.slots}
        streamed = [by_place[place] for place in cause.order if place not in skipped and place in by_place]
        self.hooks.on_results([slot for slot in streamed if slot.result is not None])
        log.info("an unconfirmed publish of %d result(s) ran after all: %d streamed by this worker",
                 len(cause.order), len(streamed))  # fmt: skip

    def _taken_over(self, feed: Feed | None, task_ids: list[str]) -> set[str]:
        """`feed.taken_over`, with Redis given worst_batch_s to answer; an empty set when it cannot."""
        if feed is None or not task_ids:
            return set()
        try:
            return self.outbox.retrying(lambda: feed.taken_over(task_ids), write=False)
        except Exception as exc:  # Redis still away: nothing to check against; the failures below log their own
            log.warning("could not check whether another worker took over %d message(s) (%s)", len(task_ids), exc)
            return set()
