"""Ticket files in and result files out: JSONL or CSV tickets, JSONL results.

Input rows are `{"id": ..., "text": ...}` (JSONL, one object a line; `id` optional) or a CSV with a
header naming a `text` column and optionally an `id` column. Each row is a ticket under the
contract's rule (`ticketq.contract.validate_ticket`: the worker's), and an id may appear once per
file. A row without an id (in a CSV, an empty `id` cell) becomes `line-N` (N = the row's line
number). An optional string `expected` field or column is kept, so a labelled file can be scored.

A malformed or refused row does not stop the file: it becomes a `RowError` naming the file and
line, and the good rows still go through. Every non-blank row ends as exactly one ticket or one
error, so `results_in_order` can give one result row per input row. A CSV record whose quoting is broken (an
unterminated quote would otherwise swallow every row after it) is reported at the line where it
starts, and reading resumes on the next line. Only a file that cannot be read at all (missing,
not UTF-8 for CSV, a CSV without a `text` column) raises `TicketFileError`.

Results are written atomically (a temporary file in the same directory, then a rename), and
`check_output` refuses to replace the input or, without `force`, any existing file.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ticketq.contract import MAX_TICKET_BYTES, Reason, TicketRejected, UniqueIds, validate_ticket

Format = Literal["auto", "jsonl", "csv"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")


class TicketFileError(Exception):
    """The whole file cannot be used (unreadable, wrong encoding, no `text` column)."""


class OutputError(Exception):
    """The results file may not be written there (exists, is the input, no such directory)."""


@dataclass(frozen=True)
class RowError:
    """One malformed row; `str()` reads like a compiler error: `path:line: message`.

    `reason` is a `ticketq.contract.Reason` value, the worker's where they mean the same; `id` is
    the row's ticket id when it could be read.
    """

    path: str
    line: int
    message: str
    reason: str = Reason.MALFORMED_ROW.value
    id: str | None = None

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"

    def as_result(self) -> dict:
        """The failed result row that stands for this input row in the results file."""
        return {"id": self.id or f"line-{self.line}", "status": "failed", "reason": self.reason,
                "error": self.message, "source": f"{self.path}:{self.line}"}  # fmt: skip


@dataclass
class TicketFile:
    """What `read_tickets` found: the good tickets, in file order, and one error per bad row."""

    path: Path
    tickets: list[dict] = field(default_factory=list)
    errors: list[RowError] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)  # ticket id -> line where its row starts

    @property
    def rows(self) -> int:
        """Non-blank rows read: every one is a ticket or an error."""
        return len(self.tickets) + len(self.errors)

    def source(self, ticket_id: str) -> str:
        return f"{self.path}:{self.lines[ticket_id]}"

    def results_in_order(self, results: Iterable[dict]) -> list[dict]:
        """One result row per input row, in file order, each with its `source` (`file:line`).

        `results` are keyed by ticket id; a ticket without one becomes a failed row
        (`no_result`), so no input row can go missing from the results file.
        """
        by_id = {result.get("id"): result for result in results}
        rows = [(error.line, error.as_result()) for error in self.errors]
        for ticket in self.tickets:
            result = by_id.get(ticket["id"]) or {
                "id": ticket["id"], "status": "failed", "reason": Reason.NO_RESULT.value,
                "error": "no result for this ticket",
            }  # fmt: skip
            rows.append((self.lines[ticket["id"]], {**_with_reason(result), "source": self.source(ticket["id"])}))
        rows.sort(key=lambda row: row[0])  # stable: one row per line, so the order is the file's
        return [row for _, row in rows]


_REASON_PREFIX = re.compile(r"^([a-z_]+): ")


def _with_reason(result: dict) -> dict:
    """A failed result always names a reason: the worker's, else the code its error starts with."""
    if result.get("status") == "ok" or result.get("reason"):
        return result
    match = _REASON_PREFIX.match(str(result.get("error", "")))
    return {**result, "reason": match.group(1) if match else str(result.get("status") or "failed")}


