"""Tickets checked at the edge, before anything is sent: the contract's rule on each
(`ticketq.contract.validate_ticket`), ids unique in a batch, a missing id assigned."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from producer.messages import Checked, Ticket, as_mapping
from ticketq.contract import Reason, TicketRejected, UniqueIds, validate_ticket


def check_ticket(raw: Mapping[str, object], max_ticket_bytes: int, schema: str | None = None) -> Checked:
    """(id, text, schema) of one ticket: its own `schema`, else `schema`; a missing id assigned.
    `TicketRejected` (a `ValueError`) says why not, `TypeError` for a text or id of the wrong type."""
    if schema is not None and raw.get("schema") is None:
        raw = {**raw, "schema": schema}
    try:
        ticket = validate_ticket(raw, max_ticket_bytes)
    except TicketRejected as exc:
        if exc.reason == Reason.WRONG_TYPE:
            raise TypeError(str(exc)) from None  # what Python callers expect for a wrong type
        raise
    return ticket.id or uuid.uuid4().hex, ticket.text, ticket.schema


def check_all(tickets: Iterable[Ticket], max_ticket_bytes: int, schema: str | None) -> list[Checked]:
    """Every ticket checked, ids unique; one `ValueError` naming the first bad ones, else all of them."""
    checked, problems, ids = [], [], UniqueIds()
    for index, ticket in enumerate(tickets):
        try:
            valid = check_ticket(as_mapping(ticket), max_ticket_bytes, schema)
            ids.add(valid[0], f"at #{index}")
            checked.append(valid)
        except (ValueError, TypeError) as exc:
            problems.append(f"#{index}: {exc}")
    if problems:
        shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
        raise ValueError(f"{len(problems)} of {len(checked) + len(problems)} tickets are invalid, none sent: "
                         f"{shown}")  # fmt: skip
    return checked
