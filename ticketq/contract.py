"""The ticket contract: what a ticket is, the one rule that accepts or refuses it, why one is
refused, and the per-ticket result shapes that come back.

Every path that takes tickets in applies `validate_ticket`: the Python API (`producer.api`),
ticket files (`producer.ticketrows`, so also `ticketq classify`) and the worker (each ticket of a
message). The rule, in full:

- `id`: optional (absent or null: the receiver names the ticket). Otherwise a string or an
  integer (not a bool); an integer becomes its decimal string (`7` and `"7"` are the same id). Not
  empty or whitespace only; at most `MAX_ID_CHARS` characters, none of them `/` or a control
  character (`invalid_id`): an id is a path segment (GET /v1/tickets/{id}) and a Redis key part.
- `text`: a string, valid UTF-8 (no lone surrogates), not empty or whitespace only, at most
  `max_bytes` bytes of UTF-8 (TICKETQ_MAX_TICKET_BYTES, default `MAX_TICKET_BYTES`). Longer text
  is refused (`oversize`), never cut by bytes. Within the limit the model reads at most
  TICKETQ_MAX_TICKET_TOKENS tokens of it and flags the result `truncated`.
- `schema`: optional, the name of the schema (the fields to answer, `ticketq.schema`) the
  worker classifies the ticket with; absent or null: the worker's first. A name the worker does
  not serve is answered `unknown_schema`, naming the ones it does.
- duplicate ids: refused within one input the sender holds whole (a file, one `submit_many` call)
  with `UniqueIds`; nobody can check across calls.

On the wire: task `names.TASK_CLASSIFY`, JSON, `args=[ticket]` (its result is one per-ticket
dict) or `args=[[ticket, ...]]` (a packed message: its result is a list of them), a ticket being
`{"id"?, "text", "submitted_at"?: unix seconds, "schema"?: name}`. A failed single-ticket message ends in Celery
state FAILURE with `TicketRejected("<reason>: <detail>")`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from enum import Enum
from typing import Literal, NamedTuple, TypedDict

from ticketq.errors import TicketqError

MAX_TICKET_BYTES = 65536  # default of TICKETQ_MAX_TICKET_BYTES
MAX_ID_CHARS = 256  # the longest ticket id (the gateway keeps `ID_TENANT_ROOM` of it for `tenant:`)
ID_TENANT_ROOM = 65  # a tenant name (at most 64) and ':' (gateway.intake.Intake.wire_id)
BAD_ID_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f/]")  # '/' and the C0/C1 control characters
SCHEMA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # how a schema is named (files, tickets, results)


class Reason(str, Enum):
    """Why a ticket or message got no label. The values are what results, dead letters and the
    `ticketq_dead_letters` metric store; `str()` gives the value."""

    # the ticket breaks the contract (validate_ticket, UniqueIds)
    BAD_PAYLOAD = "bad_payload"  # not a JSON object, or a message without exactly one argument
    MISSING_FIELD = "missing_field"  # no 'text'
    WRONG_TYPE = "wrong_type"  # 'text' not a string, 'id' not a string or integer
    EMPTY_ID = "empty_id"  # 'id' given but empty or whitespace only
    INVALID_ID = "invalid_id"  # 'id' longer than MAX_ID_CHARS, or with '/' or a control character
    INVALID_UTF8 = "invalid_utf8"  # text with lone surrogates, or a file line that is not UTF-8
    OVERSIZE = "oversize"  # text above TICKETQ_MAX_TICKET_BYTES
    EMPTY_TEXT = "empty_text"  # text empty or whitespace only
    DUPLICATE_ID = "duplicate_id"  # an id seen before in the same file or submit_many call
    # the worker could not finish it
    ENGINE_ERROR = "engine_error"  # the model failed on it alone, after retries
    WORKER_ERROR = "worker_error"  # an unexpected error in the worker around the model
    TOO_MANY_DELIVERIES = "too_many_deliveries"  # redelivered past TICKETQ_MAX_RETRIES: it may crash workers
    EXPIRED = "expired"  # its Celery `expires` deadline passed before its batch started
    DUPLICATE_TASK_ID = "duplicate_task_id"  # its message reused the task id of another, answered message
    UNKNOWN_SCHEMA = "unknown_schema"  # it named a schema the worker does not serve (TICKETQ_SCHEMAS)
    # a message Celery or the transport refused before it became a ticket (raw bytes dead-lettered)
    DECODE_ERROR = "decode_error"
    UNKNOWN_MESSAGE = "unknown_message"
    UNKNOWN_TASK = "unknown_task"
    INVALID_TASK = "invalid_task"
    UNREADABLE_MESSAGE = "unreadable_message"
    # a ticket file's row (producer.ticketrows) or a ticket the producer sent
    MALFORMED_ROW = "malformed_row"
    INVALID_JSON = "invalid_json"
    MALFORMED_CSV = "malformed_csv"
    NO_RESULT = "no_result"  # sent, but no result came back for it

    def __str__(self) -> str:
        return self.value


# What a worker can dead-letter a ticket or message for (each gets a ticketq_dead_letters series).
DEAD_LETTER_REASONS: tuple[Reason, ...] = (
    Reason.BAD_PAYLOAD, Reason.MISSING_FIELD, Reason.WRONG_TYPE, Reason.EMPTY_ID, Reason.INVALID_ID,
    Reason.INVALID_UTF8, Reason.OVERSIZE, Reason.EMPTY_TEXT, Reason.ENGINE_ERROR, Reason.TOO_MANY_DELIVERIES,
    Reason.WORKER_ERROR,
    Reason.DUPLICATE_TASK_ID, Reason.UNKNOWN_SCHEMA, Reason.DECODE_ERROR, Reason.UNKNOWN_MESSAGE,
    Reason.UNKNOWN_TASK, Reason.INVALID_TASK,
    Reason.UNREADABLE_MESSAGE,
)  # fmt: skip


class TicketRejected(TicketqError, ValueError):
    """A ticket or message that cannot be classified; `reason` is a `Reason` value (a plain str).

    `str()` is `"<reason>: <detail>"`, which is all Celery stores of an exception: a client
    rebuilds it as `TicketRejected("<reason>: <detail>")`, so one argument is split back.
    """

    def __init__(self, reason: Reason | str, detail: str | None = None) -> None:
        reason = str(reason)
        if detail is None:  # rebuilt by a Celery client from the stored message "reason: detail"
            reason, _, detail = reason.partition(": ")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __repr__(self) -> str:
        return f"TicketRejected({self.reason!r}, {self.detail!r})"


class Ticket(NamedTuple):
    """A ticket that passed `validate_ticket`. `id` is "" when none was given.

    A named tuple, not a frozen dataclass: built once per ticket on every path, and a frozen
    dataclass takes twice as long to build (a fifth of the whole rule)."""

    id: str
    text: str
    submitted_at: float | None
    schema: str | None = None  # the schema (set of fields) to answer, by name; None: the worker's default


def validate_ticket(raw: object, max_bytes: int = MAX_TICKET_BYTES, max_id_chars: int = MAX_ID_CHARS) -> Ticket:
    """The one ticket rule (module docstring) for one payload; raises `TicketRejected` with the reason.
    `max_id_chars`: a caller that adds a prefix to the id (the gateway's `tenant:`) leaves room for it."""
    # `type(raw) is dict` first: tickets are dicts, and the ABC check alone cost a tenth of this rule
    if type(raw) is not dict and not isinstance(raw, Mapping):
        raise TicketRejected(Reason.BAD_PAYLOAD, _not_an_object(raw))
    if "text" not in raw:
        raise TicketRejected(Reason.MISSING_FIELD, "ticket has no 'text' field")
    text = _text_of_type(raw["text"])
    ticket_id = _valid_id(raw.get("id"), max_id_chars)
    size = _utf8_size(text)
    if size > max_bytes:
        raise TicketRejected(Reason.OVERSIZE, f"text is {size} bytes, above TICKETQ_MAX_TICKET_BYTES={max_bytes}")
    _not_blank(text)
    submitted = raw.get("submitted_at")
    # optional and only informative (queue_wait_s): anything but a finite number is dropped, not refused
    finite = isinstance(submitted, (int, float)) and math.isfinite(submitted)
    schema = raw.get("schema")
    if schema is not None and not (isinstance(schema, str) and SCHEMA_NAME.fullmatch(schema)):
        raise TicketRejected(Reason.WRONG_TYPE, f"'schema' must be a schema's name (letters, digits, '_', '-', '.'), "
                                                f"got {str(schema)[:80]!r}")  # fmt: skip
    return Ticket(ticket_id, text, float(submitted) if finite else None, schema)


def _not_an_object(raw: object) -> str:
    """Why `raw` is no ticket. None is also what a worker finds in an empty pack (a message whose
    argument is `[]`), which holds no ticket at all."""
    if raw is None:
        return "a ticket must be a JSON object, got null (or an empty pack `[]`: a packed message needs a ticket)"
    return f"a ticket must be a JSON object, got {type(raw).__name__}"


def result_id(given: object, task_id: str, slot: int, packed: bool) -> str:
    """The `id` a ticket's result carries: the ticket's own id (a string or an integer), else the
    task id of its message, with `:<slot>` for a ticket of a packed message."""
    if (isinstance(given, str) and given) or (isinstance(given, int) and not isinstance(given, bool)):
        return str(given)
    return f"{task_id}:{slot}" if packed else task_id


def check_text(text: object) -> str:
    """The text part of the rule without the byte limit, for the engine, which truncates by tokens."""
    text = _text_of_type(text)
    _utf8_size(text)
    _not_blank(text)
    return text


def canonical_text(text: object) -> str:
    """The text a ticket is classified (and its answer cached) by: the text rule (`check_text`),
    surrounding whitespace removed (it only moves token boundaries). `TicketRejected` if invalid."""
    return check_text(text).strip()


def _text_of_type(text: object) -> str:
    if not isinstance(text, str):
        raise TicketRejected(Reason.WRONG_TYPE, f"'text' must be a string, got {type(text).__name__}")
    return text


def _valid_id(ticket_id: object, max_chars: int = MAX_ID_CHARS) -> str:
    """The id as a string ("" when none was given)."""
    if ticket_id is None:
        return ""
    if type(ticket_id) is str and ticket_id and not ticket_id.isspace():  # the usual case, checked once
        return check_id_chars(ticket_id, max_chars)
    if isinstance(ticket_id, bool) or not isinstance(ticket_id, str | int):
        raise TicketRejected(Reason.WRONG_TYPE, f"'id' must be a string or integer, got {type(ticket_id).__name__}")
    if isinstance(ticket_id, str) and not ticket_id.strip():
        shown = f"'id' must be a non-empty string or an integer, got {ticket_id!r}"
        raise TicketRejected(Reason.EMPTY_ID, f"{shown}; leave it out (or null) to have one assigned")
    return check_id_chars(str(ticket_id), max_chars)


def check_id_chars(ticket_id: str, max_chars: int = MAX_ID_CHARS) -> str:
    """`ticket_id` unchanged, or `TicketRejected` (`invalid_id`) when too long or holding '/' or a control character."""
    if len(ticket_id) > max_chars:
        raise TicketRejected(Reason.INVALID_ID, f"'id' is {len(ticket_id)} characters, above {max_chars}")
    bad = BAD_ID_CHARS.search(ticket_id)
    if bad is not None:
        raise TicketRejected(Reason.INVALID_ID, f"'id' {ticket_id[:80]!r} holds {bad.group()!r}: an id has no '/' "
                                                "and no control characters")  # fmt: skip
    return ticket_id


def _utf8_size(text: str) -> int:
    if text.isascii():  # O(1) in CPython, and ASCII is one byte per character with no surrogates
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # lone surrogates decoded from a JSON \udcxx escape
        raise TicketRejected(Reason.INVALID_UTF8, f"text is not valid UTF-8 ({exc.reason})") from None


def _not_blank(text: str) -> None:
    if not text or text.isspace():  # = `not text.strip()` (the same whitespace), without a copy
        raise TicketRejected(Reason.EMPTY_TEXT, "ticket text is empty or whitespace only")


class UniqueIds:
    """The duplicate-id rule over one input held whole (a file, one `submit_many` call)."""

    def __init__(self) -> None:
        self._first: dict[str, str] = {}

    def add(self, ticket_id: str, where: str) -> None:
        """Record `ticket_id` as seen `where` ("on line 3"); `TicketRejected` if it was seen before."""
        if ticket_id in self._first:
            raise TicketRejected(
                Reason.DUPLICATE_ID, f"duplicate id {ticket_id!r} (first seen {self._first[ticket_id]})"
            )
        self._first[ticket_id] = where


# --- what comes back for each ticket ---

Status = Literal["ok", "failed", "timeout"]


class Classified(TypedDict):
    """A labelled ticket, as the worker publishes it (results stream, Celery backend)."""

    id: str
    task_id: str
    status: Literal["ok"]
    label: str
    probs: dict[str, float]  # every label's constrained-decoding probability
    margin: float  # probability of the best label minus the runner-up's
    truncated: bool  # longer than TICKETQ_MAX_TICKET_TOKENS tokens: the model read part of it
    truncation: str | None  # the part it read (TICKETQ_TRUNCATION: head, tail, head+tail); None when whole
    model: str
    standin: bool  # a stand-in model: the label means nothing
    precision: str  # the arithmetic that answered: float32, bfloat16, float16 or int8
    rechecked: bool  # answered in float32 because the fast precision's answer was within its error bound
    worker: str  # host:pid
    queue_wait_s: float | None  # submitted_at to batch start; None without submitted_at
    processing_s: float  # batch start to this result


class FieldAnswer(TypedDict, total=False):
    """One field of a `Triaged` result: `label` (single-label) or `labels` (multi-label)."""

    label: str
    labels: list[str]
    probs: dict[str, float]  # single-label: over the labels, summing to 1; multi-label: each label's p(yes)
    confidence: float  # single-label: margin over the runner-up; multi-label: the weakest yes/no decision
    review: bool  # confidence below the field's threshold


class Triaged(TypedDict):
    """A ticket answered with a schema (several fields), as the worker publishes it. Results with
    `review` true are copied to `names.REVIEW_STREAM` too."""

    id: str
    task_id: str
    status: Literal["ok"]
    schema: str
    fields: dict[str, FieldAnswer]
    review: bool  # any field's confidence is below its threshold
    truncated: bool
    truncation: str | None  # how a ticket over TICKETQ_MAX_TICKET_TOKENS was cut: head, tail, head+tail
    tokens: int  # ticket tokens the model read
    ticket_tokens: int  # ticket tokens before truncation
    model: str
    standin: bool
    precision: str  # as in `Classified`
    rechecked: bool
    worker: str
    queue_wait_s: float | None
    processing_s: float


class Failed(TypedDict, total=False):
    """A ticket without a label. Always `id`, `status` and `error`; `reason` (a `Reason`) where
    the cause is known, `task_id` once sent, `worker` from a worker, `source` (`file:line`) in a
    results file. `status` is "timeout" when no result came within the caller's deadline."""

    id: str | None
    task_id: str
    status: Literal["failed", "timeout"]
    reason: str
    error: str
    worker: str
    source: str
