"""The result records a ticket's answer goes out as, in the contract's key order
(`ticketq.contract.Classified`, `Triaged`, `Failed`), and what the metrics and acks read of them."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from ticketq.contract import Classified, Failed, Ticket, TicketRejected, Triaged, result_id
from ticketq.schema import TicketFields
from worker.results import Prediction
from worker.service.ports import Classifier
from worker.service.records import Slot
from worker.settings import Settings


class Answers:
    """Builds one worker's result records: who answered (model, worker) and when, around each answer."""

    def __init__(self, settings: Settings, classifier: Classifier) -> None:
        info = classifier.info
        self.truncation = settings.truncation
        self.model_fields = {"model": info.name if info else "null-classifier", "standin": bool(info and info.standin)}
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"

    def classified(self, slot: Slot, prediction: Prediction, now: float) -> Classified:
        """A ticket answered with the classifier's own field."""
        return self._ok(slot, now, {
            "label": prediction.label,
            "probs": prediction.probs,
            "margin": prediction.margin,
            "truncated": prediction.truncated,
            "truncation": self.truncation if prediction.truncated else None,
        }, prediction.precision, prediction.rechecked, prediction.scorer)  # fmt: skip

    def triaged(self, slot: Slot, answer: TicketFields, now: float) -> Triaged:
        """A ticket answered with a schema: every field's answer."""
        return self._ok(slot, now, answer.to_json(), answer.precision, answer.rechecked, answer.scorer)

    def answer(self, slot: Slot, answer: Prediction | TicketFields, now: float) -> Classified | Triaged:
        if isinstance(answer, TicketFields):
            return self.triaged(slot, answer, now)
        return self.classified(slot, answer, now)

    def failed(self, slot: Slot, raw: Any, rejection: TicketRejected) -> Failed:
        """A ticket refused or not computed; `raw` the ticket as carried (its id names the result)."""
        return {
            "id": slot_result_id(slot, raw.get("id") if isinstance(raw, dict) else None),
            "task_id": slot.request.id,
            "status": "failed",
            "reason": rejection.reason,
            "error": str(rejection),
            "worker": self.worker_name,
        }

    def _ok(self, slot: Slot, now: float, answer: dict, precision: str, rechecked: bool, scorer: str) -> Any:
        ticket, started = slot.ticket, slot.joined
        return {
            "id": slot_result_id(slot, ticket.id),
            "task_id": slot.request.id,
            "status": "ok",
            **answer,
            **self.model_fields,
            "precision": precision,
            "rechecked": rechecked,
            "scorer": scorer,
            "worker": self.worker_name,
            "queue_wait_s": round(started - ticket.submitted_at, 6) if ticket.submitted_at else None,
            "processing_s": round(now - started, 6),
        }


def raw_ticket(ticket: Ticket) -> dict:
    """A validated ticket as a raw one (for a failure after validation: expired, engine error)."""
    return {"id": ticket.id, "text": ticket.text, "submitted_at": ticket.submitted_at}


def outcome(result: dict) -> str:
    """A result's outcome as `ticketq_tickets_total` counts it."""
    if result["status"] == "ok":
        return "ok"
    if result["reason"] == "expired":
        return "expired"
    return "failed" if result["reason"] in ("engine_error", "worker_error") else "rejected"


def answer_text(slots: Sequence[Slot]) -> str:
    """A message's answer in a few words: its label (or each field's), a list for a packed message."""
    answers = []
    for slot in slots:
        result = slot.result or {}
        if "fields" in result:
            answers.append({name: field.get("labels", field.get("label")) for name, field in result["fields"].items()})
        else:
            answers.append(result.get("label") or result.get("reason") or result.get("status"))
    return repr(answers if slots and slots[0].packed else answers[0] if answers else None)


def slot_result_id(slot: Slot, given: object) -> str:
    """The id of `slot`'s result (`contract.result_id`): the ticket's own, or one made from its place."""
    return result_id(given, slot.request.id, slot.index, slot.packed)