class _Collector:
    """Turns raw rows into tickets with the contract's validator, recording errors (duplicate ids too)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.result = TicketFile(path)
        self.max_bytes = max_bytes
        self._ids = UniqueIds()

    def error(self, line: int, message: str, reason: str = Reason.MALFORMED_ROW, ticket_id: str | None = None) -> None:
        self.result.errors.append(RowError(str(self.result.path), line, message, str(reason), ticket_id))

    def add(self, line: int, row: dict) -> None:
        """One row's fields (`id`, `text`, `expected`; others are ignored): a ticket or an error."""
        try:
            ticket = validate_ticket(row, self.max_bytes)
            _check_expected(row.get("expected"))
            ticket_id = ticket.id or f"line-{line}"
            self._ids.add(ticket_id, f"on line {line}")  # last: a refused row does not claim its id
        except TicketRejected as exc:
            self.error(line, exc.detail, exc.reason, _readable_id(row.get("id"), line))
            return
        found = {"id": ticket_id, "text": ticket.text}
        if row.get("expected"):
            found["expected"] = row["expected"]
        self.result.tickets.append(found)
        self.result.lines[ticket_id] = line


def _check_expected(expected: object) -> None:
    """`expected` (a file's label for scoring, not part of the ticket) is a string when present."""
    if expected is not None and not isinstance(expected, str):
        raise TicketRejected(Reason.WRONG_TYPE, f"'expected' must be a string, got {type(expected).__name__}")


def _readable_id(raw_id: object, line: int) -> str:
    """The id a refused row is reported under: its own when it has a usable one, else `line-N`."""
    if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) and str(raw_id).strip():
        return str(raw_id)
    return f"line-{line}"


def read_tickets(path: str | Path, fmt: Format = "auto", max_bytes: int = MAX_TICKET_BYTES) -> TicketFile:
    """Read a JSONL or CSV ticket file; `fmt="auto"` goes by extension, then by the first byte.

    `max_bytes` is TICKETQ_MAX_TICKET_BYTES: a longer text is a refused row (`oversize`), as the
    worker would refuse it.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TicketFileError(f"{path}: cannot read ticket file: {exc.strerror or exc}") from exc
    if fmt == "auto":
        fmt = _guess_format(path, data)
    collector = _Collector(path, max_bytes)
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
            collector.error(number, f"not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                            Reason.INVALID_UTF8)
            continue
        except json.JSONDecodeError as exc:
            collector.error(number, f"invalid JSON: {exc.msg} (column {exc.colno})", Reason.INVALID_JSON)
            continue
        if not isinstance(row, dict):
            collector.error(number, f"expected a JSON object, got {type(row).__name__}", Reason.INVALID_JSON)
            continue
        collector.add(number, row)


def _parse_csv(data: bytes, collector: _Collector) -> None:
    path = collector.result.path
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TicketFileError(f"{path}:{line}: CSV file is not valid UTF-8") from exc
    records = _csv_records(text)
    header, header_line = _read_header(records, path)
    columns = {name.strip().lower(): index for index, name in enumerate(header)}
    if "text" not in columns:
        raise TicketFileError(
            f"{path}:{header_line}: CSV header must name a 'text' column (and optionally 'id'), got {header}"
        )
    for line, row in records:
        if isinstance(row, str):
            collector.error(line, row, Reason.MALFORMED_CSV)
        elif len(row) != len(header):
            message = f"expected {len(header)} fields ({','.join(header)}), got {len(row)}"
            collector.error(line, message, Reason.MALFORMED_CSV)
        else:
            # A CSV cell cannot be absent: an empty id cell means "no id" (JSONL leaves the field out).
            fields = {"id": _cell(row, columns, "id") or None, "text": row[columns["text"]],
                      "expected": _cell(row, columns, "expected")}  # fmt: skip
            collector.add(line, fields)


class _Lines:
    """The file's physical lines as an iterator whose position can be moved back (`pos`)."""

    def __init__(self, text: str) -> None:
        # newline="" splits on \n, \r\n and \r only, as the csv module does (not on U+2028).
        self.lines = io.StringIO(text, newline="").readlines()
        self.pos = 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        if self.pos >= len(self.lines):
            raise StopIteration
        self.pos += 1
        return self.lines[self.pos - 1]


