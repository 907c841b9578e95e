"""Helpdesk webhooks in: which source sent it (its signature, checked with a shared secret), and
which JSON fields of its payload are the ticket's id, subject and body.

Two signature kinds, as the helpdesks sign:
- `zendesk`: `X-Zendesk-Webhook-Signature` = base64 HMAC-SHA256(secret, timestamp + body), with
  the timestamp in `X-Zendesk-Webhook-Signature-Timestamp` (ISO 8601 or unix seconds); a timestamp
  further than TICKETQ_GATEWAY_WEBHOOK_WINDOW_S from now is refused, so a captured request cannot
  be replayed later. Within the window a replay names the same ticket id: a no-op.
- `hub` (GitHub, Intercom): `X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, body)>`, or
  Intercom's `X-Hub-Signature: sha1=<hex>`. These carry no timestamp: a replay is a no-op by the
  ticket id, never a second ticket.

A source's ticket id is `<source>:<id at its id path>`, so two helpdesks never collide; the text
is the subject and the body joined by a blank line; metadata records the source and its id.
Built-in sources are `DEFAULT_SOURCES`; a TOML file (TICKETQ_GATEWAY_WEBHOOK_MAPPING) replaces them:

    [sources.zendesk]
    kind = "zendesk"
    id = "detail.id"
    subject = "detail.subject"
    body = "detail.description"
    schema = "triage"        # optional: the schema its tickets are answered with
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KINDS = ("zendesk", "hub")


class BadSignature(ValueError):
    """A webhook whose signature is missing, wrong, or out of the time window (answered 401)."""


class Unmapped(ValueError):
    """A webhook payload without a field its source's mapping names (answered 422)."""


@dataclass(frozen=True)
class Source:
    """A helpdesk: its signature kind and the dotted JSON paths of the ticket's fields."""

    name: str
    kind: str
    id: str
    subject: str | None
    body: str
    schema: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"webhook source {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


DEFAULT_SOURCES = {
    # Zendesk's event webhooks (zen:event-type:ticket.created): the ticket is `detail`.
    "zendesk": Source("zendesk", "zendesk", id="detail.id", subject="detail.subject", body="detail.description"),
    # Intercom's conversation.user.created notification: the conversation is data.item.
    "intercom": Source("intercom", "hub", id="data.item.id", subject="data.item.source.subject",
                       body="data.item.source.body"),
}


def load_sources(path: str | None) -> dict[str, Source]:
    """The sources of a mapping file, or the built-in ones without one."""
    if path is None:
        return dict(DEFAULT_SOURCES)
    data = tomllib.loads(Path(path).read_text())
    sources = {}
    for name, entry in data.get("sources", {}).items():
        try:
            sources[name] = Source(name, entry["kind"], entry["id"], entry.get("subject"), entry["body"],
                                   entry.get("schema"))  # fmt: skip
        except KeyError as exc:
            raise ValueError(f"{path}: webhook source {name!r} has no {exc.args[0]!r}") from None
    return sources


def verify(source: Source, secret: bytes, headers: Mapping[str, str], body: bytes, window_s: float,
           now: float | None = None) -> None:  # fmt: skip
    """Raise `BadSignature` (one line: what is wrong) unless `body` is signed by `secret`."""
    if source.kind == "zendesk":
        _verify_zendesk(secret, headers, body, window_s, time.time() if now is None else now)
    else:
        _verify_hub(secret, headers, body)


def _verify_zendesk(secret: bytes, headers: Mapping[str, str], body: bytes, window_s: float, now: float) -> None:
    signature = headers.get("x-zendesk-webhook-signature")
    stamp = headers.get("x-zendesk-webhook-signature-timestamp")
    if not signature or not stamp:
        raise BadSignature("missing X-Zendesk-Webhook-Signature or X-Zendesk-Webhook-Signature-Timestamp")
    expected = base64.b64encode(hmac.new(secret, stamp.encode() + body, hashlib.sha256).digest()).decode()
    if not hmac.compare_digest(expected, signature.strip()):
        raise BadSignature("X-Zendesk-Webhook-Signature does not match the body and timestamp")
    at = parse_timestamp(stamp)
    if abs(now - at) > window_s:
        raise BadSignature(f"timestamp {stamp!r} is {abs(now - at):.0f} s from now, outside the "
                           f"{window_s:g} s window (TICKETQ_GATEWAY_WEBHOOK_WINDOW_S): a replay, or a skewed clock")


def _verify_hub(secret: bytes, headers: Mapping[str, str], body: bytes) -> None:
    for header, algorithm in (("x-hub-signature-256", "sha256"), ("x-hub-signature", "sha1")):
        given = headers.get(header)
        if given is None:
            continue
        expected = f"{algorithm}=" + hmac.new(secret, body, algorithm).hexdigest()
        if not hmac.compare_digest(expected, given.strip().lower()):
            raise BadSignature(f"{header} does not match the body")
        return
    raise BadSignature("missing X-Hub-Signature-256 (sha256=<hex HMAC of the body>)")


def parse_timestamp(stamp: str) -> float:
    """Unix seconds of an ISO 8601 timestamp (a trailing Z is UTC) or of a number; `BadSignature` else."""
    text = stamp.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise BadSignature(f"timestamp {text[:40]!r} is neither ISO 8601 nor unix seconds") from None
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()


def ticket_of(source: Source, payload: object) -> dict:
    """The ticket (`id`, `text`, `metadata`, and `schema` if the source names one) in a payload."""
    ticket_id = _at(payload, source.id)
    body = _at(payload, source.body)
    subject = _at(payload, source.subject, required=False) if source.subject else None
    if not isinstance(ticket_id, str | int) or isinstance(ticket_id, bool):
        raise Unmapped(f"{source.id} must be a string or integer, got {type(ticket_id).__name__}")
    if not isinstance(body, str) or (subject is not None and not isinstance(subject, str)):
        raise Unmapped(f"{source.body} (and {source.subject}) must be strings")
    text = f"{subject}\n\n{body}" if subject else body
    ticket = {"id": f"{source.name}:{ticket_id}", "text": text,
              "metadata": {"source": source.name, "source_id": str(ticket_id)}}  # fmt: skip
    if source.schema:
        ticket["schema"] = source.schema
    return ticket


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
