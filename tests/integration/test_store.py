"""The Outbox's publish-once script against the real Redis: each (task, slot) result is streamed once."""

from __future__ import annotations

import base64
import json
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from workers import redis_or_skip

from ticketq.dead_letters import DEAD_LETTER_MIN_BYTES, dead_letter_bound, raw_entry, ticket_entry
from ticketq.names import ATTEMPTS_KEY, RESULTS_STREAM, REVIEW_STREAM
from ticketq.publishing import payload_digest
from worker.health import Health
from worker.redis.keys import DIGEST_KEY, DONE_KEY
from worker.redis.outbox import Outbox
from worker.redis.requeue import keep_failure

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/6"  # a database of its own: its stream entries are not ticket results


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    client = redis_or_skip(REDIS_URL)
    yield client
    client.delete(RESULTS_STREAM, REVIEW_STREAM)
    client.close()


def streamed(client: redis.Redis, task_ids: set[str], stream: str = RESULTS_STREAM) -> Counter:
    """(task, slot) -> times it is in the results stream (or `stream`)."""
    counts = Counter()
    for _, fields in client.xrange(stream):
        result = json.loads(fields[b"data"])
        if isinstance(result, dict) and result.get("task") in task_ids:
            counts[result["task"], result["slot"]] += 1
    return counts


def result(task_id: str, slot: int) -> tuple[str, int, bytes]:
    return task_id, slot, json.dumps({"task": task_id, "slot": slot}).encode()


