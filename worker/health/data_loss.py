"""Redis found without its data (`ticketq.epoch`), as this process notices it: the outbox judges
the epoch marker with each job's first read, the metrics count what it noticed."""

from __future__ import annotations

import logging
import threading
import time

from ticketq.epoch import Loss

log = logging.getLogger(__name__)


class DataLoss:
    """Redis found without its data (`ticketq.epoch`), as this process notices it: one log line and
    one count per loss, whichever outbox of the process notices it (`ticketq_redis_data_lost_total`)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def noticed(self, loss: Loss) -> None:
        with self._lock:
            self.count += 1
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(loss.since)) if loss.since else "earlier"
        log.error(
            "Redis lost its data (restarted without persistence, or flushed: the epoch marker set %s is gone): "
            "the queue, unacked messages, results stream, dead letters and publish-once marks it held are gone; "
            "this worker goes on, and the tickets that were waiting are answered once their producers send them "
            "again (ticketq-produce --resend-after, Producer.wait(resend_after=))", since,
        )  # fmt: skip

