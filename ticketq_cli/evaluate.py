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
weights are random): the report (`ticketq_cli.eval_report`) says so.

With a schema (`ticketq eval FILE --schema SCHEMA.toml`, `evaluate_fields`) a row's `expected` is
an object {field: label}, or {field: [labels]} for a multi-label field (in a CSV cell: that object
as JSON). Every row is answered by the schema's `FieldsEngine`, and each field is scored on the
rows that name it: a single-label field as above (`Scores`, the confidence being its margin), a
multi-label field per label (precision, recall, F1) and by exact-set accuracy (`SetScores`). A row
whose `expected` names a field or a label the schema does not have is refused with one line
naming it (`parse_expected`), and scored for no field. With a label head (TICKETQ_HEAD), its labels."""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from producer.ticketrows import Row, RowError, TicketRow
from ticketq.schema import Schema

THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
INVALID_EXPECTED = "invalid_expected"  # the reason of a row whose `expected` cannot be scored


def label_scores(hit: int, chosen: int, support: int) -> dict[str, float]:
    """Precision, recall, F1 (0 where undefined) and support of one label: `hit` rows right of the
    `chosen` rows answered with it and the `support` rows expecting it."""
    precision = hit / chosen if chosen else 0.0
    recall = hit / support if support else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "support": support}


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
            table[label] = label_scores(hit, predicted, support)
        return table

    def coverage(self, thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, float]]:
        """Per threshold: the share of rows with margin >= it, and the accuracy on those."""
        return coverage(self.margins, thresholds)

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

    @property
    def scored(self) -> int:
        return self.scores.scored


def evaluate(engine, rows: Iterable[Row], on_batch=None, on_chunk=None) -> Evaluation:
    """Classify every labelled row of `rows` (chunked, as `ticketq classify` does) and score it."""
    from ticketq_cli.offline import Summary, chunked, classify_chunk
    from worker.engine.head import answer_labels

    evaluation, summary = Evaluation(Scores(answer_labels(engine))), Summary()
    for chunk in chunked(rows):
        evaluation.rows += len(chunk)
        labelled: list[Row] = []
        for row in chunk:
            if isinstance(row, RowError):
                evaluation.refused.append(f"{row.source}: {row.reason}: {row.message}")
            elif "expected" not in row.ticket:
                evaluation.unlabelled += 1
            elif not isinstance(row.ticket["expected"], str):
                evaluation.refused.append(f"{row.source}: {INVALID_EXPECTED}: an object of fields; score it "
                                          "with --schema SCHEMA.toml")  # fmt: skip
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


def coverage(margins: Sequence[tuple[float, bool]], thresholds: Sequence[float]) -> list[dict[str, float]]:
    """Per threshold: the share of `margins` (sorted (margin, correct) pairs) at or above it, and
    the accuracy on those."""
    rows = []
    for threshold in thresholds:
        covered = margins[bisect.bisect_left(margins, (threshold, False)):]
        correct = sum(1 for _, ok in covered if ok)
        rows.append({
            "threshold": threshold,
            "coverage": len(covered) / len(margins) if margins else 0.0,
            "accuracy": correct / len(covered) if covered else 0.0,
            "answered": len(covered),
        })  # fmt: skip
    return rows


# ----- several fields: a schema ---------------------------------------------------------------


@dataclass
class SetScores:
    """A multi-label field's counts over scored rows: per label hits, expected and predicted, and
    (confidence, exact set) per row, sorted. Pure: no model, no files."""

    labels: tuple[str, ...]
    hits: Counter = field(default_factory=Counter)  # label -> rows where it was expected and chosen
    expected: Counter = field(default_factory=Counter)  # label -> rows where it was expected
    predicted: Counter = field(default_factory=Counter)  # label -> rows where it was chosen
    margins: list[tuple[float, bool]] = field(default_factory=list)  # (confidence, exact set), sorted

    def add(self, expected: Sequence[str], predicted: Sequence[str], confidence: float) -> None:
        want, got = set(expected), set(predicted)
        self.hits.update(want & got)
        self.expected.update(want)
        self.predicted.update(got)
        bisect.insort(self.margins, (float(confidence), want == got))

    @property
    def scored(self) -> int:
        return len(self.margins)

    @property
    def accuracy(self) -> float:
        """Exact-set accuracy: the share of rows whose chosen labels are exactly the expected ones."""
        return sum(ok for _, ok in self.margins) / self.scored if self.scored else 0.0

    def per_label(self) -> dict[str, dict[str, float]]:
        """Precision, recall, F1 and support (rows expecting it) of each label (0 where undefined)."""
        table = {}
        for label in self.labels:
            table[label] = label_scores(self.hits[label], self.predicted[label], self.expected[label])
        return table

    def coverage(self, thresholds: Sequence[float] = THRESHOLDS) -> list[dict[str, float]]:
        """Per threshold: the share of rows with confidence >= it, and the exact-set accuracy on those."""
        return coverage(self.margins, thresholds)

    def as_dict(self, thresholds: Sequence[float] = THRESHOLDS) -> dict:
        return {
            "scored": self.scored,
            "accuracy": self.accuracy,
            "per_label": self.per_label(),
            "coverage": self.coverage(thresholds),
        }


Expected = dict[str, str | tuple[str, ...]]  # field -> its label (single-label) or labels (multi-label)


def parse_expected(schema: Schema, expected: object) -> Expected:
    """A row's `expected` for `schema`: {field: label} or {field: [labels]}; a string holding that
    object as JSON (a CSV cell), or a one-field schema's label alone. A field may be left out (it
    is then not scored on this row). ValueError with one line saying what is wrong."""
    fields = ", ".join(schema.field_names)
    if isinstance(expected, str):
        text = expected.strip()
        if text.startswith("{"):
            try:
                expected = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"'expected' is not a JSON object: {exc.msg} (column {exc.colno})") from None
        elif len(schema.fields) == 1:
            expected = {schema.fields[0].name: text}
        else:
            raise ValueError(f"'expected' {text!r} names no field: with a schema it is an object "
                             f"{{field: label}} (fields of {schema.name}: {fields})")  # fmt: skip
    if not isinstance(expected, dict):
        raise ValueError(f"'expected' must be an object {{field: label}}, got {type(expected).__name__}")
    parsed: Expected = {}
    for name, value in expected.items():
        if name not in schema.field_names:
            raise ValueError(f"'expected' names unknown field {name!r} (fields of {schema.name}: {fields})")
        spec = schema.field(name)
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values) or (
            not spec.multi and len(values) != 1
        ):
            kind = "a list of labels" if spec.multi else "one label"
            raise ValueError(f"'expected' {name}: takes {kind}, got {json.dumps(value)[:60]}")
        unknown = [v for v in values if v not in spec.labels]
        if unknown:
            raise ValueError(f"'expected' {name}: unknown label {unknown[0]!r} (labels: {', '.join(spec.labels)})")
        parsed[name] = tuple(sorted(set(values), key=spec.labels.index)) if spec.multi else values[0]
    return parsed


@dataclass
class FieldsEvaluation:
    """What one `ticketq eval --schema` run saw: each field's scores and the rows it could not score."""

    schema: Schema
    fields: dict[str, Scores | SetScores]
    missing: Counter = field(default_factory=Counter)  # field -> labelled rows whose `expected` left it out
    rows: int = 0
    unlabelled: int = 0  # rows without `expected`
    refused: list[str] = field(default_factory=list)  # `source: reason: error` of refused rows
    classified: int = 0
    scored: int = 0  # rows scored for at least one field

    @classmethod
    def of(cls, schema: Schema) -> FieldsEvaluation:
        scores = {spec.name: SetScores(spec.labels) if spec.multi else Scores(spec.labels) for spec in schema.fields}
        return cls(schema, scores)

    def add(self, expected: Expected, answer) -> None:
        """Score one row's `answer` (`TicketFields`) on the fields its `expected` names."""
        self.classified += 1
        self.scored += bool(expected)
        for spec in self.schema.fields:
            result = answer.fields[spec.name]
            if spec.name not in expected:
                self.missing[spec.name] += 1
            elif spec.multi:
                self.fields[spec.name].add(expected[spec.name], result.labels, result.confidence)
            else:
                self.fields[spec.name].add(expected[spec.name], result.label, result.confidence)

    def as_dict(self, thresholds: Sequence[float] = THRESHOLDS) -> dict:
        """Per field: its kind, its schema threshold, rows that left it out, and its scores (the
        coverage table with the schema threshold among the thresholds)."""
        fields = {}
        for spec in self.schema.fields:
            cuts = field_thresholds(thresholds, spec.threshold)
            kind = "multi" if spec.multi else "single"
            fields[spec.name] = {"kind": kind, "threshold": spec.threshold, "missing": self.missing[spec.name],
                                 **self.fields[spec.name].as_dict(cuts)}  # fmt: skip
        return {"schema": self.schema.name, "rows": self.rows, "unlabelled": self.unlabelled,
                "refused": len(self.refused), "classified": self.classified, "scored": self.scored,
                "fields": fields}  # fmt: skip


