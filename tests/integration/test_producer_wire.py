"""The producer against the real Redis at 127.0.0.1:6379 (db 15, flushed before and after): the message
on the wire, collecting results. The test plays the worker's part by storing results in the
backend directly, so `wait()` is exercised end to end without a worker.
"""

from __future__ import annotations

import base64
import gc
import json
import time
from collections import Counter

import pytest
from celery import states
from workers import redis_or_skip

from producer.api import Producer, QueuedMessages
from producer.backend import POLL_WINDOW
from producer.messages import idempotent_task_id
from ticketq.config import ClientSettings
from ticketq.names import RESULTS_STREAM, TASK_CLASSIFY

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/15"


@pytest.fixture
def redis_db15():
    client = redis_or_skip(REDIS_URL)  # under CI a missing Redis fails, never skips
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def decode_message(raw: bytes) -> tuple[dict, list]:
    """A kombu Redis message: a JSON envelope whose body is the base64 Celery protocol-2 body."""
    envelope = json.loads(raw)
    assert envelope["content-type"] == "application/json"
    assert envelope["properties"]["body_encoding"] == "base64"
    args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    assert kwargs == {}
    return envelope["headers"], args


# Celery's Redis backend (store_result, used here in the worker's place) still calls redis-py's setex.
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_messages_on_the_wire(redis_db15):
    before = time.time()
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        single = producer.submit("my invoice is wrong", id="s1")
        failing = producer.submit("the API times out", id="s2")
        packs = producer.submit_many([{"id": "p1", "text": "reset my password"}, "no id", "crash 💥"], pack=2)
        queue = producer.settings.queue

        assert producer.queue_depth() == redis_db15.llen(queue) == 4
        keys = [producer.app.backend.get_key_for_task(r.id) for r in (single, failing, *packs)]
        assert [count for _, count in redis_db15.pubsub_numsub(*keys)] == [0] * 4, "no subscription per message"
        messages = [decode_message(raw) for raw in redis_db15.lrange(queue, 0, -1)]
        assert {headers["task"] for headers, _ in messages} == {TASK_CLASSIFY}
        assert not any("invoice" in json.dumps(headers) for headers, _ in messages), "no ticket text in headers"
        by_task = {headers["id"]: args for headers, args in messages}
        assert set(by_task) == {single.id, failing.id, packs[0].id, packs[1].id}

        [ticket] = by_task[single.id]
        assert set(ticket) == {"id", "text", "submitted_at"}
        assert ticket["id"] == "s1" and ticket["text"] == "my invoice is wrong"
        assert before <= ticket["submitted_at"] <= time.time()
        [first_pack] = by_task[packs[0].id]
        assert [t["id"] for t in first_pack] == list(packs[0].ticket_ids)
        assert packs[0].ticket_ids[0] == "p1"
        assert [t["text"] for t in first_pack] == ["reset my password", "no id"]
        [second_pack] = by_task[packs[1].id]
        assert isinstance(second_pack, list) and second_pack[0]["text"] == "crash 💥"

        # Play the worker: one result per single message, a list per packed one; leave one unanswered.
        backend = producer.app.backend
        backend.store_result(single.id, {"id": "s1", "status": "ok", "label": "billing"}, states.SUCCESS)
        backend.mark_as_failure(failing.id, RuntimeError("model exploded"))
        pack_ids = packs[0].ticket_ids
        backend.store_result(packs[0].id, [{"id": i, "status": "ok", "label": "account"} for i in pack_ids],
                             states.SUCCESS)
        collecting = []  # the cyclic collector is paused while results come in, restored after
        results = producer.wait([single, failing, *packs], timeout=1.0,
                                on_result=lambda tickets: collecting.append(gc.isenabled()))  # fmt: skip
        assert collecting == [False, False, False] and gc.isenabled()
        gc.disable()
        try:
            producer.wait([packs[1]], timeout=0.1)
            assert not gc.isenabled(), "a caller's own gc.disable() is kept"
        finally:
            gc.enable()

        assert [(r["id"], r["status"]) for r in results] == [
            ("s1", "ok"), ("s2", "failed"), ("p1", "ok"), (pack_ids[1], "ok"), (packs[1].ticket_ids[0], "timeout"),
        ]
        assert results[1]["error"] == "model exploded"
        assert all(r["task_id"] for r in results)

        redis_db15.xadd(RESULTS_STREAM, {"data": json.dumps({"id": "s1", "label": "billing"})})
        redis_db15.xadd(RESULTS_STREAM, {"data": json.dumps({"id": "p1", "label": "account"})})
        stream = list(producer.results_stream())
        assert [r["id"] for _, r in stream] == ["s1", "p1"]
        assert list(producer.results_stream(since_id=stream[0][0])) == stream[1:]


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_wait_reads_results_behind_a_head_that_never_comes(redis_db15):
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        sent = producer.submit_many([f"ticket {i}" for i in range(3 * POLL_WINDOW)])
        for result in sent[POLL_WINDOW:]:  # the oldest POLL_WINDOW never get a result
            producer.app.backend.store_result(result.id, {"id": result.ticket_ids[0], "status": "ok"}, states.SUCCESS)
        results = producer.wait(sent, timeout=0.5)
    assert Counter(row["status"] for row in results) == {"ok": 2 * POLL_WINDOW, "timeout": POLL_WINDOW}


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_idempotent_sends_reuse_task_ids_and_skip_what_was_sent(redis_db15):
    tickets = [{"id": "k1", "text": "my invoice is wrong"}, {"id": "k2", "text": "reset my password"}, "no id"]
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        queue = producer.settings.queue
        plain = [producer.submit("the same ticket", id="k0") for _ in range(2)]
        assert plain[0].id != plain[1].id, "submit is not idempotent unless asked"
        once = producer.submit("the same ticket", id="k0", idempotent=True)
        assert once.id == idempotent_task_id(queue, ["k0"], False)
        redis_db15.flushdb()

        first = producer.submit_many(tickets[:2], pack=2, idempotent=True)
        [(headers, args)] = [decode_message(raw) for raw in redis_db15.lrange(queue, 0, -1)]
        assert first[0].id == headers["id"] == idempotent_task_id(queue, ["k1", "k2"], True)
        sent_at = [ticket.pop("submitted_at") for ticket in args[0]]  # the send time: the worker compares without it
        assert all(isinstance(at, float) for at in sent_at)
        assert args == [[{"id": "k1", "text": tickets[0]["text"]}, {"id": "k2", "text": tickets[1]["text"]}]]
        assert idempotent_task_id(queue, ["k1"], False) != idempotent_task_id("other", ["k1"], False)

        producer.app.backend.store_result(first[0].id, [{"id": "k1", "status": "ok"}, {"id": "k2", "status": "ok"}],
                                          states.SUCCESS)  # fmt: skip
        again = producer.submit_many(tickets, pack=2, idempotent=True)
        assert [r.sent_before for r in again] == [True, False] and again[0].id == first[0].id
        assert redis_db15.llen(queue) == 2, "the answered message is not sent again"
        assert [row["status"] for row in producer.wait(again[:1], timeout=1)] == ["ok", "ok"]

        k3 = [{"id": "k3", "text": "the export button does nothing"}]
        [pending] = producer.submit_many(k3, idempotent=True)
        assert redis_db15.llen(queue) == 3
        [resumed] = producer.submit_many(k3, idempotent=True, already_sent=[pending.id])
        assert resumed.sent_before and resumed.id == pending.id and redis_db15.llen(queue) == 3
        # a ticket without an id gets a random one: sent again, it is another ticket
        assert producer.submit_many(tickets[2:], idempotent=True)[0].id != again[1].id


