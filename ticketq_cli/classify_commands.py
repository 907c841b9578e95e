"""`ticketq classify` (a ticket file classified in this process) and `ticketq eval` (a labelled file
scored): the commands, their options and what they print; `offline` and `evaluate` do the work."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from producer.resultfile import OutputError, PartialResults, check_output
from producer.ticketfile import TicketReader
from producer.ticketrows import Row, TicketFileError
from ticketq.cli import report
from ticketq.exits import EXIT_NOTHING, exit_status
from ticketq_cli.common import (
    DEFAULT_OUT,
    ENGINE_FLAGS,
    check_model,
    console,
    fail,
    log_to_stderr,
    read_settings,
)

# The options both commands take, and classify's output ones: one alias each, so a command's
# signature is one line per option.
OutOpt = Annotated[
    Path | None, typer.Option("--out", "-o", help=f"Results JSONL, a row per input row \\[default: {DEFAULT_OUT}].")
]
ForceOpt = Annotated[
    bool, typer.Option("--force", "-f", help="Replace --out if it exists; start again over a stopped run.")
]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue a stopped run from OUT.partial (its rows are kept).")
]
FormatOpt = Annotated[str, typer.Option("--format", help="auto (by extension, then content), jsonl or csv.")]
ThresholdsOpt = Annotated[
    str, typer.Option(help="Margin (confidence) thresholds for the coverage tables, comma-separated.")
]
ModelOpt = Annotated[str | None, typer.Option(help="Hub id or local dir (default TICKETQ_MODEL).")]
DtypeOpt = Annotated[str | None, typer.Option(help="auto|float32|bfloat16|float16|int8.")]
DeviceOpt = Annotated[str | None, typer.Option(help="auto|cpu|cuda|mps.")]
ProgressOpt = Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")]


def classify(
    path: Annotated[Path, typer.Argument(help="Tickets: JSONL ({'id','text'}) or CSV with id,text columns.")],
    out: OutOpt = None,
    force: ForceOpt = False,
    resume: ResumeOpt = False,
    fmt: FormatOpt = "auto",
    schema_path: Annotated[Path | None, typer.Option("--schema", help="Answer every field of this schema (TOML), "
                           "in the worker's result shape, instead of TICKETQ_LABELS.")] = None,
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Classify a ticket file in-process (no Redis): every input row gets one result row (ok or failed).

    The file is read and classified a chunk at a time; result rows go to OUT.partial as they are
    done, and it becomes OUT once every row is in. Stopped (Ctrl-C: exit status 130), a run keeps
    its rows there, and --resume continues it.
    """
    settings = _offline_settings(model, dtype, device)
    schema = _schema_option(schema_path)
    _check_format(fmt)
    try:
        out = check_output(out or DEFAULT_OUT, [path], force)
        reader = TicketReader(path, fmt, settings.max_ticket_bytes)  # type: ignore[arg-type]
    except (TicketFileError, OutputError) as exc:
        fail(str(exc))
    with reader:
        check_model(settings)
        from ticketq_cli.offline import Summary

        summary = Summary()
        try:
            partial = PartialResults(out, path, resume=resume, force=force, on_row=summary.add)
        except OutputError as exc:
            fail(str(exc))
        if resume:
            done = f"{partial.rows} rows of {partial.path} kept" if partial.resumed else f"no {partial.path}"
            console.print(f"resuming: {done}; classifying the rows after them", highlight=False, markup=False)
        _classify(settings, reader, partial, summary, progress, schema)
    try:
        partial.publish(overwrite=force)
    except OutputError as exc:
        fail(f"{exc}; all {partial.rows} rows are in {partial.path}")
    _report_classified(summary, path, out)
    raise typer.Exit(exit_status(summary.ok, summary.failed))


EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _classify(settings, reader: TicketReader, partial: PartialResults, summary, progress: bool, schema=None) -> None:
    """Classify the rows not yet in `partial`, loading the model only if a row needs it.

    However it stops (Ctrl-C, a crash, a model that cannot load), the rows done stay in the
    partial file and one line says how many and how to go on; with no row done, no file is left.
    """
    from ticketq_cli.offline import classify_rows

    def load():
        engine = _load_engine(settings, schema)
        return engine if schema is None else engine.fields(schema)

    try:
        classify_rows(load, reader, partial, summary, progress)
    except OutputError as exc:  # --resume: the partial file is not this input's; it stays as it was
        partial.close()
        fail(str(exc))
    except BaseException as exc:
        partial.close()
        nothing = partial.rows == 0 and not partial.resumed
        if nothing:  # nothing done leaves nothing behind: the fixed rerun needs no --resume or --force
            partial.path.unlink(missing_ok=True)
        stopped = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped"
        if not nothing:
            console.print(f"{stopped}: {partial.rows} rows are in {partial.path}; run the same command with --resume "
                          "to classify the rest", highlight=False, markup=False, soft_wrap=True)  # fmt: skip
        elif stopped == "interrupted":
            console.print("interrupted: nothing was classified", highlight=False, markup=False)
        if isinstance(exc, KeyboardInterrupt):
            raise typer.Exit(EXIT_INTERRUPTED) from None
        raise


