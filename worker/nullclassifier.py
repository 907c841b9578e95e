"""A zero-cost classifier for measuring the queue path's own ceiling (TICKETQ_NULL_CLASSIFIER=1).

No model is loaded: labels are a hash of the text, token counts bytes/4 (roughly BPE's). With it,
`ticketq loadtest` and the service tests measure Redis, Celery and ticketq's own per-ticket cost.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from worker.results import BatchReport, Prediction


class NullClassifier:
    """The classifier interface of `worker.engine.Engine`, answering in microseconds."""

    info = None

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        # One probabilities dict per label, shared by its answers (read only): at tens of thousands
        # of tickets a second, building one per ticket was a sixth of the worker's model thread.
        self._probs = [{name: float(name == label) for name in labels} for label in labels]

    def classify(
        self,
        texts: Sequence[str],
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: Callable[[Sequence[int], list[Prediction]], None] | None = None,
        more: Callable[[], Sequence[str]] | None = None,
    ) -> tuple[list[Prediction], list[BatchReport]]:
        """One "forward batch" of every text, then one of whatever `more()` brings, until it is empty."""
        texts, predictions, reports = list(texts), [], []
        start = 0
        while start < len(texts):
            new = texts[start:]
            batch = [self.reference(text) for text in new]
            lengths = [len(text) // 4 + 1 for text in new]
            report = BatchReport(rows=len(batch), width=max(lengths), real_tokens=sum(lengths), seconds=0.0)
            predictions += batch
            reports.append(report)
            if on_batch:
                on_batch(report)
            if on_predictions:
                on_predictions(range(start, len(texts)), batch)
            start = len(texts)
            if more:
                texts += more()
        return predictions, reports

    def reference(self, text: str) -> Prediction:
        index = zlib.crc32(text.encode("utf-8", "surrogatepass")) % len(self.labels)
        return Prediction(self.labels[index], self._probs[index], 1.0, False, len(text) // 4 + 1)
