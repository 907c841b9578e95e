"""Helpdesk webhooks in: which source sent it (its signature kind, `gateway.signatures`, checked with
a shared secret), and which JSON fields of its payload are the ticket's id, subject and body.

A source's ticket id is `<source>:<id at its id path>`, so two helpdesks never collide; the text
is the subject, the body and (where the payload has one) the new comment, joined by blank lines;
metadata records the source and its id. Per source:

- `html`: the body and comment are HTML (Intercom's `<p>…`, Freshdesk's description, Help Scout's
  threads) and are turned into text (`html_text`: entities decoded, `<br>`/`<p>` as line breaks,
  scripts and styles dropped) before the model reads them.
- a text above TICKETQ_MAX_TICKET_BYTES (a long e-mail thread) is cut to it by the worker's own
  truncation rule (`ticketq.schema.truncate`, in UTF-8 bytes; `truncation`, default `head+tail`,
  which keeps both ends so the worker's token cut reads what it would have read in the whole),
  never refused; metadata `text_bytes` says how long it was.
- `ping`: `path=value` of a setup ping (Intercom's `topic=ping`): answered 200, nothing enqueued.
- `reclassify`: a later event for the same ticket (a new comment, an edit) is classified again:
  the ticket id is then `<source>:<id>:<event>`, `<event>` the payload's event id (`event` path) or,
  without one, a digest of the body; the same event delivered twice is one ticket (a no-op).
  Without it, a later event for a ticket already taken is a no-op.

Built-in sources are `DEFAULT_SOURCES`; a TOML file (TICKETQ_GATEWAY_WEBHOOK_MAPPING) replaces them:

    [sources.zendesk]
    kind = "zendesk"         # zendesk, hub, helpscout or freshdesk (gateway.signatures)
    id = "detail.id"
    subject = "detail.subject"
    body = "detail.description"
    comment = "event.comment.body"   # optional: a later event's new comment
    event = "id"                     # optional: the event's own id (reclassify)
    reclassify = true                # optional (default false)
    schema = "triage"                # optional: the schema its tickets are answered with
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

import html_text

from gateway.signatures import KINDS, SECRET_HEADER, BadSignature, parse_timestamp
from gateway.signatures import verify as verify_kind
from ticketq.schema import TRUNCATIONS, truncate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DEFAULT_SOURCES", "BadSignature", "Source", "Unmapped", "is_ping", "load_sources", "parse_timestamp",
           "ticket_of", "verify"]  # fmt: skip
EVENT_KEY = re.compile(r"[^A-Za-z0-9_.-]")  # what an event id may keep in a ticket id
EVENT_KEY_CHARS = 64


class Unmapped(ValueError):
    """A webhook payload without a field its source's mapping names (answered 422)."""


@dataclass(frozen=True)
class Source:
    """A helpdesk: its signature kind and the dotted JSON paths of the ticket's fields (module docstring)."""

    name: str
    kind: str
    id: str
    subject: str | None
    body: str
    schema: str | None = None
    html: bool = False
    comment: str | None = None
    event: str | None = None
    reclassify: bool = False
    ping: str | None = None
    truncation: str = "head+tail"
    secret_header: str = SECRET_HEADER

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"webhook source {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"webhook source {self.name!r}: truncation must be one of {', '.join(TRUNCATIONS)}, "
                             f"got {self.truncation!r}")  # fmt: skip
        if self.ping is not None and "=" not in self.ping:
            raise ValueError(f"webhook source {self.name!r}: ping must be `path=value`, got {self.ping!r}")


DEFAULT_SOURCES = {
    # Zendesk's event webhooks (zen:event-type:ticket.created, ...comment_added): the ticket is `detail`.
    "zendesk": Source(
        "zendesk",
        "zendesk",
        id="detail.id",
        subject="detail.subject",
        body="detail.description",
        comment="event.comment.body",
        event="id",
    ),
    # Intercom's conversation.user.created / .replied notifications: the conversation is data.item.
    "intercom": Source(
        "intercom",
        "hub",
        id="data.item.id",
        subject="data.item.source.subject",
        body="data.item.source.body",
        html=True,
        event="id",
        ping="topic=ping",
        comment="data.item.conversation_parts.conversation_parts.0.body",
    ),
    # Help Scout's convo.created / convo.customer.reply.created: a v2 Conversation, newest thread first.
    "helpscout": Source(
        "helpscout", "helpscout", id="id", subject="subject", body="_embedded.threads.0.body", html=True
    ),
    # Freshdesk's automation-rule webhook with the simple JSON content (the freshdesk_webhook object).
    "freshdesk": Source(
        "freshdesk",
        "freshdesk",
        id="freshdesk_webhook.ticket_id",
        subject="freshdesk_webhook.ticket_subject",
        body="freshdesk_webhook.ticket_description",
        comment="freshdesk_webhook.ticket_latest_public_comment",
        html=True,
    ),
}