def _load_engine(settings, schema=None):
    """The engine `settings` ask for, and the heads `schema`'s fields name checked against it: one line
    and exit 2 where either cannot serve."""
    from ticketq.process import paused_gc
    from worker.engine.loading import ModelNotFound

    log_to_stderr()
    # torch's import and the model's load, the collector paused: the objects they make live as long
    # as this command, so they are frozen rather than scanned by every later collection.
    with paused_gc(freeze=True):
        from transformers.utils import logging as hf_logging

        from worker.engine.replicas import load_engine

        if not sys.stderr.isatty():  # no progress frames in a pipe or a log: not transformers' "Loading weights" either
            hf_logging.disable_progress_bar()

        from worker.engine.fieldheads import check_schema_heads

        try:
            engine = load_engine(settings)
            check_schema_heads([schema] if schema is not None else [], engine)
        except ModelNotFound as exc:
            fail(str(exc))
    if engine.info.standin:
        console.print("[yellow]stand-in model: labels are meaningless; speed is real[/]")
    return engine


def _report_classified(summary, path: Path, out: Path) -> None:
    """The failed rows on stderr; the summary table and line on stdout, as `ticketq-produce` and `ticketq eval`."""
    report(console, summary.failures, f"{summary.failed} rows failed:", f" (every row is in {out})")
    stdout = Console()
    table = Table(title=f"{path} → {out}")
    for column in ("rows", "ok", "failed", "items/s", "padding", "labels"):
        table.add_column(column, overflow="fold")
    labels = ", ".join(f"{k}={v}" for k, v in summary.labels.most_common())
    table.add_row(str(summary.rows), str(summary.ok), str(summary.failed), f"{summary.items_per_s:.2f}",
                  f"{summary.padding_ratio:.1%}", labels)  # fmt: skip
    stdout.print(table)
    stdout.print(f"{summary.line()}; results in {out}", highlight=False, markup=False, soft_wrap=True)


