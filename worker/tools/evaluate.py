"""`ticketq eval`: how well the model labels a team's own tickets, and where to set the threshold.

A labelled file is a ticket file (JSONL or CSV, as `ticketq classify` reads it) whose rows carry
an `expected` label. Every such row is classified in-process, exactly as `ticketq classify` would
(the same reader, the same chunked plan), and scored:

- accuracy, and per label its precision, recall, F1 and support;
- the confusion matrix (rows: expected, columns: predicted);
- the accuracy/coverage trade-off per threshold on the margin (top probability minus the
  runner-up): at threshold t the tickets with margin >= t are answered automatically (coverage)
  with that accuracy, the rest go to a person. A team picks the threshold its error budget allows.

Rows without `expected`, refused rows and rows whose `expected` is not one of the model's labels
are counted and reported, never scored. With the stand-in model the numbers mean nothing (its
weights are random): the report says so.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from producer.tickets import Row, RowError, TicketRow

THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class Scores:
    """Counts over scored rows: (expected, predicted, margin) each. Pure: no model, no files."""

    labels: tuple[str, ...]
    confusion: Counter = field(default_factory=Counter)  # (expected, predicted) -> rows
    margins: list[tuple[float, bool]] = field(default_factory=list)  # (margin, correct), kept sorted by margin
    unknown: Counter = field(default_factory=Counter)  # expected labels the model does not have -> rows

    def add(self, expected: str, predicted: str, margin: float) -> None:
        if expected not in self.labels:
            self.unknown[expected] += 1
            return
        self.confusion[expected, predicted] += 1
        bisect.insort(self.margins, (float(margin), expected == predicted))

    @property
    def scored(self) -> int:
        return len(self.margins)

    @property
    def accuracy(self) -> float:
        correct = sum(self.confusion[label, label] for label in self.labels)
        return correct / self.scored if self.scored else 0.0

    def per_label(self) -> dict[str, dict[str, float]]:
        """Precision, recall, F1 and support of each label (0 where undefined)."""
        table = {}
        for label in self.labels:
            hit = self.confusion[label, label]
            predicted = sum(self.confusion[other, label] for other in self.labels)
            support = sum(self.confusion[label, other] for other in self.labels)
            precision = hit / predicted if predicted else 0.0
            recall = hit / support if support else 0.0
            f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
            table[label] = {"precision": precision, "recall": recall, "f1": f1, "support": support}
        return table

    def coverage(self, thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, float]]:
        """Per threshold: the share of rows with margin >= it, and the accuracy on those."""
        rows = []
        for threshold in thresholds:
            covered = self.margins[bisect.bisect_left(self.margins, (threshold, False)):]
            correct = sum(1 for _, ok in covered if ok)
            rows.append({
                "threshold": threshold,
                "coverage": len(covered) / self.scored if self.scored else 0.0,
                "accuracy": correct / len(covered) if covered else 0.0,
                "answered": len(covered),
            })  # fmt: skip
        return rows

    def as_dict(self, thresholds: Sequence[float] = THRESHOLDS) -> dict:
        confusion = {expected: {predicted: self.confusion[expected, predicted] for predicted in self.labels}
                     for expected in self.labels}  # fmt: skip
        return {
            "scored": self.scored,
            "accuracy": self.accuracy,
            "per_label": self.per_label(),
            "confusion": confusion,
            "coverage": self.coverage(thresholds),
            "unknown_expected": dict(self.unknown),
        }


@dataclass
class Evaluation:
    """What one `ticketq eval` run saw: the scores and the rows it could not score."""

    scores: Scores
    rows: int = 0
    unlabelled: int = 0  # rows without `expected`
    refused: list[str] = field(default_factory=list)  # `source: reason: error` of refused rows
    classified: int = 0


def evaluate(engine, rows: Iterable[Row], on_batch=None, on_chunk=None) -> Evaluation:
    """Classify every labelled row of `rows` (chunked, as `ticketq classify` does) and score it."""
    from worker.tools.offline import Summary, chunked, classify_chunk

    evaluation, summary = Evaluation(Scores(tuple(engine.labels))), Summary()
    for chunk in chunked(rows):
        evaluation.rows += len(chunk)
        labelled: list[Row] = []
        for row in chunk:
            if isinstance(row, RowError):
                evaluation.refused.append(f"{row.source}: {row.reason}: {row.message}")
            elif "expected" not in row.ticket:
                evaluation.unlabelled += 1
            else:
                labelled.append(row)
        results = classify_chunk(engine, labelled, summary, on_batch) if labelled else []
        for row, result in zip(labelled, results, strict=True):
            assert isinstance(row, TicketRow)
            if result["status"] != "ok":
                evaluation.refused.append(f"{result['source']}: {result['reason']}: {result['error']}")
                continue
            evaluation.scores.add(row.ticket["expected"], result["label"], result["margin"])
            evaluation.classified += 1
        if on_chunk is not None:
            on_chunk(len(chunk))
    return evaluation
