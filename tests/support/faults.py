"""Fault injection for the reliability tests: a ticketq worker whose classifier fails on purpose.

    python tests/support/faults.py      # environment as for `ticketq worker`, plus the variables below

The null classifier, except that a batch holding a text that contains the marker (POISON_MARKER_ENV)
raises `EngineFault` (an engine exception), a text containing `<marker>:exit` ends the process with
`os._exit(1)` (a worker that crashes on a ticket), with DELAY_ENV each call takes that many
seconds (a model that is busy long enough for work to pile up behind it), and a batch holding a
text that contains HANG_MARKER_ENV's marker hangs until the file RELEASE_FILE_ENV names exists (a
forward that never returns, then does). Production code has no hook for this: the classifier is
handed to `worker.app.run_worker` like any other, and the markers are chosen by the test, so no
real ticket can trip them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from worker.nullclassifier import NullClassifier
from worker.results import Prediction

POISON_MARKER_ENV = "TICKETQ_TEST_POISON_MARKER"
DELAY_ENV = "TICKETQ_TEST_DELAY_S"
HANG_MARKER_ENV = "TICKETQ_TEST_HANG_MARKER"
RELEASE_FILE_ENV = "TICKETQ_TEST_RELEASE_FILE"
COMMAND = [os.path.abspath(__file__)]  # run with sys.executable instead of `-m ticketq_cli.cli worker`

log = logging.getLogger("worker.faults")


class EngineFault(RuntimeError):
    """Raised by the poisoned classifier, standing in for an engine exception."""


class FaultyClassifier(NullClassifier):
    def __init__(self, labels: tuple[str, ...], marker: str | None = None, delay_s: float = 0.0,
                 hang: tuple[str, Path] | None = None) -> None:  # fmt: skip
        """`hang`: (marker, release file): a batch with a text containing the marker blocks until the file exists."""
        super().__init__(labels)
        self.marker, self.delay_s, self.hang = marker, delay_s, hang
        if marker:
            log.warning("fault injection: tickets containing %r fail on purpose", marker)
        if hang:
            log.warning("fault injection: batches with a ticket containing %r hang until %s exists", *hang)

    def forward_batch(self, tickets: Sequence[str], width: int | None = None) -> list[Prediction]:
        """Each forward costs the delay, and may meet a poisoned ticket."""
        time.sleep(self.delay_s)
        self._check(tickets)
        return super().forward_batch(tickets, width)

    def _check(self, texts: Sequence[str]) -> None:
        self._hang(texts)
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

    def _hang(self, texts: Sequence[str]) -> None:
        if not self.hang or not any(self.hang[0] in text for text in texts):
            return
        marker, release = self.hang
        log.warning("fault injection: forward hung on a %s ticket until %s exists", marker, release)
        while not release.exists():
            time.sleep(0.05)
        log.warning("fault injection: forward released")


def main() -> None:
    from worker.app import run_worker
    from worker.settings import load_settings

    marker, delay_s = os.environ.get(POISON_MARKER_ENV), float(os.environ.get(DELAY_ENV, "0"))
    hang = (os.environ[HANG_MARKER_ENV], Path(os.environ[RELEASE_FILE_ENV])) if HANG_MARKER_ENV in os.environ else None
    settings = load_settings()
    sys.exit(run_worker(settings, classifier_factory=lambda s: FaultyClassifier(s.label_names, marker, delay_s,
                                                                                hang)))


if __name__ == "__main__":
    main()
