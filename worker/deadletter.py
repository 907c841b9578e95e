"""The dead-letter entry for a message refused before it became a ticket, raw bytes kept.

Written to the `ticketq:dead` stream (worker.constants.DEAD_LETTER_STREAM) by the transport (an
unreadable queue item) and by the Celery consumer (pickle/YAML content, unknown or invalid task).
`payload_b64` holds the message exactly as it came, so nothing is lost and `requeue` can resend it.
"""

from __future__ import annotations

import base64
import time
from typing import Any

MAX_PAYLOAD_BYTES = 65536


def raw_entry(reason: str, exc: BaseException | None, headers: Any, content_type: Any, body: Any) -> dict[str, str]:
    """Stream fields for one refused message (`headers` may be anything a sender put there)."""
    headers = headers if isinstance(headers, dict) else {}
    raw = body if isinstance(body, bytes) else str(body).encode("utf-8", "backslashreplace")
    return {
        "task_id": str(headers.get("id", "") or ""),
        "task": str(headers.get("task", "") or ""),
        "reason": reason,
        "error": f"{type(exc).__name__}: {exc}"[:2000] if exc else reason,
        "content_type": str(content_type or ""),
        "payload_b64": base64.b64encode(raw[:MAX_PAYLOAD_BYTES]).decode(),
        "truncated": str(len(raw) > MAX_PAYLOAD_BYTES).lower(),
        "at": f"{time.time():.3f}",
    }
