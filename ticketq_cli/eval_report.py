"""`ticketq eval`'s report: the tables of a scored file (per label, confusion, coverage per
threshold; per field for a schema), printed on a rich Console. `ticketq_cli.evaluate` scores."""

from __future__ import annotations

from collections.abc import Sequence

from ticketq_cli.evaluate import FieldsEvaluation, Scores, SetScores, field_thresholds


def print_scores(
    out, scores: Scores, thresholds: Sequence[float], gate: str = "margin", own: float | None = None
) -> None:
    """A single-label field's tables on `out` (a rich Console): per label, confusion, coverage per
    threshold on `gate` (`own`, the schema's threshold, marked)."""
    from rich.table import Table

    out.print(_per_label_table(scores.per_label()))
    matrix = Table(title="confusion: expected (rows) x predicted")
    matrix.add_column("expected")
    for label in scores.labels:
        matrix.add_column(label, justify="right")
    for expected in scores.labels:
        matrix.add_row(expected, *(str(scores.confusion[expected, predicted]) for predicted in scores.labels))
    out.print(matrix)
    out.print(_coverage_table(scores.coverage(thresholds), f"auto-answered at {gate} >= threshold", own))


def print_set_scores(out, scores: SetScores, thresholds: Sequence[float], own: float | None = None) -> None:
    """A multi-label field's tables on `out`: per label, and exact-set accuracy per confidence threshold."""
    out.print(_per_label_table(scores.per_label()))
    out.print(_coverage_table(scores.coverage(thresholds), "auto-answered at confidence >= threshold (exact set)", own))


def print_fields(out, evaluation: FieldsEvaluation, thresholds: Sequence[float]) -> None:
    """Every field's figures on `out`, one section per field, in the schema's order."""
    schema = evaluation.schema
    out.print(f"schema {schema.name}: {evaluation.scored} of {evaluation.rows} rows scored "
              f"({evaluation.unlabelled} without `expected`)", highlight=False)  # fmt: skip
    for spec in schema.fields:
        scores = evaluation.fields[spec.name]
        kind, accuracy = ("multi-label", "exact-set accuracy") if spec.multi else ("single-label", "accuracy")
        if not scores.scored:
            out.print(f"\n[bold]{spec.name}[/] ({kind}): not scored, no row's `expected` names it", highlight=False)
            continue
        missing = evaluation.missing[spec.name]
        left_out = f", {_rows(missing)} without it" if missing else ""
        out.print(f"\n[bold]{spec.name}[/] ({kind}): {_rows(scores.scored)} scored{left_out}; {accuracy} "
                  f"{scores.accuracy:.1%}", highlight=False)  # fmt: skip
        cuts = field_thresholds(thresholds, spec.threshold)
        if isinstance(scores, SetScores):
            print_set_scores(out, scores, cuts, spec.threshold)
        else:
            print_scores(out, scores, cuts, "confidence", spec.threshold)


def _rows(count: int) -> str:
    return f"{count} row{'s' * (count != 1)}"


def _per_label_table(per_label: dict[str, dict[str, float]]):
    from rich.table import Table

    table = Table(title="per label")
    for column in ("label", "precision", "recall", "F1", "support"):
        table.add_column(column, justify="left" if column == "label" else "right")
    for label, row in per_label.items():
        table.add_row(label, f"{row['precision']:.1%}", f"{row['recall']:.1%}", f"{row['f1']:.1%}", str(row["support"]))
    return table


def _coverage_table(rows: list[dict[str, float]], title: str, own: float | None):
    from rich.table import Table

    table = Table(title=title, caption="* the schema's review threshold" if own is not None else None)
    for column in ("threshold", "coverage", "accuracy", "answered"):
        table.add_column(column, justify="right")
    for row in rows:
        accuracy = f"{row['accuracy']:.1%}" if row["answered"] else "-"
        mark = " *" if row["threshold"] == own else ""
        table.add_row(f"{row['threshold']:g}{mark}", f"{row['coverage']:.1%}", accuracy, str(row["answered"]))
    return table
