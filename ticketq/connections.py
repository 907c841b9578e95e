"""Opening a Redis client on a ticketq URL: timeouts, the retry policy, and one clear error.

`connect` is the one place that turns "cannot use Redis" into a line a person can act on: where
(the URL, password masked), what went wrong (credentials refused, or not reachable), and what to
set. Producers call it before their first send, workers at start-up.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from ticketq.config import mask_url

CONNECT_TIMEOUT_S = 3.0  # a Redis that does not accept a connection in this long is down for us
SOCKET_TIMEOUT_S = 10.0  # one command; blocking reads must stay well inside it
_AUTH_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)


class RedisUnavailable(ConnectionError):
    """Redis cannot be used: it refused the credentials, or it is not reachable.

    `str()` is one line: what failed, the URL (password masked) and what to do. `fix` names the
    settings to change; a caller with options of its own (a CLI flag) subclasses it.
    """

    fix = "set TICKETQ_BROKER_URL"

    def __init__(self, url: str, reason: object) -> None:
        self.url = mask_url(url)
        self.reason = mask_url(str(reason)).rstrip(".")
        self.refused = _caused_by(reason, _AUTH_ERRORS)
        if self.refused:
            message = (
                f"Redis at {self.url} refused the credentials ({self.reason}). Check the user and "
                f"password in the URL (redis://[user]:PASSWORD@host:6379/0); {self.fix}."
            )
        else:
            message = (
                f"Redis is not reachable at {self.url} ({self.reason}). Check that it is running "
                f"(redis-server --port 6379) and that the URL's host, port and db are right; {self.fix}."
            )
        super().__init__(message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, reason={self.reason!r})"


def redis_client(
    url: str,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    retries: int = 0,
) -> redis.Redis:
    """A redis-py client for a Celery-style Redis URL; nothing is sent yet.

    `retries` > 0 retries a command that failed on a connection error or timeout that many times,
    with exponential backoff (8 ms doubling up to 1 s): for a long-lived client that should ride
    out a Redis restart. 0, the default, fails at once, so the caller can report it.
    """
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.008), retries) if retries else Retry(NoBackoff(), 0)
    try:
        return redis.Redis.from_url(_redis_py_url(url), socket_connect_timeout=connect_timeout_s,
                                    socket_timeout=socket_timeout_s, retry=retry)  # fmt: skip
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {mask_url(url)}: {exc}") from None


def connect(
    url: str,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    retries: int = 0,
    error: type[RedisUnavailable] = RedisUnavailable,
) -> redis.Redis:
    """A `redis_client` that answered one PING, or `error(url, cause)` raised (`RedisUnavailable`)."""
    client = redis_client(url, connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s, retries=retries)
    try:
        client.ping()
    except (redis.exceptions.RedisError, OSError) as exc:
        client.close()
        raise error(url, exc) from None
    return client


def _redis_py_url(url: str) -> str:
    """The URL as redis-py wants it: Celery and kombu spell `ssl_cert_reqs=CERT_REQUIRED`, redis-py `required`."""
    parts = urlsplit(url)
    query = [(key, value.lower().removeprefix("cert_") if key == "ssl_cert_reqs" else value)
             for key, value in parse_qsl(parts.query)]  # fmt: skip
    return urlunsplit(parts._replace(query=urlencode(query)))


def _caused_by(reason: object, kinds: tuple[type[BaseException], ...]) -> bool:
    """`reason` is one of `kinds`, or was raised from one (kombu and Celery wrap redis-py's errors)."""
    for _ in range(8):  # exception chains are short; the bound only guards against a cycle
        if isinstance(reason, kinds):
            return True
        if not isinstance(reason, BaseException):
            return False
        reason = reason.__cause__ or reason.__context__
    return False
