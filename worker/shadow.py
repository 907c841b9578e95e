"""The live exactness check: a sample of served answers re-run through the unbatched reference path."""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from typing import Any

from ticketq.schema import TicketFields
from worker.constants import NEAR_TIE
from worker.metrics import Metrics
from worker.results import Prediction

log = logging.getLogger(__name__)


class ShadowChecker:
    """Re-runs a sample of tickets through the reference path on a background thread.

    `ticketq_shadow_agreed_total / ticketq_shadow_checked_total` shows, live, whether the
    optimised path still answers as the reference does; `ticketq_shadow_disagreed_total` splits
    the rest into near-ties (expected under bfloat16) and real disagreements. The queue is bounded: when the checker
    falls behind, samples are dropped (and counted), never the hot path slowed. A schema's answer
    (`TicketFields`) is checked field by field against its own reference (`FieldsEngine.reference`):
    it agrees when every field's labels do, and a disagreement is a near-tie when every field that
    differs is one in the reference.
    """

    def __init__(self, classifier: Any, metrics: Metrics, rate: float, capacity: int = 256) -> None:
        self.classifier = classifier  # anything with `reference(text) -> Prediction`
        self.metrics = metrics
        self.rate = rate
        self.dropped = metrics.shadow_dropped
        self._queue: queue.Queue[tuple[str, Any, Callable[[str], Any]]] = queue.Queue(maxsize=capacity)
        self._random = random.Random(0)
        threading.Thread(target=self._run, name="ticketq-shadow", daemon=True).start()

    def offer(self, text: str, prediction: Prediction | TicketFields,
              reference: Callable[[str], Any] | None = None) -> None:  # fmt: skip
        """Maybe re-check `prediction` with `reference` (default: the classifier's own)."""
        if self._random.random() >= self.rate:
            return
        try:
            self._queue.put_nowait((text, prediction, reference or self.classifier.reference))
        except queue.Full:
            self.dropped.inc()

    def join(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            text, served, reference_of = self._queue.get()
            try:
                reference = reference_of(text)
                self.metrics.shadow_checked.inc()
                observe = getattr(self.classifier, "observe_shadow", None)
                if observe is not None:  # a fast precision's error, measured once more: it may widen its bound
                    observe(served, reference)
                near_tie = _disagreement(served, reference)
                if near_tie is None:
                    self.metrics.shadow_agreed.inc()
                    continue
                self.metrics.shadow_disagreed.labels(near_tie=str(near_tie).lower()).inc()
                level, kind = (logging.WARNING, " (near-tie)") if near_tie else (logging.ERROR, "")
                log.log(level, "SHADOW MISMATCH%s: served %s, reference %s (%r)", kind, served, reference, text[:80])
            except Exception:
                log.exception("shadow check failed")
            finally:
                self._queue.task_done()


def _disagreement(served: Prediction | TicketFields, reference: Prediction | TicketFields) -> bool | None:
    """None when `served` answers as `reference` does; else whether every difference is a near-tie
    in the reference (a label margin, or a field's confidence, below NEAR_TIE)."""
    if isinstance(served, TicketFields):
        differing = [want for name, want in reference.fields.items() if served.fields[name].labels != want.labels]
        return all(want.confidence < NEAR_TIE for want in differing) if differing else None
    return None if served.label == reference.label else reference.margin < NEAR_TIE
