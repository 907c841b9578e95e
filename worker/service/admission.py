"""Admission: what of a drained buffer goes to the engine.

Deliveries are split (first deliveries counted at once, redelivered messages apart), each
message's arguments are decoded once (`records.Message`), each ticket validated and routed to
its schema, and tickets of a message past its Celery `expires` answered `expired`. What is
refused here gets its result now and never reaches the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from ticketq.contract import Reason, TicketRejected, validate_ticket
from worker.service.answers import raw_ticket, slot_result_id
from worker.service.ports import Outbox
from worker.service.publish import Publisher
from worker.service.records import Deliveries, Message, Slot, Work
from worker.service.routing import Routing
from worker.settings import Settings

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, settings: Settings, outbox: Outbox, routing: Routing, publisher: Publisher) -> None:
        self.max_ticket_bytes, self.max_retries = settings.max_ticket_bytes, settings.max_retries
        self.outbox, self.routing, self.publisher = outbox, routing, publisher

    def split(self, requests: Sequence[Any]) -> Deliveries:
        """Split the buffer into first deliveries (counted now) and redelivered messages.

        A message whose attempts key still exists was in a batch that never finished: its worker
        died, maybe because of one ticket in that batch. Each such message runs alone, after the
        fresh batch and least-tried first, and counts its delivery only when it runs: a ticket that
        kills workers spends its own deliveries, not those of the tickets that shared its batch.
        """
        seen = self.outbox.attempts([request.id for request in requests])
        fresh = [request for request, count in zip(requests, seen, strict=True) if count is None]
        again = sorted(((count, request) for request, count in zip(requests, seen, strict=True) if count is not None),
                       key=lambda pair: pair[0])  # fmt: skip
        if fresh:
            self.outbox.count_deliveries([request.id for request in fresh])
        return Deliveries(fresh, [request for _, request in again])

    def admit(self, work: Work, requests: Sequence[Any]) -> list[Slot]:
        """Every ticket of `requests` as a slot of `work`: refused and expired ones with their result."""
        joined, slots = time.time(), []
        for request in requests:
            message = Message.of(request)
            work.digests[request.id] = message.digest()
            for index, raw in enumerate(message.tickets):
                slot = Slot(message, index, joined)
                self._validate(slot, raw)
                work.add(slot)
                slots.append(slot)
        self._expire(slots)
        return slots

    def too_many_deliveries(self, request: Any, backend: Any) -> bool:
        """A message redelivered past max_retries (its batch keeps killing workers) is dead-lettered."""
        attempts = self.outbox.count_deliveries([request.id])
        if attempts <= self.max_retries + 1:
            return False
        rejection = TicketRejected(Reason.TOO_MANY_DELIVERIES, f"delivered {attempts} times; it may crash workers")
        self.publisher.dead_letter(request, None, request.args, rejection)
        self.outbox.mark_failed(backend, request, rejection)
        return True

    def _validate(self, slot: Slot, raw: Any) -> None:
        """The slot's ticket and schema, or its failed result (dead-lettered with the ticket as carried;
        a wrong argument count with the arguments as they came)."""
        try:
            if len(slot.message.args) != 1:
                detail = f"expected one argument (ticket or list), got {len(slot.message.args)}"
                raise TicketRejected(Reason.BAD_PAYLOAD, detail)
            slot.ticket = validate_ticket(raw, self.max_ticket_bytes)
            slot.schema = self.routing.route(slot.ticket)
        except TicketRejected as rejection:
            slot.result = self.publisher.reject(slot, raw, rejection)

    def _expire(self, slots: Sequence[Slot]) -> None:
        """Tickets of a message past its Celery `expires` get an `expired` result and are not computed.

        Celery's own strategy revokes expired messages, but celery-batches buffers them without
        looking; the deadline travels in the message headers (`request_dict["expires"]`, ISO 8601).
        """
        deadlines: dict[str, float | None] = {}  # per message, not per ticket of a packed one
        for slot in slots:
            now, task_id = slot.joined, slot.request.id
            if task_id not in deadlines:
                deadlines[task_id] = message_deadline(slot.request)
            deadline = deadlines[task_id]
            if slot.result is None and deadline is not None and deadline <= now:
                when = datetime.fromtimestamp(deadline, timezone.utc).isoformat()
                late = f"deadline {when} passed {now - deadline:.3f}s before the batch started"
                raw = {**raw_ticket(slot.ticket), "id": slot_result_id(slot, slot.ticket.id)}
                slot.result = self.publisher.answers.failed(slot, raw, TicketRejected(Reason.EXPIRED, late))


def message_deadline(request: Any) -> float | None:
    """A Celery message's `expires` as a unix time, or None (no deadline, or one we cannot read).

    celery-batches' SimpleRequest does not copy `Request.expires`, but keeps every header in
    `request_dict`; Celery sends `expires` as an ISO 8601 string (UTC when no offset is given).
    """
    headers = getattr(request, "request_dict", None)
    expires = headers.get("expires") if isinstance(headers, dict) else None
    if not isinstance(expires, str):
        return None
    try:
        when = datetime.fromisoformat(expires)
    except ValueError:
        log.warning("task %s: unreadable expires %r ignored", getattr(request, "id", "?"), expires[:64])
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()
