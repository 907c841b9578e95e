"""ticketq-deliver across a Redis data loss: a ticket answered before the loss and re-sent after it
is streamed again in the new epoch (publish-once marks went with the data); the dispatcher that
delivered it before does not deliver it again (`ticketq.epoch.AcrossEpochs`, the producer's rule),
and `ticketq-deliver dead --redeliver` does not POST one ticket's dead letters of two epochs twice.
A real null-classifier worker, a private redis-server without persistence restarted empty, the
real dispatcher process and an HTTP receiver (test_deliver's)."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
import redis
from test_deliver import dispatching, receiving
from workers import running_worker, wait_for, worker_env

from gateway.keys import DELIVER_DEAD_STREAM
from producer.api import Producer
from ticketq import codec
from ticketq.config import ClientSettings
from ticketq.names import RESULTS_STREAM

pytestmark = pytest.mark.integration


@pytest.fixture
def server(volatile_redis_server):
    return volatile_redis_server


def test_a_ticket_answered_before_and_after_a_data_loss_is_delivered_once(server, tmp_path):
    """20 tickets answered and delivered; Redis restarted empty; the 20 re-sent with 5 new ones and
    answered again (25 entries of the new epoch): the running dispatcher delivers the 5 new ones,
    acks the 20 repeats unsent and counts them."""
    queue = f"epochs-{uuid.uuid4().hex[:8]}"
    env = worker_env(None, server.url, queue, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_LEASE_S="4")
    settings = ClientSettings(broker_url=server.url, queue=queue)
    tickets = [{"id": f"across-{n}", "text": f"refund {n} please"} for n in range(20)]
    fresh = [{"id": f"fresh-{n}", "text": f"my card {n} was charged twice"} for n in range(5)]
    with running_worker(env, tmp_path / "worker.log"), receiving() as receiver, \
            dispatching(tmp_path, server.url, queue, receiver.url, "epochs") as dispatcher:  # fmt: skip
        with Producer(settings) as producer:
            producer.wait(producer.submit_many(tickets, idempotent=True), timeout=60)
        wait_for(lambda: len(receiver.bodies) == len(tickets), 60, "the first epoch delivered")

        server.kill()
        server.start()  # no persistence: it comes back empty
        with Producer(settings) as producer:
            again = producer.wait(producer.submit_many(tickets + fresh, idempotent=True), timeout=120, resend_after=5)
        assert [row["status"] for row in again] == ["ok"] * 25
        assert server.client().xlen(RESULTS_STREAM) == 25, "the repeats are in the new epoch's stream"
        wait_for(lambda: dispatcher.metric("ticketq_deliver_repeats_total") == len(tickets), 60, "the repeats acked")
        wait_for(lambda: len(receiver.bodies) == len(tickets) + len(fresh), 60, "the new tickets delivered")
        wait_for(lambda: dispatcher.metric("ticketq_deliver_lag_results") == 0, 30, "the new epoch read whole")
        assert server.client().xpending(RESULTS_STREAM, "epochs")["pending"] == 0
    delivered = Counter(body["result"]["id"] for body in receiver.bodies.values())
    assert delivered == Counter(ticket["id"] for ticket in tickets + fresh), "each ticket delivered once"
    assert sum(receiver.seen.values()) == 25


def test_dead_letters_of_one_ticket_in_two_epochs_are_redelivered_once(server, tmp_path):
    """The dead letters of `t1` from epochs A and B, and of `t2` from B: `dead --redeliver` POSTs
    t1's first and t2's, and deletes t1's repeat unsent."""
    client = redis.Redis.from_url(server.url)
    letters = [("1-1", "t1", b"A"), ("2-1", "t1", b"B"), ("2-2", "t2", b"B")]
    for entry_id, ticket, epoch in letters:
        data = codec.dumps({"task_id": f"task-{ticket}", "id": ticket, "status": "ok"})
        client.xadd(DELIVER_DEAD_STREAM, {"entry_id": entry_id, "data": data, "url": "http://gone/", "error": "500",
                                          "attempts": 2, "epoch": epoch})  # fmt: skip
    with receiving() as receiver, dispatching(tmp_path, server.url, "q", receiver.url, "dead") as dispatcher:
        done = dispatcher.command("dead", "--redeliver")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("2 delivered, 0 failed, 1 repeat(s) of an earlier epoch deleted"), done.stdout
    assert sorted(receiver.seen) == ["1-1", "2-2"]
    assert client.xlen(DELIVER_DEAD_STREAM) == 0
