"""Results out: each ticket's result streamed once, each finished message's backend result written
and its message acknowledged through the feed, refused tickets dead-lettered; all through the
outbox the service was given (`ports.Outbox`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from ticketq import codec
from ticketq.contract import Reason, TicketRejected
from ticketq.dead_letters import ticket_entry
from worker.service.answers import Answers, answer_text
from worker.service.hooks import Hook
from worker.service.ports import Outbox
from worker.service.records import Slot, Work

log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, outbox: Outbox, answers: Answers, hooks: Hook, dead_letter_limit: int) -> None:
        self.outbox, self.answers, self.hooks = outbox, answers, hooks
        self.dead_letter_limit = dead_letter_limit

    def publish(self, work: Work, slots: list[Slot]) -> None:
        """Publish the final results of `slots` now: one pipelined round trip for their stream
        entries (and the attempts keys of the messages they complete), one for the backend."""
        if not slots:
            return
        begun = time.perf_counter()
        for slot in slots:
            slot.encoded = codec.dumps(slot.result)
        complete = work.completed_by(slots)
        repeated, reused = self._stream(work, slots, complete)
        failures, revoked = self._backend(work, [task_id for task_id in complete if task_id not in reused])
        work.published.update(complete)
        if work.feed is not None and complete:
            work.feed.done(complete, failures, {task_id: answer_text(work.by_task[task_id]) for task_id in complete},
                           revoked)  # fmt: skip
        self.hooks.on_publish(time.perf_counter() - begun)
        self.hooks.on_results([slot for slot in slots if (slot.request.id, slot.index) not in repeated])
        if not work.first_out:
            work.first_out = True
            self.hooks.on_first_result(max(0.0, time.time() - work.started))

    def reject(self, slot: Slot, raw: Any, rejection: TicketRejected) -> dict:
        """A failed result whose raw payload also goes to the dead-letter stream."""
        self.dead_letter(slot.request, slot.index, raw, rejection)
        return self.answers.failed(slot, raw, rejection)

    def dead_letter(self, request: Any, index: int | None, raw: Any, rejection: TicketRejected) -> None:
        entry = ticket_entry(request.id, index, rejection.reason, str(rejection), raw, self.answers.worker_name,
                             self.dead_letter_limit)  # fmt: skip
        self.outbox.dead_letter(entry)
        self.hooks.on_dead_letter(entry, rejection)

    def _stream(self, work: Work, slots: list[Slot], complete: list[str]) -> tuple[set, set[str]]:
        """Stream the slots' results once each, closing the attempts of the messages they complete.

        Returns the (task id, slot) already published by the same message (re-executions: counted
        apart, not as tickets done), and the task ids of messages that reused another message's
        task id, whose tickets are answered `duplicate_task_id` instead.
        """
        digests = work.digests
        entries = [(slot.request.id, slot.index, slot.encoded, digests.get(slot.request.id, "")) for slot in slots]
        review = {(slot.request.id, slot.index): slot.ticket.text  # the reviewer reads the text beside the answer
                  for slot in slots if slot.result.get("review") is True}  # fmt: skip
        repeated, conflicts = self.outbox.publish(entries, complete, review)
        if repeated:
            self.hooks.on_repeats(len(repeated))
            tasks = sorted({task_id for task_id, _ in repeated})
            log.info("re-executed: %d result(s) of %s already published, not repeated", len(repeated), tasks[:5])
        if conflicts:
            self._answer_reused_ids(slots, set(conflicts))
        return set(repeated), {task_id for task_id, _ in conflicts}

    def _answer_reused_ids(self, slots: list[Slot], conflicts: set[tuple[str, int]]) -> None:
        """Tickets of a message whose task id already answered another payload: failed
        `duplicate_task_id`, dead-lettered, and streamed without publish-once marks (the id's marks
        and its backend result belong to the message answered first)."""
        reused = [slot for slot in slots if (slot.request.id, slot.index) in conflicts]
        for slot in reused:
            detail = f"task id {slot.request.id} already answered another message; send this one under a new id"
            raw = slot.message.carried(slot.index)
            slot.result = self.reject(slot, raw, TicketRejected(Reason.DUPLICATE_TASK_ID, detail))
            slot.encoded = codec.dumps(slot.result)
        self.outbox.stream_results([slot.encoded for slot in reused])

    def _backend(self, work: Work, complete: list[str]) -> tuple[dict[str, str], set[str]]:
        """The backend state producers wait on: successes pipelined, failures one by one (rare).
        Returns the error of each message that ended FAILURE or REVOKED, and those REVOKED: a
        single-ticket message past its Celery `expires` ends REVOKED, as Celery ends it."""
        successes, failures, revoked = [], {}, set()
        for task_id in complete:
            slots = work.by_task[task_id]
            request, first = slots[0].request, slots[0].result
            if getattr(request, "ignore_result", False):
                continue
            if slots[0].packed:
                successes.append((request, b"[" + b",".join(slot.encoded for slot in slots) + b"]"))
            elif first["status"] == "ok":
                successes.append((request, slots[0].encoded))
            else:
                error = TicketRejected(first["reason"], first["error"].split(": ", 1)[-1])
                expired = first["reason"] == Reason.EXPIRED
                self.outbox.mark_failed(work.backend, request, error, "REVOKED" if expired else "FAILURE")
                failures[task_id] = str(error)
                if expired:
                    revoked.add(task_id)
        if successes:
            self.outbox.store_successes(work.backend, successes)
        return failures, revoked
