"""Fault injection for the reliability tests: a ticketq worker whose classifier fails on purpose.

    python tests/faults.py      # environment as for `ticketq worker`, plus POISON_MARKER_ENV / DELAY_ENV

The null classifier, except that a batch holding a text that contains the marker raises
`EngineFault` (an engine exception), a text containing `<marker>:exit` ends the process with
`os._exit(1)` (a worker that crashes on a ticket), and with DELAY_ENV each call takes that many
seconds (a model that is busy long enough for work to pile up behind it). Production code has
no hook for this: the classifier is handed to `worker.app.run_worker` like any other, and the
marker is chosen by the test, so no real ticket can trip it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from worker.nullclassifier import NullClassifier
from worker.results import BatchReport, Prediction

POISON_MARKER_ENV = "TICKETQ_TEST_POISON_MARKER"
DELAY_ENV = "TICKETQ_TEST_DELAY_S"
COMMAND = [os.path.abspath(__file__)]  # run with sys.executable instead of `-m worker.tools.cli worker`

log = logging.getLogger("worker.faults")


class EngineFault(RuntimeError):
    """Raised by the poisoned classifier, standing in for an engine exception."""


class FaultyClassifier(NullClassifier):
    def __init__(self, labels: tuple[str, ...], marker: str | None = None, delay_s: float = 0.0) -> None:
        super().__init__(labels)
        self.marker, self.delay_s = marker, delay_s
        if marker:
            log.warning("fault injection: tickets containing %r fail on purpose", marker)

    def classify(
        self,
        texts: Sequence[str],
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: Callable[[Sequence[int], list[Prediction]], None] | None = None,
        more: Callable[[], Sequence[str]] | None = None,
    ) -> tuple[list[Prediction], list[BatchReport]]:
        time.sleep(self.delay_s)
        self._check(texts)

        def checked_more() -> Sequence[str]:
            arrived = more() if more else ()
            if arrived:  # the next "forward" costs the delay too, and may meet a poisoned ticket
                time.sleep(self.delay_s)
                self._check(arrived)
            return arrived

        return super().classify(texts, on_batch, on_predictions, checked_more)

    def _check(self, texts: Sequence[str]) -> None:
        if not self.marker:
            return
        if any(f"{self.marker}:exit" in text for text in texts):
            log.critical("fault injection: crashing the worker process on a %s:exit ticket", self.marker)
            logging.shutdown()
            os._exit(1)
        poisoned = sum(self.marker in text for text in texts)
        if poisoned:
            log.warning("fault injection: engine fault on a batch of %d texts (%d poisoned)", len(texts), poisoned)
            raise EngineFault(f"injected engine fault ({poisoned} poisoned ticket(s) in a batch of {len(texts)})")


def main() -> None:
    from worker.app import run_worker
    from worker.settings import load_settings

    marker, delay_s = os.environ.get(POISON_MARKER_ENV), float(os.environ.get(DELAY_ENV, "0"))
    settings = load_settings()
    run_worker(settings, classifier_factory=lambda s: FaultyClassifier(s.label_names, marker, delay_s))


if __name__ == "__main__":
    main()
