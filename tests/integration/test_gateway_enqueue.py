"""The gateway's accept step (`gateway/enqueue.lua`) against a private Redis, driven directly: the
depth it counts in tickets through its ledger while a consumer takes messages, and what one step
writes (all of it or nothing)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from gateway.enqueue import Enqueue, Outcome
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration

QUEUE = "enqueue-ledger"


def push(enqueue: Enqueue, run: asyncio.Runner, ids: list[str], message: bytes = b"m"):
    keys = [f"marker:{i}" for i in ids]
    return run.run(enqueue.push(keys, [True] * len(ids), message, [b'{"task_id": "t"}'] * len(ids)))


def test_the_depth_is_the_tickets_waiting_as_a_consumer_takes_messages(redis_server):
    """Random POST sizes, a consumer taking the oldest messages between them (as a worker does): the
    depth each step counts is exactly the tickets waiting; the bound refuses the first POST past it."""
    client, rng = redis_server.client(), random.Random(7)
    settings = GatewaySettings(broker_url=redis_server.url, queue=QUEUE, gateway_max_queue_depth=60)
    enqueue, waiting, n = Enqueue(settings), [], 0  # waiting: tickets per message, oldest first
    outcomes = {True: 0, False: 0}
    with asyncio.Runner() as run:
        for _ in range(300):
            for _ in range(rng.choice((0, 0, 1, 2))):  # the consumer takes the oldest messages
                if client.rpop(QUEUE) is not None:
                    waiting.pop(0)
            size = rng.randint(1, 12)
            step = push(enqueue, run, [f"t{n + k}" for k in range(size)])
            n += size
            assert step.depth == sum(waiting)
            outcomes[sum(waiting) + size <= 60] += 1
            if sum(waiting) + size <= 60:
                assert step.outcome is Outcome.PUSHED
                waiting.append(size)
            else:
                assert step.outcome is Outcome.FULL
            assert client.llen(QUEUE) == len(waiting)
        run.run(enqueue.aclose())
    assert min(outcomes.values()) > 20, outcomes  # both pushed and refused, many times


def test_a_step_writes_all_or_nothing(redis_server):
    client = redis_server.client()
    settings = GatewaySettings(broker_url=redis_server.url, queue=QUEUE, gateway_max_queue_depth=5)
    enqueue = Enqueue(settings)
    with asyncio.Runner() as run:
        assert push(enqueue, run, ["a", "b"]).outcome is Outcome.PUSHED
        assert json.loads(client.get("marker:a")) == {"task_id": "t"}
        assert client.ttl("marker:a") > 0
        full = push(enqueue, run, ["c", "d", "e", "f"])  # 2 + 4 > 5: refused, nothing written
        assert (full.outcome, full.depth) == (Outcome.FULL, 2)
        assert client.llen(QUEUE) == 1 and client.get("marker:c") is None
        changed = push(enqueue, run, ["a", "c"])  # the message carries a, which is marked: build it again
        assert changed.outcome is Outcome.CHANGED and changed.markers[1] is None
        assert client.llen(QUEUE) == 1 and client.get("marker:c") is None
        again = run.run(enqueue.push(["marker:a", "marker:c"], [False, True], b"m2", [b'{"task_id": "u"}']))
        assert again.outcome is Outcome.PUSHED and json.loads(again.markers[0]) == {"task_id": "t"}
        assert client.lrange(QUEUE, 0, -1) == [b"m2", b"m"] and json.loads(client.get("marker:c")) == {"task_id": "u"}
        assert push(enqueue, run, ["a", "c"]).outcome is Outcome.NOTHING_NEW
        run.run(enqueue.aclose())


def test_another_producers_messages_count_one_each_and_the_depth_never_falls_short(redis_server):
    client = redis_server.client()
    enqueue = Enqueue(GatewaySettings(broker_url=redis_server.url, queue=QUEUE, gateway_max_queue_depth=100))
    with asyncio.Runner() as run:
        assert push(enqueue, run, ["a", "b", "c", "d"]).outcome is Outcome.PUSHED
        client.lpush(QUEUE, b"another producer's", b"and another")
        assert push(enqueue, run, ["e"]).depth == 4 + 2
        client.rpop(QUEUE)  # the 4 tickets taken: 1 + 2 wait
        assert push(enqueue, run, ["f"]).depth >= 3  # counted high, never low: the bound is never passed
        run.run(enqueue.aclose())
