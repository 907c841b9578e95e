"""Ticket files in and result files out: JSONL or CSV tickets, JSONL results.

Input rows are `{"id": ..., "text": ...}` (JSONL, one object a line; `id` optional) or a CSV with a
header naming a `text` column and optionally an `id` column. A missing or empty id becomes
`line-N` (N = the row's line number). An optional string `expected` field or column is kept, so a
labelled file can be scored.

A malformed row does not stop the file: it becomes a `RowError` naming the file and line, and the
good rows still go through. Only a file that cannot be read at all (missing, not UTF-8 for CSV, a
CSV without a `text` column) raises `TicketFileError`.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Format = Literal["auto", "jsonl", "csv"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


class TicketFileError(Exception):
    """The whole file cannot be used (unreadable, wrong encoding, no `text` column)."""


@dataclass(frozen=True)
class RowError:
    """One malformed row; `str()` reads like a compiler error: `path:line: message`."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class TicketFile:
    """What `read_tickets` found: the good tickets, in file order, and one error per bad row."""

    path: Path
    tickets: list[dict] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)


class _Collector:
    """Turns raw rows into tickets, recording errors (and duplicate ids) as it goes."""

    def __init__(self, path: Path) -> None:
        self.result = TicketFile(path)
        self._seen: dict[str, int] = {}

    def error(self, line: int, message: str) -> None:
        self.result.errors.append(RowError(str(self.result.path), line, message))

    def add(self, line: int, raw_id: object, text: object, expected: object = None) -> None:
        problem = _row_problem(raw_id, text, expected)
        ticket_id = f"line-{line}" if raw_id in (None, "") else str(raw_id)
        if problem is None and ticket_id in self._seen:
            problem = f"duplicate id {ticket_id!r} (first seen on line {self._seen[ticket_id]})"
        if problem is not None:
            self.error(line, problem)
            return
        self._seen[ticket_id] = line
        ticket = {"id": ticket_id, "text": text}
        if expected:
            ticket["expected"] = expected
        self.result.tickets.append(ticket)


def _row_problem(raw_id: object, text: object, expected: object) -> str | None:
    """What is wrong with one row's fields, or None."""
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, (str, int))):
        return f"'id' must be a string or an integer, got {type(raw_id).__name__}"
    if text is None:
        return "missing 'text'"
    if not isinstance(text, str):
        return f"'text' must be a string, got {type(text).__name__}"
    if not text.strip():
        return "'text' is empty or only whitespace"
    if expected is not None and not isinstance(expected, str):
        return f"'expected' must be a string, got {type(expected).__name__}"
    return None


def read_tickets(path: str | Path, fmt: Format = "auto") -> TicketFile:
    """Read a JSONL or CSV ticket file; `fmt="auto"` goes by extension, then by the first byte."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TicketFileError(f"{path}: cannot read ticket file: {exc.strerror or exc}") from exc
    if fmt == "auto":
        fmt = _guess_format(path, data)
    collector = _Collector(path)
    if fmt == "jsonl":
        _parse_jsonl(data, collector)
    elif fmt == "csv":
        _parse_csv(data, collector)
    else:
        raise ValueError(f"unknown ticket file format {fmt!r}; expected 'auto', 'jsonl' or 'csv'")
    return collector.result


def _guess_format(path: Path, data: bytes) -> Format:
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".csv":
        return "csv"
    return "jsonl" if data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{") else "csv"


def _parse_jsonl(data: bytes, collector: _Collector) -> None:
    # Split on b"\n" only: str.splitlines() would also split on U+2028 inside a JSON string.
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            collector.error(number, f"not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})")
            continue
        except json.JSONDecodeError as exc:
            collector.error(number, f"invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(row, dict):
            collector.error(number, f"expected a JSON object, got {type(row).__name__}")
            continue
        collector.add(number, row.get("id"), row.get("text"), row.get("expected"))


def _parse_csv(data: bytes, collector: _Collector) -> None:
    path = collector.result.path
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TicketFileError(f"{path}:{line}: CSV file is not valid UTF-8") from exc
    reader = csv.reader(io.StringIO(text, newline=""))
    header, header_line = _read_header(reader, path)
    columns = {name.strip().lower(): index for index, name in enumerate(header)}
    if "text" not in columns:
        raise TicketFileError(
            f"{path}:{header_line}: CSV header must name a 'text' column (and optionally 'id'), got {header}"
        )
    previous_end = reader.line_num
    while True:
        start = previous_end + 1  # a quoted field can span lines; report where the row starts
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            collector.error(start, f"malformed CSV: {exc}")
            if reader.line_num == previous_end:  # the reader made no progress: stop, don't spin
                break
            previous_end = reader.line_num
            continue
        previous_end = reader.line_num
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        if len(row) != len(header):
            collector.error(start, f"expected {len(header)} fields ({','.join(header)}), got {len(row)}")
            continue
        collector.add(
            start,
            _cell(row, columns, "id"),
            row[columns["text"]],
            _cell(row, columns, "expected"),
        )


def _read_header(reader: csv.Reader, path: Path) -> tuple[list[str], int]:
    try:
        for header in reader:
            if header and any(cell.strip() for cell in header):
                return header, reader.line_num
    except csv.Error as exc:
        raise TicketFileError(f"{path}:{reader.line_num}: malformed CSV header: {exc}") from exc
    raise TicketFileError(f"{path}: CSV file is empty; it needs a header with 'id,text'")


def _cell(row: list[str], columns: dict[str, int], name: str) -> str | None:
    return row[columns[name]] if name in columns else None


def write_results(path: str | Path, results: Iterable[dict]) -> int:
    """Write one JSON object a line (UTF-8, non-ASCII kept readable); returns the count written."""
    count = 0
    with Path(path).open("w", encoding="utf-8", newline="\n") as out:
        for result in results:
            out.write(json.dumps(result, ensure_ascii=False, sort_keys=False))
            out.write("\n")
            count += 1
    return count
