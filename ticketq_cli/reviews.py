"""`ticketq reviews export`: the reviewers' decisions (`names.LABELLED_STREAM`, written by the
gateway's review page) as a labelled file, one JSON row per decision in the format `ticketq eval
--schema` and `ticketq fit` read: `{"id", "text", "schema", "expected": {field: label}}`
(`ticketq.labelled.eval_row`). Oldest decision first; read in pages, so memory stays bounded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from ticketq import labelled
from ticketq.names import LABELLED_STREAM

PAGE = 1000  # entries per XRANGE


@dataclass
class Exported:
    """What an export wrote: rows, of which corrected by the reviewer; decisions left out (no text)."""

    rows: int = 0
    corrected: int = 0
    without_text: int = 0


def records(client: redis.Redis, tenant: str | None = None, schema: str | None = None) -> Iterator[dict[str, Any]]:
    """The decision records of the labelled stream, oldest first, of `tenant` and `schema` where given."""
    start = "-"
    while True:
        page = client.xrange(LABELLED_STREAM, start, "+", count=PAGE)
        for _, fields in page:
            record = labelled.parse(fields.get(b"data", b""))
            if record is None or (tenant is not None and record["tenant"] != tenant):
                continue
            if schema is None or record.get("schema") == schema:
                yield record
        if len(page) < PAGE:
            return
        start = "(" + page[-1][0].decode()


def export(client: redis.Redis, out: Path, tenant: str | None = None, schema: str | None = None) -> Exported:
    """Write the decisions to `out` (JSONL, replaced whole: written beside it, then renamed)."""
    summary = Exported()
    partial = out.with_name(out.name + ".partial")
    with partial.open("w", encoding="utf-8") as fh:
        for record in records(client, tenant, schema):
            if not isinstance(record.get("text"), str):
                summary.without_text += 1
                continue
            fh.write(json.dumps(labelled.eval_row(record), ensure_ascii=False) + "\n")
            summary.rows += 1
            summary.corrected += bool(record.get("corrected"))
    partial.replace(out)
    return summary
