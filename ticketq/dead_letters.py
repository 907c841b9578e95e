"""What a dead letter holds: the fields of one entry of the dead-letter stream
(`names.DEAD_LETTER_STREAM`), written by the worker (the service, the Celery consumer, the
transport for an unreadable queue item) and read by the operator's `ticketq dead` commands.

A ticket refused by the service is kept as ASCII JSON (`ticket_entry`); a message refused before
it became a ticket keeps its raw bytes (`raw_entry`). Each keeps its payload whole up to
`dead_letter_bound` bytes and says `truncated` when cut, which a requeue refuses to re-send.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

# A dead letter keeps a refused payload whole up to this many bytes (at least; see `dead_letter_bound`).
DEAD_LETTER_MIN_BYTES = 4 * 1024 * 1024


def dead_letter_bound(max_ticket_bytes: int) -> int:
    """How much of a refused payload a dead letter keeps whole: 8x TICKETQ_MAX_TICKET_BYTES (a ticket
    at the limit is at most 6x that as ASCII JSON, every byte a \\u00XX escape, plus its other
    fields), and never under DEAD_LETTER_MIN_BYTES, so an oversize ticket survives to be re-sent once
    the limit is raised."""
    return max(DEAD_LETTER_MIN_BYTES, 8 * max_ticket_bytes)


def ticket_entry(
    task_id: str, slot: int | None, reason: str, error: str, payload: Any, worker: str,
    limit: int = DEAD_LETTER_MIN_BYTES,
) -> dict[str, str]:  # fmt: skip
    """Dead-letter fields for a ticket (one slot) or a whole message (slot None) refused by the service.

    `payload` is the ticket (or the message's arguments) as decoded, written as ASCII JSON, which
    gives back exactly that value (lone surrogates included); cut at `limit` bytes only, and then
    flagged `truncated`, which `ticketq dead requeue` refuses to re-send.
    """
    dumped = payload_json(payload)
    return {
        "task_id": task_id,
        "slot": "" if slot is None else str(slot),
        "reason": str(reason),
        "error": error,
        "payload": dumped[:limit],
        "truncated": str(len(dumped) > limit).lower(),
        "worker": worker,
        "at": f"{time.time():.3f}",
    }


def raw_entry(
    reason: str, exc: BaseException | None, headers: Any, content_type: Any, body: Any,
    limit: int = DEAD_LETTER_MIN_BYTES,
) -> dict[str, str]:  # fmt: skip
    """Dead-letter fields for a message refused before it became a ticket, raw bytes kept.

    Written by the transport (an unreadable queue item) and by the Celery consumer (pickle/YAML
    content, unknown or invalid task). `payload_b64` holds the message exactly as it came (up to
    `limit` bytes, else `truncated`), so nothing is lost and `ticketq dead requeue` can resend it.
    `headers` may be anything a sender put there.
    """
    headers = headers if isinstance(headers, dict) else {}
    raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "backslashreplace")
    return {
        "task_id": str(headers.get("id", "") or ""),
        "task": str(headers.get("task", "") or ""),
        "reason": str(reason),
        "error": f"{type(exc).__name__}: {exc}"[:2000] if exc else str(reason),
        "content_type": str(content_type or ""),
        "payload_b64": base64.b64encode(raw[:limit]).decode(),
        "truncated": str(len(raw) > limit).lower(),
        "at": f"{time.time():.3f}",
    }


def payload_json(raw: Any) -> str:
    """A payload as a dead letter keeps it: ASCII JSON, or its repr when it is not JSON-shaped."""
    try:
        return json.dumps(raw, ensure_ascii=True)
    except (TypeError, ValueError):
        return repr(raw)
