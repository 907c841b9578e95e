"""The review page's browser session: a token presented once in a login form, then a signed cookie.

The cookie (`keys.REVIEW_COOKIE`, HttpOnly, SameSite=Strict, Secure unless
TICKETQ_GATEWAY_REVIEW_INSECURE_COOKIE) holds the token's name, an expiry and the first 16 hex
digits of the token's digest, signed with HMAC-SHA256 under TICKETQ_GATEWAY_REVIEW_SECRET. It is
good while it has not expired *and* the named token is still configured with that digest: removing
or rotating a token in TICKETQ_GATEWAY_TOKENS ends its sessions. The token itself is never stored.

Every form post carries a CSRF token derived from the cookie (HMAC of it under the same secret),
checked in constant time: SameSite=Strict already keeps other sites' posts cookie-less; the token
also refuses a post from a page of this origin that was not ours (defence in depth).
Pure: no Redis, no HTTP framework.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping

DIGEST_PREFIX = 16  # hex digits of the token's sha256 kept in the cookie: enough to notice a rotation


def _mac(secret: bytes, purpose: bytes, value: str) -> str:
    return hmac.new(secret, purpose + b"\0" + value.encode(), hashlib.sha256).hexdigest()


def issue(secret: bytes, name: str, digest: str, now: float, ttl_s: float) -> str:
    """A cookie value for the token `name` (whose sha256 hex is `digest`), good for `ttl_s`."""
    payload = json.dumps([name, int(now + ttl_s), digest[:DIGEST_PREFIX]], separators=(",", ":"))
    body = base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")
    return f"{body}.{_mac(secret, b'session', body)}"


def holder(secret: bytes, cookie: str | None, tokens: Mapping[str, str], now: float) -> str | None:
    """The token name a cookie stands for, or None: missing, forged, expired, or its token gone or rotated."""
    body, dot, mac = (cookie or "").partition(".")
    if not dot or not hmac.compare_digest(mac, _mac(secret, b"session", body)):
        return None
    try:
        name, expires, digest = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, TypeError):
        return None
    if not isinstance(name, str) or not isinstance(expires, int) or expires <= now:
        return None
    current = tokens.get(name)
    if current is None or not hmac.compare_digest(current[:DIGEST_PREFIX], str(digest)):
        return None
    return name


def csrf_token(secret: bytes, cookie: str) -> str:
    """The CSRF token of a session's forms."""
    return _mac(secret, b"csrf", cookie)


def csrf_ok(secret: bytes, cookie: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(csrf_token(secret, cookie), given)
