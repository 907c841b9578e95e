"""The operator's view of a running ticketq, read from Redis and Celery: queue status, dead letters
(`ticketq_cli.dead_letters`: list, show, requeue through Celery with the original task id), and
result lookup.

No torch: it runs anywhere a producer runs. Stream names come from `ticketq.names`, keys and the
writes a requeue makes from `worker.redis.requeue`.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import kombu.exceptions
import redis
from kombu.transport.redis import Channel

from producer.api import Producer
from ticketq import connections, epoch, names
from ticketq.config import mask_url
from ticketq_cli.dead_letters import DeadLetters
from worker.settings import Settings


class Ops(DeadLetters):
    """Operator commands over one broker; a thin layer on `Producer` (its Celery app and Redis client).
    The dead letters' commands (list, settle, requeue) are `DeadLetters`'."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.producer = Producer(settings)
        self.redis = self.producer.redis

    def close(self) -> None:
        self.producer.close()

    def status(self, ping_timeout: float = 1.0) -> dict:
        """Everything `ticketq status` shows. `workers_unknown` (present only then) says why no
        worker could be asked: the Celery ping writes, which a full Redis refuses; the rest reads."""
        workers, unknown = self.workers(ping_timeout)
        letters = self.dead_letters()
        return {
            "queue": self.settings.queue,
            "queue_depth": self.producer.queue_depth(),
            "in_flight": self.in_flight(),
            "fetching": self.fetching(),
            "leases": self.leases(),
            "workers": workers,
            **({"workers_unknown": unknown} if unknown else {}),
            "dead_letters": dict(Counter(letter.reason for letter in letters).most_common()),
            "requeued_awaiting_result": sum(bool(letter.requeued_as) for letter in letters),
            "results_stream": self.redis.xlen(names.RESULTS_STREAM),
            "review_stream": self.review_stream(),
            # noeviction is the only safe policy: any other may drop the queue, unacked messages, results
            "redis": connections.memory_state(self.redis),
            "redis_data": epoch.describe(self.redis),
        }

    def workers(self, timeout: float) -> tuple[list[str], str | None]:
        """The workers that answer Celery's ping, and None; or none and why they could not be asked."""
        try:
            replies = self.producer.app.control.ping(timeout=timeout) or []
        except (redis.RedisError, kombu.exceptions.OperationalError, OSError) as exc:
            refusal = connections.write_refusal(exc)
            if refusal:
                return [], (f"not asked: Redis refuses the writes a Celery ping makes ({refusal}); "
                            "the leases line counts the live consumers")  # fmt: skip
            return [], f"not asked: the Celery ping failed ({type(exc).__name__}: {mask_url(str(exc))})"
        return sorted(name for reply in replies for name in reply), None

    def review_stream(self) -> dict[str, int]:
        """The review stream's entries, and per consumer group those delivered but not acknowledged
        (`pending`) and not yet delivered (`lag`, Redis >= 7)."""
        state = {"entries": self.redis.xlen(names.REVIEW_STREAM)}
        try:
            groups = self.redis.xinfo_groups(names.REVIEW_STREAM)
        except redis.ResponseError:  # no such stream yet
            groups = []
        for group in groups:
            name = group["name"].decode() if isinstance(group["name"], bytes) else group["name"]
            state[f"{name} pending"] = int(group["pending"])
            if group.get("lag") is not None:
                state[f"{name} lag"] = int(group["lag"])
        return state

    def in_flight(self) -> int:
        """Messages of the ticket queue delivered to a worker and not yet acknowledged. kombu's
        unacked hash holds every queue's (Celery's control replies, `*.reply.celery.pidbox`, and
        event queues too, once Flower or `celery inspect` talk to the workers): each record is
        [message, exchange, routing key], and only the ticket queue's routing key is counted."""
        count = 0
        for _, record in self.redis.hscan_iter(Channel.unacked_key, count=1000):
            try:
                routing_key = json.loads(record)[2]
            except (ValueError, IndexError, TypeError):  # not kombu's record: not a ticket message
                continue
            count += routing_key == self.settings.queue
        return count

    def fetching(self) -> int:
        """Messages of the ticket queue moved into a consumer's fetching list and not yet recorded
        as unacked: normally 0 between two fetches; more while Redis refuses writes or a fetch reply
        was lost (each is delivered by its consumer, or requeued once its lease runs out)."""
        pattern = names.FETCHING_KEY.format(consumer="*", queue=self.settings.queue)
        return sum(self.redis.llen(key) for key in self.redis.scan_iter(match=pattern, count=1000))

    def leases(self) -> dict[str, int]:
        """Consumers of the ticket queue (worker.transport's atomic fetch): holding a lease, or expired
        and awaiting recovery by a live worker (their messages go back to the queue within a lease
        period). A consumer record names its queues; those of control and event queues only are
        Celery's own, not workers of this queue."""
        consumers = [name for name, info in self.redis.hgetall(names.CONSUMERS_KEY).items()
                     if self.settings.queue in _queues(info)]  # fmt: skip
        pipe = self.redis.pipeline(transaction=False)
        for name in consumers:
            pipe.exists(names.ALIVE_KEY.format(consumer=name.decode()))
        alive = sum(bool(found) for found in pipe.execute())
        return {"alive": alive, "expired": len(consumers) - alive}

    def result(self, key: str) -> list[dict]:
        """Results for a task id or a ticket id: the results stream first, else the Celery backend."""
        found = [result for _, result in self.producer.results_stream()
                 if key in (result.get("id"), result.get("task_id"))]  # fmt: skip
        if found:
            return found
        meta = self.producer.app.backend.get_task_meta(key)
        if meta.get("status") in (None, "PENDING"):
            return []
        value = meta.get("result")
        if meta["status"] != "SUCCESS":
            return [{"task_id": key, "status": "failed", "error": str(value)}]
        return value if isinstance(value, list) else [value]


def redis_data_line(described: dict) -> str:
    """`epoch.describe` in words, for `ticketq status`: since when Redis holds its data, or that it lost it."""
    marker, lost = described.get("marker"), described.get("lost")
    if lost:
        gone = f"what it held since {_when(lost.get('since'))}" if lost.get("since") else "what it held"
        return (f"LOST: Redis came back without its data (noticed {_when(lost.get('noticed_at'))} by "
                f"{lost.get('by', '?')}): {gone} is gone; tickets still waiting are answered once re-sent")  # fmt: skip
    if marker:
        return f"kept since {_when(marker.get('since'))} (epoch marker set by {marker.get('by', '?')})"
    return "no epoch marker yet (no worker or producer has checked since Redis started empty)"


def _when(unix: object) -> str:
    if not isinstance(unix, int | float):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


def _queues(info: bytes) -> list[str]:
    """The queues a consumer record (`ticketq:consumers`) names."""
    try:
        queues = json.loads(info).get("queues", [])
    except (ValueError, AttributeError):
        return []
    return queues if isinstance(queues, list) else []
