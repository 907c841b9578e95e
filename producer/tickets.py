"""Ticket files in and result files out: JSONL or CSV tickets, JSONL results.

Input rows are `{"id": ..., "text": ...}` (JSONL, one object a line; `id` optional) or a CSV with a
header naming a `text` column and optionally an `id` column. Each row is a ticket under the
contract's rule (`ticketq.contract.validate_ticket`: the worker's), and an id may appear once per
file. A row without an id (in a CSV, an empty `id` cell) becomes `line-N` (N = the row's line
number). An optional `expected` field or column is kept, so a labelled file can be scored: a
label, or (for a schema's fields) an object of field: label or field: [labels].

`TicketReader` reads a file as it is iterated and yields its rows in file order, a `TicketRow` or
a `RowError` each: it holds one row (for a CSV, the lines of the record being read), never the
file. `read_tickets` collects the rows into a `TicketFile` for callers that want them all at once.

A malformed or refused row does not stop the file: it becomes a `RowError` naming the file and
line, and the good rows still go through. Every non-blank row ends as exactly one ticket or one
error, so one result row can stand for each input row. A CSV record whose quoting is broken (an
unterminated quote would otherwise swallow every row after it) is reported at the line where it
starts, and reading resumes on the next line. A file with nothing but blank lines has no rows, in
either format. Only a file that cannot be read at all (missing, not UTF-8 for CSV, a CSV header
without a `text` column) raises `TicketFileError`, and it does so when the reader is opened,
before any row.

Results are never written in place: `write_results` writes them all to a temporary file that is
then renamed, and `PartialResults` appends them as they are computed to `<out>.partial`, renamed
to `out` once every row is in, so a stopped run keeps its rows and a later one can continue it.
`check_output` refuses to replace the input or, without `force`, any existing file.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import io
import json
import os
import re
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from ticketq.contract import MAX_TICKET_BYTES, Reason, TicketRejected, UniqueIds, validate_ticket

Format = Literal["auto", "jsonl", "csv"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARTIAL_SUFFIX = ".partial"
_BLOCK = 1 << 20  # bytes read at a time where a file is scanned whole (the format, a CSV's UTF-8 check)


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

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def result_id(self) -> str:
        """The `id` of the failed result row that stands for this input row."""
        return self.id or f"line-{self.line}"

    def as_result(self) -> dict:
        """The failed result row that stands for this input row in the results file."""
        return {"id": self.result_id, "status": "failed", "reason": self.reason, "error": self.message,
                "source": self.source}  # fmt: skip


@dataclass(frozen=True)
class TicketRow:
    """One good row: its ticket (`id`, `text`, and `expected` when the row has one) and its first line."""

    path: str
    line: int
    ticket: dict

    @property
    def source(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def result_id(self) -> str:
        return self.ticket["id"]


Row = TicketRow | RowError


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

    def add(self, row: Row) -> None:
        if isinstance(row, RowError):
            self.errors.append(row)
        else:
            self.tickets.append(row.ticket)
            self.lines[row.result_id] = row.line

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


class _Rows:
    """Turns raw rows into `TicketRow`s with the contract's validator, or `RowError`s (duplicate ids too)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = str(path)
        self.max_bytes = max_bytes
        self._ids = UniqueIds()  # every id of the file: the one thing that grows with it

    def error(self, line: int, message: str, reason: str = Reason.MALFORMED_ROW, ticket_id: str | None = None
              ) -> RowError:  # fmt: skip
        return RowError(self.path, line, message, str(reason), ticket_id)

    def row(self, line: int, fields: dict) -> Row:
        """One row's fields (`id`, `text`, `schema`, `expected`; others are ignored): a ticket or an error."""
        try:
            ticket = validate_ticket(fields, self.max_bytes)
            _check_expected(fields.get("expected"))
            ticket_id = ticket.id or f"line-{line}"
            self._ids.add(ticket_id, f"on line {line}")  # last: a refused row does not claim its id
        except TicketRejected as exc:
            return self.error(line, exc.detail, exc.reason, _readable_id(fields.get("id"), line))
        found = {"id": ticket_id, "text": ticket.text}
        if ticket.schema is not None:
            found["schema"] = ticket.schema
        if fields.get("expected"):
            found["expected"] = fields["expected"]
        return TicketRow(self.path, line, found)


