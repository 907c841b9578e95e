"""A reviewer's decision on one review item, as the labelled stream (`names.LABELLED_STREAM`) holds it,
and the labelled-file row `ticketq eval` and `ticketq fit` read from it.

A record (JSON, the entry's `data`):

    {"review_id": "1733460000000-0",       # the item's entry id in names.REVIEW_STREAM
     "id": "T-1", "tenant": "acme",        # the ticket id as its tenant sent it
     "schema": "support", "text": "...",
     "expected": {"category": "billing", "topics": ["refund"]},   # what the reviewer decided
     "model": {"category": "technical", "topics": ["refund"]},    # what the model answered
     "corrected": ["category"],            # the fields where the two differ
     "reviewer": "alice@acme", "decided_at": "2026-12-06T04:30:00.123Z"}

`eval_row` turns it into a row of a labelled file: `{"id", "text", "schema", "expected"}`, where
`expected` is the object {field: label} (or {field: [labels]}) that `ticketq eval --schema`
scores (`ticketq_cli.evaluate.parse_expected`). Pure: no Redis.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

Answer = str | list[str]  # a single-label field's label, or a multi-label field's labels


def model_answers(result: Mapping[str, Any]) -> dict[str, Answer]:
    """The model's answer per field of a schema result (`contract.Triaged`)."""
    return {name: list(field["labels"]) if "labels" in field else field["label"]
            for name, field in result.get("fields", {}).items()}  # fmt: skip


def corrected_fields(model: Mapping[str, Answer], expected: Mapping[str, Answer]) -> list[str]:
    """The fields whose decided answer differs from the model's (multi-label: as sets)."""

    def same(a: Answer | None, b: Answer | None) -> bool:
        return sorted(a) == sorted(b) if isinstance(a, list) and isinstance(b, list) else a == b

    return [name for name in expected if not same(model.get(name), expected[name])]


def decision(item: Mapping[str, Any], expected: Mapping[str, Answer], reviewer: str, at: float) -> dict[str, Any]:
    """The record of `reviewer`'s decision `expected` on `item` (keys review_id, id, tenant, schema,
    text, result: the review entry as the gateway read it), made at unix time `at`."""
    model = model_answers(item["result"])
    return {
        "review_id": item["review_id"],
        "id": item["id"],
        "tenant": item["tenant"],
        "schema": item["result"].get("schema"),
        "text": item["text"],
        "expected": dict(expected),
        "model": model,
        "corrected": corrected_fields(model, expected),
        "reviewer": reviewer,
        "decided_at": utc_iso(at),
    }


def utc_iso(at: float) -> str:
    """Unix time `at` as `2026-12-06T04:30:00.123Z`."""
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def eval_row(record: Mapping[str, Any]) -> dict[str, Any]:
    """A labelled-file row (`ticketq eval`, `ticketq fit`) of a decision record."""
    return {"id": record["id"], "text": record["text"], "schema": record["schema"], "expected": record["expected"]}


def parse(data: bytes | str) -> dict[str, Any] | None:
    """A record from a stream entry's `data`, or None when it is not one (written by something else)."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    needed = ("id", "tenant", "text", "expected")
    return record if isinstance(record, dict) and all(key in record for key in needed) else None
