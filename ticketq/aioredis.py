"""The asyncio twin of `connections.redis_client`, for commands an event loop sends itself (the gateway's
POST: one script, no thread hop). The same URLs (Redis, TLS, Sentinel) and timeouts; no retries inside
redis-py: the caller decides how long to ask again."""

from __future__ import annotations

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from ticketq.config import is_sentinel_url, mask_url
from ticketq.connections import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S, _redis_py_url, _sentinel_kwargs, parse_sentinel_url


def async_redis_client(url: str, *, master_name: str | None = None, sentinel_password: str | None = None,
                       connect_timeout_s: float = CONNECT_TIMEOUT_S,
                       socket_timeout_s: float = SOCKET_TIMEOUT_S) -> redis.asyncio.Redis:  # fmt: skip
    """An asyncio client for a Celery-style Redis or Sentinel URL (a sentinel:// URL needs `master_name`,
    and follows the master through a failover); nothing is sent yet."""
    options = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": socket_timeout_s,
               "retry": Retry(NoBackoff(), 0)}  # fmt: skip
    try:
        if is_sentinel_url(url):
            if not master_name:
                raise ValueError("a sentinel:// URL needs the master's name (TICKETQ_SENTINEL_MASTER)")
            target = parse_sentinel_url(url)
            manager = Sentinel(target.sentinels, sentinel_kwargs=_sentinel_kwargs(sentinel_password, socket_timeout_s,
                               connect_timeout_s), db=target.db, username=target.username, password=target.password,
                               **options)  # fmt: skip
            return manager.master_for(master_name)
        return redis.asyncio.Redis.from_url(_redis_py_url(url), **options)
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {mask_url(url)}: {exc}") from None
