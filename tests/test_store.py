"""The Outbox's publish-once script against the real Redis: each (task, slot) result is streamed once."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from workers import redis_or_skip

from ticketq.names import RESULTS_STREAM
from worker.store import ATTEMPTS_KEY, DONE_KEY, Outbox

REDIS_URL = "redis://127.0.0.1:6379/6"  # a database of its own: its stream entries are not ticket results


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    client = redis_or_skip(REDIS_URL)
    yield client
    client.delete(RESULTS_STREAM)
    client.close()


def streamed(client: redis.Redis, task_ids: set[str]) -> Counter:
    """(task, slot) -> times it is in the results stream."""
    counts = Counter()
    for _, fields in client.xrange(RESULTS_STREAM):
        result = json.loads(fields[b"data"])
        if isinstance(result, dict) and result.get("task") in task_ids:
            counts[result["task"], result["slot"]] += 1
    return counts


def result(task_id: str, slot: int) -> tuple[str, int, bytes]:
    return task_id, slot, json.dumps({"task": task_id, "slot": slot}).encode()


def test_each_result_is_streamed_once_and_repeats_are_named(client: redis.Redis) -> None:
    outbox = Outbox(client, stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    a, b = f"store-a-{uuid.uuid4()}", f"store-b-{uuid.uuid4()}"
    client.set(ATTEMPTS_KEY.format(task_id=a), 1)
    client.set(ATTEMPTS_KEY.format(task_id=b), 1)

    # slots of two messages interleaved, as a length-sorted forward batch mixes them
    assert outbox.publish([result(a, 2), result(b, 0), result(a, 0)], finished=[b]) == []
    assert not client.exists(ATTEMPTS_KEY.format(task_id=b)) and client.exists(ATTEMPTS_KEY.format(task_id=a))
    assert 0 < client.ttl(DONE_KEY.format(task_id=a)) <= 600

    # a re-execution publishes only what was not out yet, and says which were
    repeated = outbox.publish([result(a, 0), result(a, 1), result(b, 0), result(a, 2)], finished=[a])
    assert sorted(repeated) == sorted([(a, 0), (b, 0), (a, 2)])
    assert not client.exists(ATTEMPTS_KEY.format(task_id=a))
    assert streamed(client, {a, b}) == Counter({(a, 0): 1, (a, 1): 1, (a, 2): 1, (b, 0): 1})


def test_a_large_message_spans_several_bitfield_calls(client: redis.Redis) -> None:
    outbox = Outbox(client, stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    task = f"store-big-{uuid.uuid4()}"
    slots = [result(task, slot) for slot in range(2500)]  # the script sets 1,000 bits per BITFIELD call
    assert outbox.publish(slots[:1700], finished=[]) == []
    repeated = outbox.publish(slots, finished=[task])
    assert repeated == [(task, slot) for slot in range(1700)]
    counts = streamed(client, {task})
    assert len(counts) == 2500 and set(counts.values()) == {1}
