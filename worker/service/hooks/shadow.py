"""The live exactness check attached to the pipeline: each computed answer is offered to the
`ShadowChecker` (`worker.shadow`), a schema's answer with its own schema's reference path."""

from __future__ import annotations

from typing import Any

from ticketq.schema import TicketFields
from worker.service.hooks import Hook
from worker.service.routing import Routing
from worker.shadow import ShadowChecker


class ShadowHook(Hook):
    def __init__(self, checker: ShadowChecker, routing: Routing) -> None:
        self.checker, self.routing = checker, routing

    def on_answer(self, slot: Any, answer: Any) -> None:
        if isinstance(answer, TicketFields):  # looked up here, on the classifying thread: the set is not thread-safe
            self.checker.offer(slot.ticket.text, answer, self.routing.reference(slot.schema))
        else:
            self.checker.offer(slot.ticket.text, answer)