def _check_expected(expected: object) -> None:
    """`expected` (a file's answer for scoring, not part of the ticket), when present: a label, or an
    object of field: label or field: [labels]. Which fields and labels exist is the scorer's to say."""
    if expected is None or isinstance(expected, str):
        return
    if isinstance(expected, dict) and all(
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)) for v in expected.values()
    ):
        return
    raise TicketRejected(Reason.WRONG_TYPE, "'expected' must be a label, or an object of field: label or "
                         f"field: [labels], got {type(expected).__name__} {json.dumps(expected)[:80]}")  # fmt: skip


def _readable_id(raw_id: object, line: int) -> str:
    """The id a refused row is reported under: its own when it has a usable one, else `line-N`."""
    if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) and str(raw_id).strip():
        return str(raw_id)
    return f"line-{line}"


def read_tickets(path: str | Path, fmt: Format = "auto", max_bytes: int = MAX_TICKET_BYTES) -> TicketFile:
    """Read a whole JSONL or CSV ticket file; `fmt="auto"` goes by extension, then by the first byte.

    `max_bytes` is TICKETQ_MAX_TICKET_BYTES: a longer text is a refused row (`oversize`), as the
    worker would refuse it.
    """
    with TicketReader(path, fmt, max_bytes) as reader:
        found = TicketFile(reader.path)
        for row in reader:
            found.add(row)
    return found


class TicketReader:
    """A ticket file read as it is iterated: its rows in file order, a `TicketRow` or a `RowError` each.

    Opening it checks all that can make the whole file unusable (`TicketFileError`), so no row
    comes from a file that is then refused: that it can be read, its format (`fmt="auto"`: by
    extension, then by the first byte), and for a CSV that it is UTF-8 throughout (one pass over
    the file, a block at a time) and that its header names a `text` column. `bytes_read` of
    `size` is how far reading has gone, for a progress bar. A reader is used once, then closed
    (it is a context manager).
    """

    def __init__(self, path: str | Path, fmt: Format = "auto", max_bytes: int = MAX_TICKET_BYTES) -> None:
        if fmt not in ("auto", "jsonl", "csv"):
            raise ValueError(f"unknown ticket file format {fmt!r}; expected 'auto', 'jsonl' or 'csv'")
        self.path = Path(path)
        self._file = _open(self.path)
        self._text: io.TextIOWrapper | None = None  # a CSV's decoded view of `_file`
        try:
            self.size = self._file.seek(0, os.SEEK_END)
            self._file.seek(0)
            self.format = _guess_format(self.path, self._file) if fmt == "auto" else fmt
            builder = _Rows(self.path, max_bytes)
            self._rows = _jsonl_rows(self._file, builder) if self.format == "jsonl" else self._csv_rows(builder)
        except BaseException:
            self.close()
            raise

    @property
    def bytes_read(self) -> int:
        return self._file.tell()

    def __iter__(self) -> Iterator[Row]:
        try:
            yield from self._rows
        except OSError as exc:
            raise TicketFileError(f"{self.path}: cannot read ticket file: {exc.strerror or exc}") from exc

    def close(self) -> None:
        (self._text or self._file).close()

    def __enter__(self) -> TicketReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _csv_rows(self, builder: _Rows) -> Iterator[Row]:
        """Check the CSV (UTF-8, header), then return its data rows as an iterator."""
        _check_utf8(self._file, self.path)
        self._text = io.TextIOWrapper(self._file, encoding="utf-8-sig", newline="")
        # newline="" splits on \n, \r\n and \r only, as the csv module does (not on U+2028).
        records = _csv_records(_Lines(self._text, _look_back(builder.max_bytes)))
        header = _read_header(records, self.path)
        if header is None:
            return iter(())
        fields, header_line = header
        columns = {name.strip().lower(): index for index, name in enumerate(fields)}
        if "text" not in columns:
            raise TicketFileError(
                f"{self.path}:{header_line}: CSV header must name a 'text' column (and optionally 'id'), got {fields}"
            )
        return _csv_data(records, fields, columns, builder)


