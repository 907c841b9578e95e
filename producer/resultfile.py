"""Result files: JSONL, one row per input row, never written in place.

`write_results` writes them all to a temporary file that is then renamed, and `PartialResults`
appends them as they are computed to `<out>.partial`, renamed to `out` once every row is in, so
a stopped run keeps its rows and a later one can continue it. `check_output` refuses to replace
the input or, without `force`, any existing file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from producer.ticketrows import Row
from ticketq.errors import TicketqError

PARTIAL_SUFFIX = ".partial"


class OutputError(TicketqError):
    """The results file may not be written there (exists, is the input, no such directory)."""


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
