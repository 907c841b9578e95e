"""What a message carries and what comes back for it: the task id of an idempotent send, the
`AsyncResult` that remembers its tickets, and the per-ticket rows `Producer.wait` returns.

A finished message becomes one row per ticket: the worker's `Classified` or `Failed` result; a
failed task becomes `{"id", "task_id", "status": "failed", "error"}` for each of its tickets,
and a task with no result by the deadline `status: "timeout"`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping, Sequence

from celery import states
from celery.result import AsyncResult

from ticketq.contract import Failed, Reason, Status

Ticket = str | Mapping[str, object]
Checked = tuple[str, str, "str | None"]  # a validated ticket: (id, text, schema)

# uuid5 namespace of idempotent task ids: the same (queue, tickets of the message) always names the same task
TASK_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://ticketq/task-id")


class TicketResult(AsyncResult):
    """The `AsyncResult` of one message, remembering which tickets it carried."""

    ticket_ids: tuple[str, ...] = ()
    packed: bool = False
    message_args: tuple = ()  # what was sent, so `wait(resend_after=...)` can send it again
    sent_seq: int | None = None  # `producer.resends.next_send()` of its latest send; None: sent by an earlier run
    sent_before: bool = False  # an idempotent send found it sent (or answered) already, and did not send it


def idempotent_task_id(queue: str, ticket_ids: Sequence[str], packed: bool) -> str:
    """The task id of a message that carries `ticket_ids` to `queue`, the same on every run.

    A message sent again under it is a re-execution of the same task, which the worker publishes
    once per (task id, slot): so the same ticket, alone or in the same pack, is answered once.
    """
    return str(uuid.uuid5(TASK_ID_NAMESPACE, json.dumps([queue, packed, list(ticket_ids)])))


def ticket_results(result: AsyncResult, state: str, value: object) -> list[dict]:
    """Expand one finished message into per-ticket dicts (see the module docstring).

    `value` is the task's return value, or its exception when `state` is not SUCCESS.
    """
    ids = ticket_ids(result)
    if state != states.SUCCESS:
        # A message this producer did not send has no known ticket ids: report it once.
        rows = failed(result.id, ids or [None], str(value) or state)
        reason = getattr(value, "reason", None)  # a worker's TicketRejected, rebuilt by Celery
        if isinstance(reason, str) and reason in Reason._value2member_map_:
            for row in rows:
                row["reason"] = reason
        return rows
    packed = getattr(result, "packed", isinstance(value, list))
    rows = value if packed else [value]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        return failed(result.id, ids or [None], f"worker returned an unexpected result: {value!r:.200}")
    rows = [{**row, "task_id": row.get("task_id") or result.id} for row in rows]
    returned = {row.get("id") for row in rows}
    missing = [ticket_id for ticket_id in ids if ticket_id not in returned]
    return rows + failed(result.id, missing, "worker returned no result for this ticket")


def in_order(results: Sequence[AsyncResult], by_task: Mapping[str, list[dict]], timeout: float | None) -> list[dict]:
    """Every ticket's row in submission order; `status: "timeout"` for a task without a result."""
    collected = []
    for result in results:
        if result.id in by_task:
            collected.extend(by_task[result.id])
        else:
            error = f"no result within {timeout:g} s" if timeout is not None else "no result"
            collected.extend(failed(result.id, ticket_ids(result) or [None], error, status="timeout"))
    return collected


def failed(task_id: str, ids: Iterable[str | None], error: str, status: Status = "failed") -> list[Failed]:
    return [{"id": ticket_id, "task_id": task_id, "status": status, "error": error} for ticket_id in ids]


def ticket_ids(result: AsyncResult) -> tuple[str, ...]:
    return getattr(result, "ticket_ids", ())


def payload(ticket: Checked) -> dict[str, object]:
    """A checked (id, text, schema) as the ticket a message carries (no `schema` key when it names none)."""
    ticket_id, text, schema = ticket
    return {"id": ticket_id, "text": text} if schema is None else {"id": ticket_id, "text": text, "schema": schema}


def argsrepr(ids: list[str], packed: bool, shown: int = 5) -> str:
    """What the message headers show of its arguments: the ticket ids, never the customer's text."""
    if not packed:
        return f"[<ticket {ids[0]}>]"
    more = ", ..." if len(ids) > shown else ""
    return f"[<{len(ids)} tickets: {', '.join(ids[:shown])}{more}>]"


def as_mapping(ticket: Ticket) -> Mapping[str, object]:
    if isinstance(ticket, str):
        return {"text": ticket}
    if not isinstance(ticket, Mapping):
        raise TypeError(f"a ticket must be a str or a mapping with 'text', got {type(ticket).__name__}")
    return ticket
