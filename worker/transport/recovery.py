"""The recovery of consumers whose lease ran out: their fetched and unacked messages back in the queue.

Any live worker hands back what a dead consumer held within seconds, instead of after kombu's
visibility timeout (which stays as a backstop). A channel lost to a broker outage is such a
consumer too: its leftovers come back once its lease has run out. Every change is one command of
the worker-state script (`worker.transport.state`), so two workers recovering the same consumer
restore each message once, and a message a live consumer fetched again (same delivery tag) stays
the live one's.

Cost per call (every quarter lease, once the caller has held its own lease for a full period):
one HGETALL of the consumer registry and one pipelined EXISTS per other consumer; per dead
consumer, one script call per queue and one per message it held.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

import redis
from kombu.utils.encoding import bytes_to_str

from ticketq.names import ALIVE_KEY, CONSUMERS_KEY, OWNED_KEY, queue_lists
from worker.transport.state import WorkerState

log = logging.getLogger(__name__)

# (client, dead consumer, delivery tag) -> whether this call put that unacked message back.
RestoreOwned = Callable[[redis.Redis, str, str], bool]


class Recovery:
    """Recovers the consumers, other than `consumer`, whose lease ran out."""

    def __init__(self, consumer: str, state: WorkerState, restore_owned: RestoreOwned) -> None:
        self.consumer = consumer
        self.state = state
        self.restore_owned = restore_owned

    def recover_expired(self, client: redis.Redis, queues: Iterable[str]) -> None:
        """Every registered consumer without a lease, then kombu's priority lists of `queues`."""
        consumers = {bytes_to_str(k): json.loads(v) for k, v in client.hgetall(CONSUMERS_KEY).items()}
        others = [name for name in consumers if name != self.consumer]
        pipe = client.pipeline(transaction=False)
        for name in others:
            pipe.exists(ALIVE_KEY.format(consumer=name))
        for name, alive in zip(others, pipe.execute(), strict=True):
            if not alive:
                self.recover(client, name, consumers[name].get("queues", []))
        collect_priority_lists(client, queues)

    def recover(self, client: redis.Redis, consumer: str, queues: Iterable[str]) -> None:
        """Put a dead consumer's fetched and unacked messages back in their queues (safe to race)."""
        started = time.monotonic()
        fetched = sum(self.state.requeue(client, consumer, queue) for queue in queues)
        tags = [bytes_to_str(tag) for tag in client.smembers(OWNED_KEY.format(consumer=consumer))]
        restored = sum(self.restore_owned(client, consumer, tag) for tag in tags)
        self.state.forget(client, consumer)
        if fetched or restored:
            log.warning(
                "recovered %d unacked and %d fetched message(s) of consumer %s (lease expired) in %.3fs",
                restored, fetched, consumer, time.monotonic() - started,
            )  # fmt: skip


def collect_priority_lists(client: redis.Redis, queues: Iterable[str]) -> None:
    """Messages a plain Celery client sent with a priority wait in kombu's per-priority lists,
    which BLMOVE does not read: move them into the queue list."""
    for queue in queues:
        for source in queue_lists(queue)[1:]:
            while client.lmove(source, queue, "RIGHT", "LEFT"):
                pass
