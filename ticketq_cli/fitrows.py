"""The labelled rows `ticketq fit` trains on: a labelled file (`evaluate`'s format: JSONL or CSV rows
with `text` and `expected`), the review page's decisions (`names.LABELLED_STREAM`, read as `ticketq
reviews export` reads it: `--from-reviews`), or both.

`expected` comes in two shapes: a plain label (a labelled file for the single field) or an object
{field: label} / {field: [labels]} (what `ticketq reviews export` writes, and what a schema needs).
`single_label` reads either as one label: the label itself, or the object's one field's label.
`field_labels` reads either for a schema (`evaluate.parse_expected`: a plain label is the one
field's of a one-field schema). A row that gives neither is counted in `skipped`, with why.
What both kinds of fit (`fit`, `fitschema`) share lives here too: `FitOptions`, `MIN_ROWS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from producer.ticketfile import TicketReader
from producer.ticketrows import RowError, TicketFileError
from ticketq.schema import Schema
from ticketq_cli.common import fail

MIN_ROWS = 20  # fewer labelled rows fit nothing worth serving


@dataclass(frozen=True)
class FitOptions:
    """How the rows are split and what is written: one record for both kinds of fit."""

    out: Path
    shares: tuple[float, float, int]  # (holdout share, validation share, seed)
    progress: bool
    force: bool
    json_out: Path | None


Parse = Callable[[Any], Any]  # a row's `expected` -> what the fit trains on; ValueError says why not


@dataclass
class Labelled:
    """The usable rows (text, parsed `expected`), and what was left out."""

    texts: list[str] = field(default_factory=list)
    expected: list[Any] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # `source: why` of rows not used

    def add(self, source: str, text: str, expected: Any, parse: Parse) -> None:
        """The row, its `expected` parsed, or one line in `skipped` saying why not."""
        try:
            parsed = parse(expected)
        except ValueError as exc:
            self.skipped.append(f"{source}: {exc}")
            return
        self.texts.append(text)
        self.expected.append(parsed)

    def extend(self, other: Labelled) -> None:
        self.texts += other.texts
        self.expected += other.expected
        self.skipped += other.skipped


def single_label(expected: Any) -> str:
    """The one label of a row for the single field: the label, or the label of an object's one field."""
    if isinstance(expected, dict) and len(expected) == 1:
        (expected,) = expected.values()
    if not isinstance(expected, str) or not expected:
        raise ValueError("no single `expected` label")
    return expected


def field_labels(schema: Schema) -> Parse:
    """A row's `expected` parsed for `schema`: {field: label or labels} (`evaluate.parse_expected`)."""
    from ticketq_cli.evaluate import parse_expected

    def parse(expected: Any) -> dict:
        if expected is None:
            raise ValueError("no `expected`")
        return parse_expected(schema, expected)

    return parse


def read_file(path: Path, fmt: str, max_bytes: int, parse: Parse, schema: str | None = None) -> Labelled:
    """The rows of a labelled file; rows naming a schema other than `schema` (where given) skipped."""
    found = Labelled()
    try:
        reader = TicketReader(path, fmt, max_bytes)  # type: ignore[arg-type]
    except TicketFileError as exc:
        fail(str(exc))
    with reader:
        for row in reader:
            if isinstance(row, RowError):
                found.skipped.append(f"{row.source}: {row.reason}: {row.message}")
            elif schema is not None and row.ticket.get("schema") not in (None, schema):
                found.skipped.append(f"{row.source}: answered with schema {row.ticket['schema']!r}, not {schema!r}")
            else:
                found.add(row.source, row.ticket["text"], row.ticket.get("expected"), parse)
    return found


def read_reviews(records: Iterable[dict], parse: Parse) -> Labelled:
    """The review page's decision records (`ticketq_cli.reviews.records`), oldest first."""
    found = Labelled()
    for record in records:
        source = f"review {record.get('review_id', '?')}"
        if not isinstance(record.get("text"), str):
            found.skipped.append(f"{source}: no ticket text recorded")
        else:
            found.add(source, record["text"], record.get("expected"), parse)
    return found


def from_reviews(settings, tenant: str | None, schema: str | None, parse: Parse) -> Labelled:
    """The decisions on the broker's labelled stream (of `tenant`, of results of `schema`, where given);
    one line and exit 2 where the broker does not answer."""
    import redis

    from producer.errors import BrokerUnavailable
    from ticketq.connections import RedisUnavailable, connect
    from ticketq_cli.reviews import records

    try:
        client = connect(settings.broker_url, **settings.sentinel, retries=3)
        return read_reviews(records(client, tenant, schema), parse)
    except RedisUnavailable as exc:
        fail(str(exc))
    except redis.RedisError as exc:  # lost while reading: the broker, not a traceback
        fail(str(BrokerUnavailable(settings.broker_url, exc)))