def _csv_records(text: str) -> Iterator[tuple[int, list[str] | str]]:
    """`(start line, fields)` per non-blank record, the header first; `(start line, message)` for a broken one.

    A quoted field may span lines, so one broken quote can swallow the rest of the file. Strict
    mode makes the csv module raise instead (end of data inside quotes, text after a closing
    quote). A broken record, or one spanning lines with the wrong number of fields, is reported at
    its first line and reading resumes on the line after it: each line after it is still a row.
    """
    lines = _Lines(text)
    reader = csv.reader(lines, strict=True)
    width = None  # fields in the header
    while True:
        start = lines.pos
        try:
            row: list[str] | str = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            problem = _csv_problem(exc, start + 1, lines.pos)
            row = f"malformed CSV: {problem}; row skipped, reading resumes on the next line"
        if isinstance(row, list) and not any(cell.strip() for cell in row):
            continue
        width = len(row) if width is None and isinstance(row, list) else width
        if isinstance(row, str) or (len(row) != width and lines.pos > start + 1):
            lines.pos = start + 1  # give the swallowed lines back as rows of their own
            reader = csv.reader(lines, strict=True)  # a fresh reader: the old one stopped mid-record
        yield start + 1, row


def _csv_problem(exc: csv.Error, start: int, found: int) -> str:
    message = str(exc)
    if message == "unexpected end of data":
        return "unterminated quote (a quoted field is never closed)"
    if "expected after" in message:  # csv's "',' expected after '\"'"
        where = f" (a quote opened on line {start} closes on line {found})" if found > start else ""
        return f"text after a closing quote{where}; inside a quoted field write a quote as \"\""
    return message


def _read_header(records: Iterator[tuple[int, list[str] | str]], path: Path) -> tuple[list[str], int]:
    for line, row in records:
        if isinstance(row, str):
            raise TicketFileError(f"{path}:{line}: malformed CSV header: {row}")
        return row, line
    raise TicketFileError(f"{path}: CSV file is empty; it needs a header with 'id,text'")


def _cell(row: list[str], columns: dict[str, int], name: str) -> str | None:
    return row[columns[name]] if name in columns else None


def check_output(out: str | Path, inputs: Iterable[str | Path] = (), force: bool = False) -> Path:
    """Refuse a results path that would destroy something; call it before any slow work.

    Never the input (even with `force`), an existing file only with `force`, and the directory
    must exist. Returns the path to write.
    """
    out = Path(out)
    target = out.resolve()
    for source in inputs:
        if target == Path(source).resolve() or (target.exists() and os.path.samefile(target, source)):
            raise OutputError(f"--out {out} is the input file {source}; results would overwrite the tickets")
    if target.is_dir():
        raise OutputError(f"--out {out} is a directory; give a file name")
    if not target.parent.is_dir():
        raise OutputError(f"--out {out}: directory {target.parent} does not exist")
    if target.exists() and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    return out


def write_results(path: str | Path, results: Iterable[dict], overwrite: bool = True) -> int:
    """Write one JSON object a line (UTF-8, non-ASCII kept readable); returns the count written.

    Atomic: the rows go to a temporary file in the same directory, which then replaces `path`,
    so a crash leaves either the old file or the whole new one, never half a file. With
    `overwrite=False` an existing `path` is never replaced (`OutputError`), even one created
    while the results were being computed.
    """
    path = Path(path)
    handle, temp = tempfile.mkstemp(dir=path.resolve().parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8", newline="\n") as out:
            os.fchmod(out.fileno(), 0o666 & ~_umask())  # mkstemp makes it private (0600); a results file is not
            count = _write_rows(out, results)
            out.flush()
            os.fsync(out.fileno())
        _publish(temp, path, overwrite)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)
    return count


def _write_rows(out: io.TextIOBase, results: Iterable[dict]) -> int:
    count = 0
    for result in results:
        out.write(json.dumps(result, ensure_ascii=False, sort_keys=False))
        out.write("\n")
        count += 1
    return count


def _publish(temp: str, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(temp, path)
        return
    try:
        os.link(temp, path)  # fails if `path` exists, atomically: no check-then-write race
    except FileExistsError:
        raise OutputError(f"{path} already exists; pass --force to replace it, or choose another --out") from None
    except OSError:  # a file system without hard links: check, then rename
        if path.exists():
            raise OutputError(f"{path} already exists; pass --force to replace it, or choose another --out") from None
        os.replace(temp, path)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return mask