def test_each_result_is_streamed_once_and_repeats_are_named(client: redis.Redis) -> None:
    outbox = Outbox(client, Health(), stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    a, b = f"store-a-{uuid.uuid4()}", f"store-b-{uuid.uuid4()}"
    client.set(ATTEMPTS_KEY.format(task_id=a), 1)
    client.set(ATTEMPTS_KEY.format(task_id=b), 1)

    # slots of two messages interleaved, as a length-sorted forward batch mixes them
    assert outbox.publish([result(a, 2), result(b, 0), result(a, 0)], finished=[b]) == ([], [])
    assert not client.exists(ATTEMPTS_KEY.format(task_id=b)) and client.exists(ATTEMPTS_KEY.format(task_id=a))
    assert 0 < client.ttl(DONE_KEY.format(task_id=a)) <= 600

    # a re-execution publishes only what was not out yet, and says which were
    repeated, conflicts = outbox.publish([result(a, 0), result(a, 1), result(b, 0), result(a, 2)], finished=[a])
    assert conflicts == []
    assert sorted(repeated) == sorted([(a, 0), (b, 0), (a, 2)])
    assert not client.exists(ATTEMPTS_KEY.format(task_id=a))
    assert streamed(client, {a, b}) == Counter({(a, 0): 1, (a, 1): 1, (a, 2): 1, (b, 0): 1})


def outcome(task_id: str, status: str, reason: str = "") -> tuple[str, int, bytes]:
    return task_id, 0, json.dumps({"task": task_id, "slot": 0, "status": status, "reason": reason or None}).encode()


def test_a_failure_kept_by_a_requeue_is_not_streamed_again_but_its_answer_is(client: redis.Redis) -> None:
    outbox = Outbox(client, Health(), stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    fixed, other, alone = (f"store-{name}-{uuid.uuid4()}" for name in ("fixed", "other", "alone"))
    for task_id in (fixed, other):
        assert outbox.publish([outcome(task_id, "failed", "oversize")], finished=[task_id]).repeats == []
        keep_failure(client, task_id, 0, "oversize", 600)  # the requeue, before re-sending
        again = outbox.publish([outcome(task_id, "failed", "oversize")], finished=[task_id])
        assert again.repeats == [(task_id, 0)], "the same failure, cause not fixed: not streamed twice"

    assert outbox.publish([outcome(fixed, "ok")], finished=[fixed]).repeats == [], "its answer is streamed"
    assert outbox.publish([outcome(fixed, "ok")], finished=[fixed]).repeats == [(fixed, 0)], "once"
    assert outbox.publish([outcome(fixed, "failed", "oversize")], finished=[fixed]).repeats == [(fixed, 0)]
    assert outbox.publish([outcome(other, "failed", "engine_error")], finished=[other]).repeats == [], "a new cause"
    assert outbox.publish([outcome(other, "failed", "engine_error")], finished=[other]).repeats == [(other, 0)]
    assert 0 < client.ttl(f"ticketq:failed:{fixed}") <= 600 or not client.exists(f"ticketq:failed:{fixed}")

    # a ticket of a pack re-sent alone under <task>:<slot>: its failure was streamed under the pack's id
    keep_failure(client, alone, 0, "unknown_schema", 600)
    assert outbox.publish([outcome(alone, "failed", "unknown_schema")], finished=[alone]).repeats == [(alone, 0)]
    assert outbox.publish([outcome(alone, "ok")], finished=[alone]).repeats == []
    assert streamed(client, {fixed, other, alone}) == Counter({(fixed, 0): 2, (other, 0): 2, (alone, 0): 1})


def test_results_to_review_are_copied_once_with_their_first_publication(client: redis.Redis) -> None:
    outbox = Outbox(client, Health(), stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    a, b, c = (f"store-review-{n}-{uuid.uuid4()}" for n in "abc")
    review = {(a, 1): "text of a1", (b, 0): "text of b0"}
    assert outbox.publish([result(a, 0), result(a, 1), result(b, 0), result(c, 0)], [a, b, c], review) == ([], [])
    assert streamed(client, {a, b, c}, REVIEW_STREAM) == Counter({(a, 1): 1, (b, 0): 1})
    # a re-execution (the same results again, flagged again) copies nothing more; a new one is copied
    again = {(a, 1): "text of a1", (b, 0): "text of b0", (a, 2): "text of a2"}
    repeated, _ = outbox.publish([result(a, 1), result(b, 0), result(a, 2)], [a, b], again)
    assert sorted(repeated) == sorted([(a, 1), (b, 0)])
    assert streamed(client, {a, b, c}, REVIEW_STREAM) == Counter({(a, 1): 1, (b, 0): 1, (a, 2): 1})
    # each copy carries its ticket's text beside the result (a reviewer reads it)
    texts = {fields[b"text"].decode() for _, fields in client.xrange(REVIEW_STREAM) if a.encode() in fields[b"data"]}
    assert texts == {"text of a1", "text of a2"}
    assert streamed(client, {a, b, c}) == Counter({(a, 0): 1, (a, 1): 1, (a, 2): 1, (b, 0): 1, (c, 0): 1})


def test_a_large_message_spans_several_bitfield_calls(client: redis.Redis) -> None:
    outbox = Outbox(client, Health(), stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    task = f"store-big-{uuid.uuid4()}"
    slots = [result(task, slot) for slot in range(2500)]  # the script sets 1,000 bits per BITFIELD call
    assert outbox.publish(slots[:1700], finished=[]) == ([], [])
    repeated, _ = outbox.publish(slots, finished=[task])
    assert repeated == [(task, slot) for slot in range(1700)]
    counts = streamed(client, {task})
    assert len(counts) == 2500 and set(counts.values()) == {1}


def test_another_payload_under_a_used_task_id_is_a_conflict_not_a_repeat(client: redis.Redis) -> None:
    outbox = Outbox(client, Health(), stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    task, other = f"store-reused-{uuid.uuid4()}", f"store-other-{uuid.uuid4()}"
    first, second = payload_digest([{"text": "first"}]), payload_digest([{"text": "second"}])
    assert first != second and first == payload_digest(({"text": "first"},))  # tuple or list: the same JSON
    assert outbox.publish([(*result(task, 0), first)], finished=[task]) == ([], [])
    assert client.get(DIGEST_KEY.format(task_id=task)).decode() == first
    assert 0 < client.ttl(DIGEST_KEY.format(task_id=task)) <= 600

    # the same message again: a repeat; another payload under that id: a conflict, nothing written
    assert outbox.publish([(*result(task, 0), first)], finished=[]) == ([(task, 0)], [])
    published = outbox.publish([(*result(task, 0), second), (*result(task, 1), second), (*result(other, 0), second)],
                               finished=[])  # fmt: skip
    assert published == ([], [(task, 0), (task, 1)])
    assert client.bitcount(DONE_KEY.format(task_id=task)) == 1, "the reused id's marks are untouched"
    assert streamed(client, {task, other}) == Counter({(task, 0): 1, (other, 0): 1})

    # results published before digests existed (no digest key) are checked by the marks alone
    legacy = f"store-legacy-{uuid.uuid4()}"
    assert outbox.publish([result(legacy, 0)], finished=[]) == ([], [])
    assert not client.exists(DIGEST_KEY.format(task_id=legacy))
    assert outbox.publish([(*result(legacy, 0), second)], finished=[]) == ([(legacy, 0)], [])


def test_dead_letters_keep_an_oversize_ticket_whole_and_flag_a_cut() -> None:
    text = "\u00e9\x01" * 70_000 + "\udce9"  # escapes to far more than 65,536 characters; a lone surrogate
    ticket = {"id": "big", "text": text, "submitted_at": 1.5}
    limit = dead_letter_bound(65536)
    entry = ticket_entry("t", 0, "oversize", "oversize: too big", ticket, "w", limit)
    assert len(entry["payload"]) > 65536 and entry["truncated"] == "false"
    assert json.loads(entry["payload"]) == ticket, "exactly the ticket that came, lone surrogate included"
    cut = ticket_entry("t", 0, "oversize", "oversize: too big", ticket, "w", 1000)
    assert len(cut["payload"]) == 1000 and cut["truncated"] == "true"
    assert dead_letter_bound(10 * 1024 * 1024) == 80 * 1024 * 1024 and limit == DEAD_LETTER_MIN_BYTES
    raw = raw_entry("decode_error", None, {"id": "t"}, "application/x-python-serialize", b"x" * (limit + 1), limit)
    assert raw["truncated"] == "true" and len(base64.b64decode(raw["payload_b64"])) == limit


def test_a_digest_ignores_the_send_time_but_not_the_tickets():
    ticket = {"id": "T-1", "text": "my card was charged twice", "submitted_at": 1.5}
    again = {**ticket, "submitted_at": 99.0}
    other = {**ticket, "text": "reset my password"}
    assert payload_digest((ticket,)) == payload_digest((again,)) != payload_digest((other,))
    assert payload_digest(([ticket, other],)) == payload_digest(([again, other],)) != payload_digest(([other, ticket],))
