"""A zero-cost classifier for measuring the queue path's own ceiling (TICKETQ_NULL_CLASSIFIER=1).

No model is loaded: labels are a hash of the text, token counts bytes/4 (roughly BPE's). With it,
`ticketq loadtest` and the service tests measure Redis, Celery and ticketq's own per-ticket cost.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from ticketq.schema import Schema
from worker.engine.batching import Batch, Plan
from worker.engine.scheduler import Exact, Offline
from worker.results import Prediction


class NullClassifier(Offline):
    """The whole classifier port (`worker.service.ports.Classifier`), answering in microseconds:
    every waiting ticket in one "forward", no model, no schemas, no cost model, no re-check."""

    info = None  # no model
    schema: Schema | None = None  # its own labels, with no schema behind them
    compiles = False  # answers its own labels only: TICKETQ_SCHEMAS is ignored
    dedup = False  # a copy costs what computing it again costs
    deferred = False
    cost = None  # it plans without a cost model

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.policy = Exact(self)  # no fast precision to re-check
        # One probabilities dict per label, shared by its answers (read only): at tens of thousands
        # of tickets a second, one built per ticket would cost a sixth of the model thread.
        self._probs = [{name: float(name == label) for name in labels} for label in labels]

    def encode(self, texts: Sequence[object]) -> list[Any]:
        return list(texts)

    def plan(self, encoded: Sequence[Any]) -> Plan:
        """One batch of every ticket, its width the longest's token count."""
        if not encoded:
            return Plan(())
        lengths = tuple(len(text) // 4 + 1 for text in encoded)
        return Plan((Batch(tuple(range(len(encoded))), lengths, max(lengths)),))

    def forward_batch(self, tickets: Sequence[Any], width: int | None = None) -> list[Prediction]:
        return [self.reference(text) for text in tickets]

    def compile(self, schema: Schema) -> Any:
        raise TypeError("the null classifier answers its own labels only")

    def reference(self, text: str) -> Prediction:
        index = zlib.crc32(text.encode("utf-8", "surrogatepass")) % len(self.labels)
        return Prediction(self.labels[index], self._probs[index], 1.0, False, len(text) // 4 + 1)
