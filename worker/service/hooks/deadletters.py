"""Dead-letter accounting: `ticketq_dead_letters_total` by reason, and a log line per entry."""

from __future__ import annotations

import logging

from ticketq.contract import TicketRejected
from worker.metrics import Metrics
from worker.service.hooks import Hook

log = logging.getLogger(__name__)


class DeadLetterCount(Hook):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_dead_letter(self, entry: dict[str, str], rejection: TicketRejected) -> None:
        self.metrics.dead_letters.labels(reason=rejection.reason).inc()
        log.warning("dead-lettered task %s slot %s: %s", entry["task_id"], entry["slot"], rejection)