def evaluate(
    path: Annotated[Path, typer.Argument(help="Labelled tickets: JSONL or CSV rows with text and expected.")],
    fmt: FormatOpt = "auto",
    thresholds: ThresholdsOpt = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9",
    schema_path: Annotated[Path | None, typer.Option("--schema", help="Score every field of this schema "
                           "(TOML): `expected` is then {field: label} or {field: \\[labels]}.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write every figure to this JSON file.")] = None,
    model: ModelOpt = None,
    dtype: DtypeOpt = None,
    device: DeviceOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Score the model on your own labelled tickets: accuracy, per-label precision and recall, the
    confusion matrix, and accuracy against coverage per margin threshold (to choose a threshold).

    Each row needs an `expected` label (a field in JSONL, a column in CSV). Rows without one, and
    refused rows, are counted and not scored. Exit status 3 when no row could be scored.

    With --schema every field of the schema is scored on the rows whose `expected` object names it
    (in a CSV, the cell holds that object as JSON); a multi-label field by per-label precision and
    recall and exact-set accuracy. A row naming a field or label the schema lacks is refused.
    """
    settings = _offline_settings(model, dtype, device)
    schema = _schema_option(schema_path)
    _check_format(fmt)
    cuts = _thresholds(thresholds)
    with _open_tickets(path, fmt, settings) as reader:
        rows = _rows_to_score(reader)
        check_model(settings, hub=True)
        engine = _load_engine(settings, schema)
        from tqdm import tqdm

        from ticketq_cli.evaluate import evaluate as run_eval
        from ticketq_cli.evaluate import evaluate_fields

        with tqdm(desc="scoring", unit="row", disable=None if progress else True) as bar:  # None: off in a pipe
            if schema is None:
                evaluation = run_eval(engine, rows, on_chunk=bar.update)
            else:
                evaluation = evaluate_fields(engine.fields(schema), rows, on_chunk=bar.update)
    _report_evaluation(evaluation, cuts, engine.info.standin, json_out)
    if schema is None and engine.head is not None:  # a fitted head (TICKETQ_HEAD): zero-shot on the same rows
        _compare_zero_shot(path, fmt, settings, engine, evaluation, progress)
    if schema is not None and any(spec.head for spec in schema.fields):  # fields' heads: zero-shot beside them
        _compare_fields_zero_shot(path, fmt, settings, engine, schema, evaluation, progress)
    if evaluation.scored == 0:
        raise typer.Exit(EXIT_NOTHING)


def _compare_zero_shot(path: Path, fmt: str, settings, engine, evaluation, progress: bool) -> None:
    """The same rows scored zero-shot (the LM head's label rows), one line beside the head's accuracy."""
    from tqdm import tqdm

    from ticketq_cli.evaluate import evaluate as run_eval
    from worker.engine.head import zero_shot

    with _open_tickets(path, fmt, settings) as reader, tqdm(desc="zero-shot", unit="row",
                                                              disable=None if progress else True) as bar:  # fmt: skip
        base = run_eval(zero_shot(engine), _rows_to_score(reader), on_chunk=bar.update)
    Console().print(f"{engine.info.scorer}: accuracy {evaluation.scores.accuracy:.1%}; zero-shot on the same "
                    f"{base.scored} rows: {base.scores.accuracy:.1%}", highlight=False, markup=False)  # fmt: skip


def _compare_fields_zero_shot(path: Path, fmt: str, settings, engine, schema, evaluation, progress: bool) -> None:
    """The same rows scored by the schema without its heads: one line per headed field."""
    from dataclasses import replace

    from tqdm import tqdm

    from ticketq_cli.evaluate import evaluate_fields

    bare = engine.compile(replace(schema, fields=tuple(replace(spec, head=None) for spec in schema.fields)))
    with _open_tickets(path, fmt, settings) as reader, tqdm(desc="zero-shot", unit="row",
                                                              disable=None if progress else True) as bar:  # fmt: skip
        base = evaluate_fields(bare, _rows_to_score(reader), on_chunk=bar.update)
    for spec in (spec for spec in schema.fields if spec.head):
        head, zero = evaluation.fields[spec.name], base.fields[spec.name]
        Console().print(f"{spec.name} (head {spec.head}): accuracy {head.accuracy:.1%}; zero-shot on the same "
                        f"{zero.scored} rows: {zero.accuracy:.1%}", highlight=False, markup=False, soft_wrap=True)


def _check_format(fmt: str) -> None:
    if fmt not in ("auto", "jsonl", "csv"):
        fail(f"--format {fmt}: must be auto, jsonl or csv")


def _thresholds(thresholds: str) -> list[float]:
    """--thresholds as sorted numbers between 0 and 1, or one line and exit 2."""
    try:
        cuts = sorted({float(part) for part in thresholds.split(",") if part.strip()})
    except ValueError:
        cuts = []
    if not cuts or not all(0 <= cut <= 1 for cut in cuts):
        fail(f"--thresholds {thresholds!r}: must be numbers between 0 and 1, comma-separated")
    return cuts


def _open_tickets(path: Path, fmt: str, settings) -> TicketReader:
    """The file's reader, or one line and exit 2 for a file that cannot be used."""
    try:
        return TicketReader(path, fmt, settings.max_ticket_bytes)  # type: ignore[arg-type]
    except TicketFileError as exc:
        fail(str(exc))


def _rows_to_score(reader: TicketReader) -> Iterator[Row]:
    """The reader's rows; for a file with none, one line and exit 3 before the model is looked at."""
    rows = iter(reader)
    first = next(rows, None)
    if first is None:
        fail(f"{reader.path}: no rows to score (the file is empty); each row needs a text and an expected label",
             EXIT_NOTHING)  # fmt: skip
    return itertools.chain([first], rows)


def _offline_settings(model: str | None, dtype: str | None, device: str | None):
    """The settings for a model run in this process; TICKETQ_NULL_CLASSIFIER refused in one line:
    it measures the queue's own cost, and here there is no queue, only hashed labels."""
    settings = read_settings(ENGINE_FLAGS, model=model, dtype=dtype, device=device)
    if settings.null_classifier:
        fail("TICKETQ_NULL_CLASSIFIER is on: it measures a worker's queue overhead with hashed labels, and "
             "classify/eval run no queue; unset it (or set it to 0) to use the model")
    return settings


def _schema_option(path: Path | None):
    """`--schema`: the schema, or one line per problem and exit 2, before the model loads."""
    if path is None:
        return None
    from ticketq.schema import SchemaError, load_schema

    try:
        return load_schema(path)
    except SchemaError as exc:
        fail(f"--schema {path}:\n{exc}" if len(exc.problems) > 1 else f"--schema {exc}")


def _report_evaluation(evaluation, cuts: list[float], standin: bool, json_out: Path | None) -> None:
    from ticketq_cli.eval_report import print_fields, print_scores
    from ticketq_cli.evaluate import FieldsEvaluation

    out = Console()
    report(console, evaluation.refused, f"{len(evaluation.refused)} rows refused (not scored):")
    if isinstance(evaluation, FieldsEvaluation):
        print_fields(out, evaluation, cuts)
        figures = evaluation.as_dict(cuts)
    else:
        scores = evaluation.scores
        if scores.unknown:
            unknown = ", ".join(f"{label!r} x{count}" for label, count in scores.unknown.most_common())
            console.print(f"not scored: expected labels the model does not have: {unknown} (labels: "
                          f"{', '.join(scores.labels)})", highlight=False, markup=False, soft_wrap=True)  # fmt: skip
        out.print(f"scored {scores.scored} of {evaluation.rows} rows ({evaluation.unlabelled} without `expected`); "
                  f"accuracy {scores.accuracy:.1%}", highlight=False)  # fmt: skip
        print_scores(out, scores, cuts)
        figures = {**scores.as_dict(cuts), "rows": evaluation.rows, "unlabelled": evaluation.unlabelled,
                   "refused": len(evaluation.refused)}  # fmt: skip
    if standin:
        console.print("[yellow]stand-in model (random weights): these figures mean nothing about a real model[/]")
    if json_out is not None:
        json_out.write_text(json.dumps({**figures, "standin": standin}, indent=2) + "\n", encoding="utf-8")