def _comparable(raw: bytes) -> tuple[dict, list]:
    """A queued message less what differs between two sends of it: the delivery tag, the send time, and
    the copy of `argsrepr` Celery's `send_task` also leaves among the properties."""
    envelope = json.loads(raw)
    envelope["properties"].pop("delivery_tag")
    envelope["properties"].pop("argsrepr", None)
    body = json.loads(base64.b64decode(envelope.pop("body")))
    for ticket in body[0][0] if isinstance(body[0][0], list) else [body[0][0]]:
        assert isinstance(ticket.pop("submitted_at"), float)
    return envelope, body


@pytest.mark.parametrize("packed", [True, False])
def test_queued_messages_encode_what_kombu_pushes(redis_db15, packed):
    """`QueuedMessages` (the gateway pushes its messages in its own script) writes what kombu's Redis
    transport writes for the same task, field for field: a kombu or Celery that changes it fails here."""
    tickets = [("q1", "my invoice is wrong", None), ("q2", "crash 💥", "triage")][: 2 if packed else 1]
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        [sent] = producer.submit_many([{"id": i, "text": t, "schema": s} for i, t, s in tickets],
                                      pack=2 if packed else 1, idempotent=True)  # fmt: skip
        queue = producer.settings.queue
        kombus = redis_db15.lpop(queue)
        ours = QueuedMessages(producer.app, queue).encode(sent.id, tickets, packed)
        assert _comparable(ours) == _comparable(kombus)
        assert json.loads(ours)["properties"]["delivery_tag"] != json.loads(kombus)["properties"]["delivery_tag"]
