"""The live exactness check: a sample of served answers re-run through the unbatched reference path."""

from __future__ import annotations

import logging
import queue
import random
import threading
from typing import Any

from worker.constants import NEAR_TIE
from worker.metrics import Metrics
from worker.results import Prediction

log = logging.getLogger(__name__)


class ShadowChecker:
    """Re-runs a sample of tickets through the reference path on a background thread.

    `ticketq_shadow_agreed_total / ticketq_shadow_checked_total` shows, live, whether the
    optimised path still answers as the reference does; `ticketq_shadow_disagreed_total` splits
    the rest into near-ties (expected under bfloat16) and real disagreements. The queue is bounded: when the checker
    falls behind, samples are dropped (and counted), never the hot path slowed.
    """

    def __init__(self, classifier: Any, metrics: Metrics, rate: float, capacity: int = 256) -> None:
        self.classifier = classifier  # anything with `reference(text) -> Prediction`
        self.metrics = metrics
        self.rate = rate
        self.dropped = metrics.shadow_dropped
        self._queue: queue.Queue[tuple[str, Prediction]] = queue.Queue(maxsize=capacity)
        self._random = random.Random(0)
        threading.Thread(target=self._run, name="ticketq-shadow", daemon=True).start()

    def offer(self, text: str, prediction: Prediction) -> None:
        if self._random.random() >= self.rate:
            return
        try:
            self._queue.put_nowait((text, prediction))
        except queue.Full:
            self.dropped.inc()

    def join(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            text, served = self._queue.get()
            try:
                reference = self.classifier.reference(text)
                self.metrics.shadow_checked.inc()
                if reference.label == served.label:
                    self.metrics.shadow_agreed.inc()
                    continue
                near_tie = reference.margin < NEAR_TIE
                self.metrics.shadow_disagreed.labels(near_tie=str(near_tie).lower()).inc()
                level, kind = (logging.WARNING, " (near-tie)") if near_tie else (logging.ERROR, "")
                log.log(level, "SHADOW MISMATCH%s: served %s, reference %s (%r)", kind, served, reference, text[:80])
            except Exception:
                log.exception("shadow check failed")
            finally:
                self._queue.task_done()
