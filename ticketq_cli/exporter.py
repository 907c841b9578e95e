"""`ticketq exporter`: the backlog as Prometheus sees it, without a worker.

Workers export `ticketq_queue_depth` too, but with every worker down nobody would: the backlog
signal (and KEDA's, and the backlog alert's) would vanish exactly when it matters. This small
process reads only Redis: each watched queue's depth (over kombu's priority lists) as
`ticketq_queue_depth{queue}`, and, shared by every queue, the dead-letter and results streams'
lengths and how many consumers hold a live lease. A scrape costs two round trips: HKEYS of the
consumers, then one pipeline of (priority steps + 1) LLENs per queue, two XLENs and one EXISTS
per registered consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from wsgiref.simple_server import WSGIServer

import redis
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily

from ticketq.names import ALIVE_KEY, CONSUMERS_KEY, DEAD_LETTER_STREAM, RESULTS_STREAM, queue_lists
from worker import constants as c
from worker.collectors import queue_depth_family
from worker.httpserver import health_app, wsgi_server

log = logging.getLogger(__name__)


class BacklogCollector:
    """Samples Redis at scrape time; a scrape while Redis is away reports `ticketq_exporter_redis_up 0`."""

    def __init__(self, client: redis.Redis, queues: Sequence[str]) -> None:
        if isinstance(queues, str) or not queues:
            raise ValueError(f"BacklogCollector: queues must be a non-empty list of queue names, not {queues!r}")
        self.client, self.queues = client, tuple(dict.fromkeys(queues))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        up = GaugeMetricFamily(c.M_EXPORTER_REDIS_UP, "1 when the exporter's last scrape of Redis succeeded.")
        try:
            depths, dead, results, alive = self._sample()
        except (redis.RedisError, OSError) as exc:
            log.warning("Redis unavailable (%s)", exc)
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield queue_depth_family(depths)
        yield _gauge(c.M_DEAD_LETTER_ENTRIES, "Entries in the dead-letter stream (ticketq:dead).", dead)
        yield _gauge(c.M_RESULT_ENTRIES, "Entries in the results stream (ticketq:results).", results)
        yield _gauge(c.M_CONSUMERS_ALIVE, "Consumers of the atomic fetch holding a live lease.", alive)

    def _sample(self) -> tuple[dict[str, int], int, int, int]:
        consumers = [name.decode() for name in self.client.hkeys(CONSUMERS_KEY)]
        lists = {queue: queue_lists(queue) for queue in self.queues}
        pipe = self.client.pipeline(transaction=False)
        for key in (key for keys in lists.values() for key in keys):
            pipe.llen(key)
        pipe.xlen(DEAD_LETTER_STREAM)
        pipe.xlen(RESULTS_STREAM)
        for name in consumers:
            pipe.exists(ALIVE_KEY.format(consumer=name))
        replies = iter(pipe.execute())
        depths = {queue: sum(next(replies) for _ in keys) for queue, keys in lists.items()}
        dead, results = next(replies), next(replies)
        return depths, dead, results, sum(replies)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], float(value))
    return family


def exporter_server(client: redis.Redis, queues: Sequence[str], host: str, port: int) -> WSGIServer:
    """/metrics (every queue of `queues`), /healthz and /readyz (Redis reachable) on host:port, not yet serving."""
    registry = CollectorRegistry()
    registry.register(BacklogCollector(client, queues))

    def redis_reachable() -> str | None:
        try:
            client.ping()
        except (redis.RedisError, OSError) as exc:
            return f"Redis unreachable ({type(exc).__name__}: {exc})"
        return None

    return wsgi_server(host, port, health_app(make_wsgi_app(registry), [redis_reachable]))
