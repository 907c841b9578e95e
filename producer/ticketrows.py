"""One row of a ticket file: a `TicketRow` (a ticket under the contract's rule) or a `RowError`.

`RowBuilder` turns a row's fields into one or the other with the contract's validator
(`ticketq.contract.validate_ticket`: the worker's), and refuses an id already seen in the file.
A row without an id becomes `line-N` (N = the row's line number). An optional `expected` field is
kept, so a labelled file can be scored: a label, or (for a schema's fields) an object of field:
label or field: [labels].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ticketq.contract import Reason, TicketRejected, UniqueIds, validate_ticket
from ticketq.errors import TicketqError


class TicketFileError(TicketqError):
    """The whole file cannot be used (unreadable, wrong encoding, no `text` column)."""


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


class RowBuilder:
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
            check_expected(fields.get("expected"))
            ticket_id = ticket.id or f"line-{line}"
            self._ids.add(ticket_id, f"on line {line}")  # last: a refused row does not claim its id
        except TicketRejected as exc:
            return self.error(line, exc.detail, exc.reason, readable_id(fields.get("id"), line))
        found = {"id": ticket_id, "text": ticket.text}
        if ticket.schema is not None:
            found["schema"] = ticket.schema
        if fields.get("expected"):
            found["expected"] = fields["expected"]
        return TicketRow(self.path, line, found)


def check_expected(expected: object) -> None:
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


def readable_id(raw_id: object, line: int) -> str:
    """The id a refused row is reported under: its own when it has a usable one, else `line-N`."""
    if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) and str(raw_id).strip():
        return str(raw_id)
    return f"line-{line}"