def load_sources(path: str | None) -> dict[str, Source]:
    """The sources of a mapping file, or the built-in ones without one."""
    if path is None:
        return dict(DEFAULT_SOURCES)
    data = tomllib.loads(Path(path).read_text())
    known = {f.name for f in fields(Source)} - {"name"}
    sources = {}
    for name, entry in data.get("sources", {}).items():
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(f"{path}: webhook source {name!r} has unknown key(s) {', '.join(unknown)}")
        try:
            sources[name] = Source(
                name,
                entry["kind"],
                entry["id"],
                entry.get("subject"),
                entry["body"],
                **{k: v for k, v in entry.items() if k not in ("kind", "id", "subject", "body")},
            )
        except KeyError as exc:
            raise ValueError(f"{path}: webhook source {name!r} has no {exc.args[0]!r}") from None
    return sources


def verify(source: Source, secret: bytes, headers: Mapping[str, str], body: bytes, window_s: float,
           now: float | None = None) -> None:  # fmt: skip
    """Raise `BadSignature` (one line: what is wrong) unless `body` is signed by `secret` as `source` signs."""
    verify_kind(source.kind, secret, headers, body, window_s, now, source.secret_header)


def is_ping(source: Source, payload: object) -> bool:
    """True for the source's setup ping (answered 200, nothing enqueued)."""
    if source.ping is None:
        return False
    path, _, value = source.ping.partition("=")
    return _at(payload, path, required=False) == value


def ticket_of(source: Source, payload: object, body: bytes = b"", max_bytes: int | None = None) -> dict:
    """The ticket (`id`, `text`, `metadata`, and `schema` if the source names one) in a payload;
    `body` (the raw request) names the event when the source re-classifies and the payload has no
    event id; a text above `max_bytes` is cut by the truncation rule."""
    ticket_id = _at(payload, source.id)
    if not isinstance(ticket_id, str | int) or isinstance(ticket_id, bool):
        raise Unmapped(f"{source.id} must be a string or integer, got {type(ticket_id).__name__}")
    text = _text(source, payload)
    metadata = {"source": source.name, "source_id": str(ticket_id)}
    wire_id = f"{source.name}:{ticket_id}"
    if source.reclassify:
        metadata["event"] = _event_key(source, payload, body)
        wire_id = f"{wire_id}:{metadata['event']}"
    encoded = text.encode("utf-8", "surrogatepass")
    if max_bytes is not None and len(encoded) > max_bytes:
        text = bytes(truncate(encoded, max_bytes, source.truncation)).decode("utf-8", "ignore")
        metadata["text_bytes"] = len(encoded)
    ticket = {"id": wire_id, "text": text, "metadata": metadata}
    if source.schema:
        ticket["schema"] = source.schema
    return ticket


def _text(source: Source, payload: object) -> str:
    """Subject, body and (where present) the comment, joined by blank lines; HTML made text."""
    body = _at(payload, source.body)
    subject = _at(payload, source.subject, required=False) if source.subject else None
    comment = _at(payload, source.comment, required=False) if source.comment else None
    if not isinstance(body, str) or (subject is not None and not isinstance(subject, str)):
        raise Unmapped(f"{source.body} (and {source.subject}) must be strings")
    parts = [subject, _plain(source, body), _plain(source, comment) if isinstance(comment, str) else None]
    return "\n\n".join(part for part in parts if part)


def _plain(source: Source, text: str) -> str:
    return html_text.extract_text(text, guess_layout=True) if source.html and text.strip() else text


def _event_key(source: Source, payload: object, body: bytes) -> str:
    given = _at(payload, source.event, required=False) if source.event else None
    if isinstance(given, str | int) and not isinstance(given, bool) and str(given).strip():
        return EVENT_KEY.sub("-", str(given))[:EVENT_KEY_CHARS]
    return hashlib.sha256(body).hexdigest()[:24]


def _at(payload: object, path: str, required: bool = True) -> object:
    value = payload
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif required:
            raise Unmapped(f"the payload has no {path!r} (the source's mapping)")
        else:
            return None
    return value