def _open(path: Path) -> BinaryIO:
    try:
        handle: BinaryIO = path.open("rb")
        if not handle.seekable():  # a pipe: the format and UTF-8 checks read the file twice, so hold it
            with handle:
                handle = io.BytesIO(handle.read())
    except OSError as exc:
        raise TicketFileError(f"{path}: cannot read ticket file: {exc.strerror or exc}") from exc
    return handle


def _guess_format(path: Path, handle: BinaryIO) -> Format:
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".csv":
        return "csv"
    return "jsonl" if _first_content_byte(handle) == b"{" else "csv"


def _first_content_byte(handle: BinaryIO) -> bytes:
    """The first byte that is neither whitespace nor part of a BOM (b"" if none); the file goes back to its start."""
    try:
        while block := handle.read(_BLOCK):
            if content := block.lstrip(b"\xef\xbb\xbf \t\r\n"):
                return content[:1]
        return b""
    finally:
        handle.seek(0)


def _jsonl_rows(handle: BinaryIO, builder: _Rows) -> Iterator[Row]:
    # A binary file's lines end at b"\n" only: str.splitlines() would also split on U+2028 inside a JSON string.
    for number, line in enumerate(handle, start=1):
        raw = line.removesuffix(b"\n")
        raw = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw
        if raw.strip():
            yield _jsonl_row(number, raw, builder)


def _jsonl_row(number: int, raw: bytes, builder: _Rows) -> Row:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return builder.error(number, f"not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r})",
                             Reason.INVALID_UTF8)  # fmt: skip
    except json.JSONDecodeError as exc:
        return builder.error(number, f"invalid JSON: {exc.msg} (column {exc.colno})", Reason.INVALID_JSON)
    if not isinstance(row, dict):
        return builder.error(number, f"expected a JSON object, got {type(row).__name__}", Reason.INVALID_JSON)
    return builder.row(number, row)


