"""CSV ticket files: a header naming a `text` column (and optionally `id`, `expected`), then one
ticket a record.

A CSV that is not UTF-8 is refused whole (`TicketFileError`), naming the line, before any row.
A record whose quoting is broken (an unterminated quote would otherwise swallow every row after
it) is reported at the line where it starts, and reading resumes on the next line. Cost: one
pass over the file for the UTF-8 check, a block at a time, then one pass reading it; one record
is held at a time (at most `look_back` characters of it).
"""

from __future__ import annotations

import codecs
import csv
import io
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from producer.ticketrows import Row, RowBuilder, TicketFileError
from ticketq.contract import Reason
from ticketq.errors import TicketqError

BLOCK = 1 << 20  # bytes read at a time where a file is scanned whole (the format, a CSV's UTF-8 check)


def csv_text(handle: BinaryIO, path: Path) -> io.TextIOWrapper:
    """The decoded view of a CSV file, once it is checked to be UTF-8 throughout."""
    check_utf8(handle, path)
    # newline="" splits on \n, \r\n and \r only, as the csv module does (not on U+2028).
    return io.TextIOWrapper(handle, encoding="utf-8-sig", newline="")


def csv_rows(text: io.TextIOWrapper, path: Path, builder: RowBuilder) -> Iterator[Row]:
    """Check the header, then the data rows as an iterator."""
    records = _csv_records(_Lines(text, look_back(builder.max_bytes)))
    header = _read_header(records, path)
    if header is None:
        return iter(())
    fields, header_line = header
    columns = {name.strip().lower(): index for index, name in enumerate(fields)}
    if "text" not in columns:
        raise TicketFileError(
            f"{path}:{header_line}: CSV header must name a 'text' column (and optionally 'id'), got {fields}"
        )
    return _csv_data(records, fields, columns, builder)


def check_utf8(handle: BinaryIO, path: Path) -> None:
    """A CSV that is not UTF-8 is refused whole, naming the line, before any of its rows is used."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    lines = 0  # newlines before the block being decoded
    try:
        while True:
            block = handle.read(BLOCK)
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
              builder: RowBuilder) -> Iterator[Row]:  # fmt: skip
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


def look_back(max_bytes: int) -> int:
    """Characters of one CSV record kept for reading its lines again (at least 1 Mi).

    Room for the longest ticket text with every character a doubled quote, twice over. The csv
    module already ends one runaway quoted field at its field size limit (128 Ki characters);
    this bounds a record of many quoted fields, each spanning lines.
    """
    return max(1 << 20, 4 * max_bytes)


class _RecordTooLong(TicketqError):
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

