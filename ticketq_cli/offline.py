"""Classify a ticket file in-process, no Redis: the article's own use case (a backlog, one machine).

Every input row ends as exactly one result row, in file order, with its `source` (`file:line`):
`ok` with a label, or `failed` with a reason: the file reader applies the ticket contract
(`ticketq.contract`, TICKETQ_MAX_TICKET_BYTES included) exactly as the queue path does, so a row is
refused or classified here as it would be there.

The file is streamed: rows are read, tokenised and classified a chunk at a time, and each chunk's
result rows are appended to the partial results file (`producer.resultfile.PartialResults`) before
the next chunk is read, so memory holds one chunk however large the file. Chunks start at
FIRST_CHUNK rows, so the first result row comes after one forward pass of one ticket even from
the full-size model on a slow CPU (16 rows would take several: the planner cuts them by
length), and double up to LARGEST_CHUNK rows or CHUNK_TEXT_CHARS characters of text: a chunk
that large plans nearly as well as the whole file at once (docs/performance.md, "Offline classify of a large file").
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tqdm import tqdm

from producer.resultfile import PartialResults
from producer.ticketfile import TicketReader
from producer.ticketrows import Row, RowError, TicketRow
from ticketq.cli import MAX_SHOWN
from ticketq.schema import TicketFields
from worker.engine.prompt import InvalidTicket
from worker.results import BatchReport, Prediction

if TYPE_CHECKING:
    from worker.engine import Engine
    from worker.engine.fields import FieldsEngine

FIRST_CHUNK = 1  # rows
LARGEST_CHUNK = 2048  # rows
CHUNK_TEXT_CHARS = 8 << 20  # a chunk of long tickets stops sooner: 8 Mi characters of ticket text


class Failures(Sequence[str]):
    """How many rows failed and the first MAX_SHOWN of them as `source: reason: error` lines.

    `ticketq.cli.report` takes it as its list: it prints the first MAX_SHOWN lines and
    counts the rest, so the other lines are never needed (they are all in the results file).
    """

    def __init__(self) -> None:
        self.shown: list[str] = []
        self.count = 0

    def add(self, line: str) -> None:
        self.count += 1
        if len(self.shown) < MAX_SHOWN:
            self.shown.append(line)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):  # type: ignore[override]
        return self.shown[index]


@dataclass
class Summary:
    """Counts over the results file's rows, kept as each one is written (memory stays flat).

    A resumed run counts the partial file's earlier rows too; `classified`, `seconds` and the
    padding figures are this run's.
    """

    rows: int = 0
    ok: int = 0
    labels: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    failures: Failures = field(default_factory=Failures)
    classified: int = 0  # tickets this run labelled
    seconds: float = 0.0  # this run, from the model's load to the last row
    computed_tokens: int = 0
    pad_tokens: int = 0

    @property
    def failed(self) -> int:
        return self.rows - self.ok

    @property
    def items_per_s(self) -> float:
        return self.classified / self.seconds if self.seconds else 0.0

    @property
    def padding_ratio(self) -> float:
        return self.pad_tokens / self.computed_tokens if self.computed_tokens else 0.0

    def add(self, row: dict) -> None:
        """Count one row of the results file (a schema's answer: each field's labels, `field=label`)."""
        self.rows += 1
        if row.get("status") == "ok":
            self.ok += 1
            if "fields" not in row:
                self.labels[row.get("label")] += 1
            for name, answer in (row.get("fields") or {}).items():
                for label in answer.get("labels") or [answer.get("label")]:
                    self.labels[f"{name}={label}"] += 1
            return
        self.reasons[str(row.get("reason") or row.get("status"))] += 1
        self.failures.add(f"{row.get('source')}: {row.get('reason')}: {row.get('error')}")

    def add_reports(self, reports: Iterable[BatchReport]) -> None:
        for report in reports:
            self.computed_tokens += report.computed_tokens
            self.pad_tokens += report.pad_tokens

    def line(self) -> str:
        """`read N rows: X ok, Y failed (count reason, ...)`, as `ticketq.cli.summary_line` words it."""
        detail = ", ".join(f"{count} {reason}" for reason, count in self.reasons.most_common())
        return f"read {self.rows} rows: {self.ok} ok, {self.failed} failed" + (f" ({detail})" if detail else "")


def classify_rows(load_engine: Callable[[], Engine | FieldsEngine], reader: TicketReader, partial: PartialResults,
                  summary: Summary, progress: bool = True) -> Summary:  # fmt: skip
    """Classify the rows of `reader` that `partial` has no result for, appending each chunk's results.

    `load_engine` is called once, when the first chunk with a ticket in it comes, so a file with
    nothing to classify never loads the model. It may return a schema's `FieldsEngine`: each row is
    then answered with every field of the schema, the worker's result shape (`contract.Triaged`).
    """
    bar, engine, started = None, None, time.perf_counter()
    try:
        for chunk in chunked(partial.remaining(reader)):
            if engine is None and any(isinstance(row, TicketRow) for row in chunk):
                engine, started = load_engine(), time.perf_counter()
            if bar is None:  # made after the model's loading messages
                bar = _Progress(reader, progress, summary.rows)
            rows = classify_chunk(engine, chunk, summary, bar.batch_done)
            partial.append(rows)
            for row in rows:
                summary.add(row)
            bar.chunk_done(summary.rows)
    finally:
        summary.seconds = time.perf_counter() - started if engine else 0.0
        if bar is not None:
            bar.close()
    return summary


class _Progress:
    """A tqdm bar on stderr over the file's rows, only where stderr is a terminal (no frames in a pipe or a log).

    Its total is the file's line count (`TicketReader.line_count`): a CSV record may span lines and
    a blank line is no row, so the total is settled to the rows read at the end. Rows count as their
    forward batches finish: with the full-size model a chunk of 2,048 tickets takes minutes. A
    resumed run starts at the rows its partial file holds.
    """

    def __init__(self, reader: TicketReader, enabled: bool, done: int) -> None:
        live = enabled and sys.stderr.isatty()  # frames in a pipe are carriage returns; the summary says it all
        total = max(reader.line_count() - (reader.format == "csv"), done) if live else None
        self.bar = tqdm(total=total, initial=done, unit="row", desc="classifying", disable=not live)

    def batch_done(self, report: BatchReport) -> None:
        self.bar.update(report.rows)

    def chunk_done(self, rows: int) -> None:
        self.bar.update(rows - self.bar.n)

    def close(self) -> None:
        if not self.bar.disable:
            self.bar.total = self.bar.n
            self.bar.refresh()
        self.bar.close()


def chunked(rows: Iterable[Row], first: int = FIRST_CHUNK, largest: int = LARGEST_CHUNK,
            text_chars: int = CHUNK_TEXT_CHARS) -> Iterator[list[Row]]:  # fmt: skip
    """`rows` in runs of `first` rows, then twice as many each time up to `largest` (or `text_chars` of text)."""
    size, chunk, chars = first, [], 0
    for row in rows:
        chunk.append(row)
        chars += len(row.ticket["text"]) if isinstance(row, TicketRow) else 0
        if len(chunk) >= size or chars >= text_chars:
            yield chunk
            size, chunk, chars = min(2 * size, largest), [], 0
    if chunk:
        yield chunk


def classify_chunk(engine: Engine | FieldsEngine | None, chunk: Sequence[Row], summary: Summary,
                   on_batch: Callable[[BatchReport], None] | None = None) -> list[dict]:  # fmt: skip
    """One result row per row of `chunk`, in its order: refused rows failed, the tickets classified in one plan.

    `engine` may be None only for a chunk without a ticket; `on_batch` gets each forward's report.
    """
    tickets = [row for row in chunk if isinstance(row, TicketRow)]
    answers = _answers(engine, tickets, summary, on_batch) if tickets else {}
    return [row.as_result() if isinstance(row, RowError) else {**answers[row.line], "source": row.source}
            for row in chunk]  # fmt: skip


def _answers(engine: Engine | FieldsEngine, tickets: list[TicketRow], summary: Summary,
             on_batch: Callable[[BatchReport], None] | None) -> dict[int, dict]:  # fmt: skip
    """Each ticket's result (all but its `source`), by line."""
    answers, encoded, good = {}, [], []
    for row in tickets:
        try:
            encoded.append(engine.prompt.encode(row.ticket["text"]))
            good.append(row)
        except InvalidTicket as exc:
            answers[row.line] = {"id": row.result_id, "status": "failed", "reason": exc.reason, "error": exc.detail}
    predictions, reports = engine.classify_encoded(encoded, on_batch=on_batch) if encoded else ([], [])
    summary.add_reports(reports)
    summary.classified += len(predictions)
    info = getattr(engine, "engine", engine).info  # a FieldsEngine answers on its engine's model
    for row, prediction in zip(good, predictions, strict=True):
        answers[row.line] = {"id": row.result_id, "status": "ok", **_answer(prediction), "model": info.name,
                             "standin": info.standin, "precision": prediction.precision,
                             "rechecked": prediction.rechecked, "scorer": prediction.scorer}  # fmt: skip
    return answers


def _answer(prediction: Prediction | TicketFields) -> dict:
    """The answer's part of a result row, as the worker words it (`contract.Classified` / `Triaged`)."""
    if isinstance(prediction, TicketFields):
        return prediction.to_json()
    return {"label": prediction.label, "probs": prediction.probs, "margin": prediction.margin,
            "truncated": prediction.truncated}  # fmt: skip