def field_thresholds(thresholds: Sequence[float], own: float) -> list[float]:
    """The coverage table's thresholds for a field: the ones asked for and the field's own."""
    return sorted({*thresholds, own})


def evaluate_fields(fields_engine, rows: Iterable[Row], on_batch=None, on_chunk=None) -> FieldsEvaluation:
    """Answer every labelled row of `rows` with `fields_engine` (a schema's `FieldsEngine`), a chunk
    at a time, and score each field on the rows whose `expected` names it."""
    from ticketq_cli.offline import chunked
    from worker.engine.prompt import InvalidTicket

    evaluation = FieldsEvaluation.of(fields_engine.schema)
    for chunk in chunked(rows):
        evaluation.rows += len(chunk)
        expected, encoded = [], []
        for row in chunk:
            if isinstance(row, RowError):
                evaluation.refused.append(f"{row.source}: {row.reason}: {row.message}")
                continue
            if "expected" not in row.ticket:
                evaluation.unlabelled += 1
                continue
            try:
                wanted = parse_expected(fields_engine.schema, row.ticket["expected"])
                encoded.append(fields_engine.prompt.encode(row.ticket["text"]))
            except InvalidTicket as exc:
                evaluation.refused.append(f"{row.source}: {exc.reason}: {exc.detail}")
                continue
            except ValueError as exc:
                evaluation.refused.append(f"{row.source}: {INVALID_EXPECTED}: {exc}")
                continue
            expected.append(wanted)
        answers, _ = fields_engine.classify_encoded(encoded, on_batch=on_batch) if encoded else ([], [])
        for wanted, answer in zip(expected, answers, strict=True):
            evaluation.add(wanted, answer)
        if on_chunk is not None:
            on_chunk(len(chunk))
    return evaluation
