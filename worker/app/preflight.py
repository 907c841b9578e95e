"""Before Celery starts: a Redis that can hold the queue (reachable, ours, not a replica, not
evicting), and one that takes writes."""

from __future__ import annotations

import logging
import time

import redis

from ticketq import connections
from ticketq.config import is_redis_url, mask_url
from ticketq.connections import RedisUnavailable, connect
from worker.errors import CannotStart
from worker.health.refusals import Refusals
from worker.settings import Settings

log = logging.getLogger(__name__)


def preflight(settings: Settings) -> redis.Redis:
    """A client on the broker, or a clear one-line exit: Redis unreachable, our credentials refused,
    a read-only replica, or a maxmemory-policy that evicts keys (unless TICKETQ_ALLOW_EVICTION)."""
    urls = [settings.broker_url] + [url for url in (settings.result_backend,)
                                    if url and url != settings.broker_url and is_redis_url(url)]  # fmt: skip
    clients: list[redis.Redis] = []
    try:
        for url in urls:
            try:
                clients.append(connect(url, **settings.sentinel, socket_timeout_s=10))
                problem = _server_problem(clients[-1], url, settings)
            except RedisUnavailable as exc:
                raise CannotStart(str(exc)) from None
            except redis.RedisError as exc:
                raise CannotStart(str(RedisUnavailable(url, exc))) from None
            if problem:
                raise CannotStart(problem)
    except SystemExit:
        for client in clients:
            connections.close(client)
        raise
    for client in clients[1:]:
        connections.close(client)
    return clients[0]


def _server_problem(client: redis.Redis, url: str, settings: Settings) -> str | None:
    """Why this Redis must not hold ticketq's queue: it evicts keys, or it is a read-only replica."""
    if connections.write_problem(client) == "read-only replica":
        return (f"Redis at {mask_url(url)} is a read-only replica: point TICKETQ_BROKER_URL at the master, "
                "or at the sentinels (sentinel://host:26379;... with TICKETQ_SENTINEL_MASTER) to follow failovers")
    policy = connections.memory_policy(client)
    if policy in ("noeviction", "unknown"):
        if policy == "unknown":
            log.warning("could not read Redis's maxmemory-policy at %s: make sure it is noeviction", mask_url(url))
        return None
    if settings.allow_eviction:
        log.warning("Redis at %s has maxmemory-policy %s: it may evict queued tickets, unacked messages and "
                    "results without a word (TICKETQ_ALLOW_EVICTION is on)", mask_url(url), policy)
        return None
    return (f"Redis at {mask_url(url)} has maxmemory-policy {policy}: under memory pressure it evicts keys, and "
            "the queue, unacked messages and results are keys, dropped without a word. Set `maxmemory-policy "
            "noeviction` (redis.conf, or CONFIG SET maxmemory-policy noeviction), or TICKETQ_ALLOW_EVICTION=true "
            "to start anyway")


def wait_for_writes(client: redis.Redis, refusals: Refusals, poll_s: float = 1.0) -> None:
    """Until Redis takes writes: a full Redis (noeviction) or one with too few replicas for
    min-replicas-to-write refuses the writes Celery's consumer starts with. /readyz says why meanwhile
    (`refusals`: the process's episodes)."""
    while (problem := connections.write_problem(client)) is not None:
        if not refusals.refusing(problem, "starting the consumer"):
            raise CannotStart(f"Redis refuses writes ({problem}): point TICKETQ_BROKER_URL at the master")
        time.sleep(poll_s)
    refusals.accepted()