def _check_utf8(handle: BinaryIO, path: Path) -> None:
    """A CSV that is not UTF-8 is refused whole, naming the line, before any of its rows is used."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = 0  # newlines before the block being decoded
    try:
        while True:
            block = handle.read(_BLOCK)
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:  # exc.object: the block after a partial character, which has no newline
                line = lines + exc.object[: exc.start].count(b"\n") + 1
                raise TicketFileError(f"{path}:{line}: CSV file is not valid UTF-8") from exc
            if not block:
                return
            lines += block.count(b"\n")
    finally:
        handle.seek(0)


def _csv_data(records: Iterator[tuple[int, list[str] | str]], header: list[str], columns: dict[str, int],
              builder: _Rows) -> Iterator[Row]:  # fmt: skip
    for line, row in records:
        if isinstance(row, str):
            yield builder.error(line, row, Reason.MALFORMED_CSV)
        elif len(row) != len(header):
            message = f"expected {len(header)} fields ({','.join(header)}), got {len(row)}"
            yield builder.error(line, message, Reason.MALFORMED_CSV)
        else:
            # A CSV cell cannot be absent: an empty id cell means "no id" (JSONL leaves the field out).
            fields = {"id": _cell(row, columns, "id") or None, "text": row[columns["text"]],
                      "expected": _cell(row, columns, "expected")}  # fmt: skip
            yield builder.row(line, fields)


def _look_back(max_bytes: int) -> int:
    """Characters of one CSV record kept for reading its lines again (at least 1 Mi).

    Room for the longest ticket text with every character a doubled quote, twice over. The csv
    module already ends one runaway quoted field at its field size limit (128 Ki characters);
    this bounds a record of many quoted fields, each spanning lines.
    """
    return max(1 << 20, 4 * max_bytes)


class _RecordTooLong(Exception):
    """A CSV record ran past the look-back limit (most likely a quote that is never closed)."""


class _Lines:
    """A file's physical lines as an iterator whose position (`pos`) can move back within the current record.

    The lines from the last `mark()` on are kept, so a broken record's lines can be read again as
    rows of their own; a record that runs past `limit` characters raises `_RecordTooLong`, so
    one broken quote cannot make the reader hold the rest of the file.
    """

    def __init__(self, lines: Iterable[str], limit: int) -> None:
        self._source = iter(lines)
        self._kept: deque[str] = deque()  # lines `_first + 1` on
        self._first = 0
        self._chars = 0  # characters in `_kept`
        self.limit = limit
        self.pos = 0  # lines given so far

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        index = self.pos - self._first
        if index == len(self._kept):
            if self._chars > self.limit:
                raise _RecordTooLong
            line = next(self._source)
            self._kept.append(line)
            self._chars += len(line)
        self.pos += 1
        return self._kept[index]

    def mark(self) -> None:
        """A record starts at `pos`: the lines before it are not needed again."""
        for _ in range(self.pos - self._first):
            self._chars -= len(self._kept.popleft())
        self._first = self.pos


def _csv_records(lines: _Lines) -> Iterator[tuple[int, list[str] | str]]:
    """`(start line, fields)` per non-blank record, the header first; `(start line, message)` for a broken one.

    A quoted field may span lines, so one broken quote can swallow the rest of the file. Strict
    mode makes the csv module raise instead (end of data inside quotes, text after a closing
    quote). A broken record, or one spanning lines with the wrong number of fields, is reported at
    its first line and reading resumes on the line after it: each line after it is still a row.
    """
    reader = csv.reader(lines, strict=True)
    width = None  # fields in the header
    while True:
        lines.mark()
        start = lines.pos
        try:
            row: list[str] | str = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            problem = _csv_problem(exc, start + 1, lines.pos)
            row = f"malformed CSV: {problem}; row skipped, reading resumes on the next line"
        except _RecordTooLong:
            row = (f"malformed CSV: a record longer than {lines.limit:,} characters (a quote that is never "
                   "closed?); row skipped, reading resumes on the next line")  # fmt: skip
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


def _read_header(records: Iterator[tuple[int, list[str] | str]], path: Path) -> tuple[list[str], int] | None:
    """The header and its line; None for a file with nothing but blank lines (no rows)."""
    for line, row in records:
        if isinstance(row, str):
            raise TicketFileError(f"{path}:{line}: malformed CSV header: {row}")
        return row, line
    return None


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
        out.write(_result_line(result))
        count += 1
    return count


def _result_line(result: dict) -> str:
    return json.dumps(result, ensure_ascii=False, sort_keys=False) + "\n"


class PartialResults:
    """A results file written as its rows are computed: `<out>.partial`, renamed to `out` once complete.

    `append` writes rows (in input order) straight to the file, with no buffer in between, so
    after Ctrl-C or a crash the file holds every row appended so far; `close` cuts off a row that
    was being written when the run stopped. A partial file left by a stopped run is refused
    unless `force` (start again) or `resume`: then its rows are checked (each names a line of
    `source`, in order), handed to `on_row`, and kept; a last row cut short (the process was
    killed) is dropped; and `remaining` skips the input rows the file already answers.
    """

    def __init__(self, out: str | Path, source: str | Path, *, resume: bool = False, force: bool = False,
                 on_row: Callable[[dict], None] | None = None) -> None:  # fmt: skip
        self.out = Path(out)
        self.path = check_output(self.out.with_name(self.out.name + PARTIAL_SUFFIX), [source], force=True)
        self.source = Path(source)
        self.rows = 0  # whole rows in the file
        self.resumed = resume and self.path.exists()
        self._last: tuple[int, str | None] = (0, None)  # line and id of the last row found on resuming
        if self.path.exists() and not (resume or force):
            raise OutputError(f"{self.path} holds the rows of a run that was stopped; pass --resume to continue "
                              "it, or --force to start again")  # fmt: skip
        self._size = self._check_rows(on_row or (lambda row: None)) if self.resumed else 0  # bytes of whole rows
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (0 if self.resumed else os.O_TRUNC), 0o666)
        os.ftruncate(self._fd, self._size)
        os.lseek(self._fd, self._size, os.SEEK_SET)

    def remaining(self, rows: Iterable[Row]) -> Iterator[Row]:
        """The rows of `rows` (the input, from its start) that the file has no result row for yet.

        The rows it has must be the input's first ones, the last of them with the same id:
        otherwise the input changed since, and `OutputError` comes before any row is given.
        """
        rows = iter(rows)
        last_line, last_id = self._last
        answered, first_new, last = 0, None, None
        for row in rows:
            if row.line > last_line:
                first_new = row
                break
            answered, last = answered + 1, row
        if answered != self.rows or (last is not None and last.result_id != last_id):
            raise OutputError(
                f"{self.path} does not match {self.source}: its {self.rows} rows end at line {last_line} "
                f"(id {last_id!r}), but the input has {answered} rows up to that line; the input changed? "
                "Pass --force without --resume to start again"
            )
        if first_new is not None:
            yield first_new
            yield from rows

    def append(self, rows: Sequence[dict]) -> None:
        """Write `rows`, the results of the input rows after the ones already in the file, in their order."""
        data = memoryview("".join(_result_line(row) for row in rows).encode("utf-8"))
        while data:
            data = data[os.write(self._fd, data) :]
        self._size = os.lseek(self._fd, 0, os.SEEK_CUR)
        self.rows += len(rows)

    def publish(self, overwrite: bool) -> None:
        """Every row is in: the file becomes `out`, atomically; an existing `out` only with `overwrite`.

        On `OutputError` (`out` appeared meanwhile) the partial file stays, whole.
        """
        os.fsync(self._fd)
        self.close()
        _publish(str(self.path), self.out, overwrite)
        with contextlib.suppress(FileNotFoundError):  # a hard link was made: the partial name goes
            os.unlink(self.path)

    def close(self) -> None:
        """Stop without publishing: the file keeps its whole rows (a row being written when it stopped is cut)."""
        if self._fd < 0:
            return
        os.ftruncate(self._fd, self._size)
        os.close(self._fd)
        self._fd = -1

    def _check_rows(self, on_row: Callable[[dict], None]) -> int:
        """Check the rows already in the file and hand each to `on_row`; the bytes they take."""
        size = 0
        with self.path.open("rb") as existing:
            for number, raw in enumerate(existing, start=1):
                if not raw.endswith(b"\n"):
                    break  # the last row, cut short when the process was killed: computed again
                row = self._check_row(number, raw)
                on_row(row)
                size += len(raw)
        return size

    def _check_row(self, number: int, raw: bytes) -> dict:
        try:
            row = json.loads(raw)
            path, _, line = row["source"].rpartition(":")
            line = int(line)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise OutputError(f"{self.path}:{number}: not a result row with a source line; pass --force without "
                              "--resume to start again") from None  # fmt: skip
        if path != str(self.source) and not (os.path.exists(path) and os.path.samefile(path, self.source)):
            raise OutputError(f"{self.path} holds the results of {path}, not of {self.source}")
        if line <= self._last[0]:
            raise OutputError(f"{self.path}:{number}: rows out of input order (line {line} after {self._last[0]})")
        self.rows += 1
        self._last = (line, row.get("id"))
        return row


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
