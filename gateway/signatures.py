"""Who sent a helpdesk webhook: each signature kind the helpdesks use, checked against the source's
shared secret (TICKETQ_GATEWAY_WEBHOOK_SECRETS). `verify` raises `BadSignature` (answered 401) with
one line saying what is wrong.

- `zendesk`: `X-Zendesk-Webhook-Signature` = base64 HMAC-SHA256(secret, timestamp + body), with
  the timestamp in `X-Zendesk-Webhook-Signature-Timestamp` (ISO 8601 or unix seconds); a timestamp
  further than TICKETQ_GATEWAY_WEBHOOK_WINDOW_S from now is refused, so a captured request cannot
  be replayed later. Within the window a replay names the same ticket id: a no-op.
- `hub` (GitHub, Intercom): `X-Hub-Signature-256: sha256=<hex HMAC-SHA256(secret, body)>`, or
  Intercom's `X-Hub-Signature: sha1=<hex>`.
- `helpscout`: `X-HelpScout-Signature` = base64 HMAC-SHA1(secret, raw body).
- `freshdesk`: Freshdesk signs nothing; its automation rule's webhook either authenticates with
  HTTP Basic (the secret is `user:password`, or `API_KEY:X` for its API-key option) or sends a custom
  header the rule is given: the secret in the source's `secret_header` (default
  `X-Ticketq-Webhook-Secret`). Either is compared with the secret in constant time.

`hub`, `helpscout` and `freshdesk` carry no timestamp: a replay is a no-op by its ticket (or
event) id, never a second ticket.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping
from datetime import datetime, timezone

KINDS = ("zendesk", "hub", "helpscout", "freshdesk")
SECRET_HEADER = "X-Ticketq-Webhook-Secret"  # Freshdesk's custom-header option, unless a source names another


class BadSignature(ValueError):
    """A webhook whose signature is missing, wrong, or out of the time window (answered 401)."""


def verify(kind: str, secret: bytes, headers: Mapping[str, str], body: bytes, window_s: float,
           now: float | None = None, secret_header: str = SECRET_HEADER) -> None:  # fmt: skip
    """Raise `BadSignature` unless `body` (with `headers`, whose names are looked up in lower case)
    is signed or authenticated by `secret` as `kind` does it."""
    if kind == "zendesk":
        _verify_zendesk(secret, headers, body, window_s, time.time() if now is None else now)
    elif kind == "hub":
        _verify_hub(secret, headers, body)
    elif kind == "helpscout":
        _verify_helpscout(secret, headers, body)
    elif kind == "freshdesk":
        _verify_freshdesk(secret, headers, secret_header)
    else:
        raise ValueError(f"signature kind must be one of {', '.join(KINDS)}, got {kind!r}")


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
        raise BadSignature(
            f"timestamp {stamp!r} is {abs(now - at):.0f} s from now, outside the "
            f"{window_s:g} s window (TICKETQ_GATEWAY_WEBHOOK_WINDOW_S): a replay, or a skewed clock"
        )


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


def _verify_helpscout(secret: bytes, headers: Mapping[str, str], body: bytes) -> None:
    given = headers.get("x-helpscout-signature")
    if not given:
        raise BadSignature("missing X-HelpScout-Signature (base64 HMAC-SHA1 of the body)")
    expected = base64.b64encode(hmac.new(secret, body, hashlib.sha1).digest()).decode()
    if not hmac.compare_digest(expected, given.strip()):
        raise BadSignature("X-HelpScout-Signature does not match the body")


def _verify_freshdesk(secret: bytes, headers: Mapping[str, str], secret_header: str) -> None:
    scheme, _, value = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() == "basic":
        try:
            given = base64.b64decode(value.strip(), validate=True)
        except (binascii.Error, ValueError):
            raise BadSignature("Authorization: Basic is not base64") from None
        if not hmac.compare_digest(given, secret):
            raise BadSignature("Authorization: Basic does not match the source's user:password")
        return
    shared = headers.get(secret_header.lower())
    if shared is None:
        raise BadSignature(f"missing Authorization: Basic (user:password) or {secret_header}")
    if not hmac.compare_digest(shared.strip().encode(), secret):
        raise BadSignature(f"{secret_header} does not match the source's secret")


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
