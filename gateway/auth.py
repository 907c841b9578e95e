"""Who may call the gateway, and how often: bearer tokens checked against their sha256 digests
(TICKETQ_GATEWAY_TOKENS), the tenant each belongs to, and a token bucket per caller.

A token named `name@tenant` belongs to `tenant`; any other to the tenant `default` (so a
single-tenant setup is written as before). Everything a caller sees (ticket ids, Idempotency-Keys,
results) is its tenant's.

A bucket holds TICKETQ_GATEWAY_BURST requests and refills at TICKETQ_GATEWAY_RATE per second;
an empty one answers with the seconds until the next request is allowed. Buckets live in this
process: N gateway replicas allow N times the rate (the ingress may add a global limit). Cost:
one sha256 and a dict lookup per request; memory, one bucket per token or webhook source.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import threading
import time
from collections.abc import Mapping

DEFAULT_TENANT = "default"
TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # no ':' : it separates the tenant from a ticket id


def tenant_of(token_name: str) -> str:
    """The tenant of a token named `name@tenant`, else `default`."""
    return token_name.partition("@")[2] or DEFAULT_TENANT


def token_digest(token: str) -> str:
    """What TICKETQ_GATEWAY_TOKENS stores for `token`: its sha256, hex (`printf %s TOKEN | sha256sum`)."""
    return hashlib.sha256(token.encode()).hexdigest()


def caller(authorization: str | None, tokens: Mapping[str, str]) -> str | None:
    """The name of the token in an `Authorization: Bearer TOKEN` header, or None if it is no token
    of `tokens` (name -> sha256 hex). Every digest is compared in constant time."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    digest = token_digest(token.strip())
    found = None
    for name, expected in tokens.items():
        if hmac.compare_digest(digest, expected):
            found = name
    return found


class TokenBuckets:
    """One token bucket per caller name: `take(name)` is 0 when allowed, else seconds to wait."""

    def __init__(self, rate: float, burst: int, clock=time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"a token bucket needs rate > 0 and burst >= 1, got {rate!r}, {burst!r}")
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, name: str) -> float:
        with self._lock:
            now = self.clock()
            tokens, at = self._buckets.get(name, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                self._buckets[name] = (tokens - 1.0, now)
                return 0.0
            self._buckets[name] = (tokens, now)
            return (1.0 - tokens) / self.rate

    @staticmethod
    def retry_after(wait_s: float) -> int:
        """Retry-After is whole seconds: at least 1."""
        return max(1, math.ceil(wait_s))
