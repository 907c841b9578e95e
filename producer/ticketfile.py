"""Ticket files in: JSONL or CSV tickets, read as they are iterated.

Input rows are `{"id": ..., "text": ...}` (JSONL, one object a line; `id` optional) or a CSV with a
header naming a `text` column and optionally an `id` column (`producer.csvrows`). Each row is a
ticket under the contract's rule, or an error (`producer.ticketrows`), and an id may appear once
per file.

`TicketReader` reads a file as it is iterated and yields its rows in file order, a `TicketRow` or
a `RowError` each: it holds one row (for a CSV, the lines of the record being read), never the
file. `read_tickets` collects the rows into a `TicketFile` for callers that want them all at once.

A malformed or refused row does not stop the file: it becomes a `RowError` naming the file and
line, and the good rows still go through. Every non-blank row ends as exactly one ticket or one
error, so one result row can stand for each input row (`producer.resultfile` writes them). A
file with nothing but blank lines has no rows, in either format. Only a file that cannot be read
at all (missing, compressed, binary, UTF-16, a JSON array rather than JSONL, not UTF-8 for CSV, a
CSV header without a `text` column) raises `TicketFileError`, in one line that says what to do,
and it does so when the reader is opened, before any row.
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

from producer.csvrows import BLOCK, csv_rows, csv_text
from producer.ticketrows import Row, RowBuilder, RowError, TicketFileError
from ticketq.contract import MAX_TICKET_BYTES, Reason

Format = Literal["auto", "jsonl", "csv"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
SNIFF = 8192  # bytes read to tell text from a binary file: git's rule (a NUL byte in the first 8,000)
# Files that are no ticket text, known by their first bytes: (magic, what it is, how to make text of it).
_NOT_TEXT = (
    (re.compile(rb"\x1f\x8b"), "gzip-compressed", "decompress it first: gunzip -k FILE"),
    (re.compile(rb"BZh[1-9]1AY&SY"), "bzip2-compressed", "decompress it first: bunzip2 -k FILE"),
    (re.compile(rb"\xfd7zXZ\x00"), "xz-compressed", "decompress it first: unxz -k FILE"),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd-compressed", "decompress it first: unzstd FILE"),
    (re.compile(rb"PK\x03\x04"), "zip archive", "extract it first: unzip FILE"),
    (re.compile(rb"\xff\xfe|\xfe\xff"), "UTF-16 text", "convert it first: iconv -f UTF-16 -t UTF-8 FILE > FILE.utf8"),
)  # fmt: skip


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
    `size` is how far reading has gone; `line_count()` is a progress bar's total. A reader is used once, then closed
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
            check_text(self.path, self._file)
            self.format = _guess_format(self.path, self._file) if fmt == "auto" else fmt
            if self.format == "jsonl" and _json_array(self.path, self._file):
                raise TicketFileError(f"{self.path}: a JSON array; ticket files are JSONL, one object a line: "
                                      f"convert it with  jq -c '.[]' {self.path} > tickets.jsonl")  # fmt: skip
            builder = RowBuilder(self.path, max_bytes)
            if self.format == "jsonl":
                self._rows = _jsonl_rows(self._file, builder)
            else:
                self._text = csv_text(self._file, self.path)
                self._rows = csv_rows(self._text, self.path, builder)
        except BaseException:
            self.close()
            raise

    @property
    def bytes_read(self) -> int:
        return self._file.tell()

    def line_count(self) -> int:
        """Lines in the file (the last one counts without its newline), for a progress bar's total.

        One pass a block at a time; reading goes on where it was (the rows read through the same
        file object, which holds no position of its own beyond it).
        """
        where = self._file.tell()
        try:
            self._file.seek(0)
            lines, last = 0, b"\n"
            while block := self._file.read(BLOCK):
                lines, last = lines + block.count(b"\n"), block[-1:]
            return lines + (last != b"\n")
        finally:
            self._file.seek(where)

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


def _open(path: Path) -> BinaryIO:
    try:
        handle: BinaryIO = path.open("rb")
        if not handle.seekable():  # a pipe: the format and UTF-8 checks read the file twice, so hold it
            with handle:
                handle = io.BytesIO(handle.read())
    except OSError as exc:
        raise TicketFileError(f"{path}: cannot read ticket file: {exc.strerror or exc}") from exc
    return handle


def check_text(path: Path, handle: BinaryIO) -> None:
    """Refuse, in one line naming the fix, a file that is no text: compressed, UTF-16, or binary.

    Its rows would otherwise each fail (thousands of `invalid_utf8` lines) or, read as a CSV, be
    called "not valid UTF-8". Binary is git's rule: a NUL byte in the first SNIFF bytes. The file
    goes back to its start.
    """
    try:
        head = handle.read(SNIFF)
    finally:
        handle.seek(0)
    for magic, what, fix in _NOT_TEXT:
        if magic.match(head):
            raise TicketFileError(f"{path}: a {what} file; ticket files are JSONL or CSV text in UTF-8; "
                                  f"{fix.replace('FILE', str(path))}")  # fmt: skip
    if (nul := head.find(b"\x00")) >= 0:
        raise TicketFileError(f"{path}: not a text file (a NUL byte at byte {nul}); ticket files are JSONL or "
                              "CSV text in UTF-8")  # fmt: skip


def _guess_format(path: Path, handle: BinaryIO) -> Format:
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".csv":
        return "csv"
    return "jsonl" if _first_content_byte(handle) == b"{" else "csv"


def _json_array(path: Path, handle: BinaryIO) -> bool:
    """A JSON array where JSONL is expected: a `.json` file that starts with `[`, or one whose first
    line opens an array it does not close (pretty-printed, it would fail row by row). A `.jsonl`
    line that is a whole array stays one failed row. The file goes back to its start."""
    if _first_content_byte(handle) != b"[":
        return False
    if path.suffix.lower() == ".json":
        return True
    try:
        first = next(line for line in handle if line.strip())
        json.loads(first)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        return True
    finally:
        handle.seek(0)
    return False


def _first_content_byte(handle: BinaryIO) -> bytes:
    """The first byte that is neither whitespace nor part of a BOM (b"" if none); the file goes back to its start."""
    try:
        while block := handle.read(BLOCK):
            if content := block.lstrip(b"\xef\xbb\xbf \t\r\n"):
                return content[:1]
        return b""
    finally:
        handle.seek(0)


def _jsonl_rows(handle: BinaryIO, builder: RowBuilder) -> Iterator[Row]:
    # A binary file's lines end at b"\n" only: str.splitlines() would also split on U+2028 inside a JSON string.
    for number, line in enumerate(handle, start=1):
        raw = line.removesuffix(b"\n")
        raw = raw.removeprefix(b"\xef\xbb\xbf") if number == 1 else raw
        if raw.strip():
            yield _jsonl_row(number, raw, builder)


def _jsonl_row(number: int, raw: bytes, builder: RowBuilder) -> Row:
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


