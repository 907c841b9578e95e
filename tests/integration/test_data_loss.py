"""A Redis that came back without its data is reported: the epoch marker (`ticketq.epoch`).

Unit tier on a private redis-server (the marker is a global key: the machine's shared Redis is
left alone), then a real null-classifier worker on a private redis-server without persistence
that is restarted mid-run: one log line, `ticketq_redis_data_lost_total` 1, `ticketq status`
says LOST, and the tickets sent after the restart are answered.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
from workers import ROOT, running_worker, wait_for, worker_env

from producer.api import Producer
from ticketq import epoch, names
from ticketq.config import ClientSettings
from ticketq_cli.ops import redis_data_line
from worker.health import Health
from worker.metrics import Metrics
from worker.redis.outbox import Outbox

pytestmark = pytest.mark.integration

LOST = "Redis lost its data"


@pytest.fixture
def server(volatile_redis_server):
    return volatile_redis_server


def test_the_marker_is_adopted_then_a_vanished_or_replaced_one_is_one_loss_each(server):
    client = server.client()
    mine, other = epoch.Epoch("worker a:1"), epoch.Epoch("producer b:2")
    assert mine.check(client) is None and other.check(client) is None, "the first sight adopts"
    first = client.get(names.EPOCH_KEY)
    assert json.loads(first)["by"] == "worker a:1", "the first to find it absent set it"
    assert mine.check(client) is None and client.get(names.EPOCH_KEY) == first

    client.flushall()  # what a restart without persistence leaves
    loss = mine.check(client)
    assert loss is not None and loss.since == json.loads(first)["since"] and loss.by == "worker a:1"
    assert mine.check(client) is None, "one loss, reported once"
    assert other.check(client) is not None, "a marker replaced (set by another after the loss) is a loss too"
    assert other.check(client) is None and (mine.losses, other.losses) == (1, 1)

    described = epoch.describe(client)
    assert described["lost"]["by"] == "worker a:1", "the first to notice records it"
    assert client.ttl(names.DATA_LOST_KEY) > 0
    assert redis_data_line(described).startswith("LOST: Redis came back without its data")
    client.flushall()
    assert redis_data_line(epoch.describe(client)).startswith("no epoch marker yet")
    fresh = epoch.Epoch("worker c:3")
    fresh.check(client)
    assert redis_data_line(epoch.describe(client)).startswith("kept since ")


def test_the_outbox_checks_with_each_job_and_logs_and_counts_a_loss_once(server, caplog):
    client = server.client()
    health = Health()  # the worker's: its outbox notices, its metrics count
    outbox = Outbox(client, health, stream_maxlen=1000, result_expires_s=3600, worst_batch_s=5)
    metrics = Metrics(health=health)
    before = metrics.registry.get_sample_value("ticketq_redis_data_lost_total")
    with caplog.at_level(logging.INFO, logger="worker.health.data_loss"):
        assert outbox.attempts(["t-1"]) == [None]
        assert outbox.attempts(["t-1"]) == [None]
        client.flushall()
        for _ in range(3):
            assert outbox.attempts(["t-1"]) == [None]
    assert metrics.registry.get_sample_value("ticketq_redis_data_lost_total") == before + 1
    lines = [record.getMessage() for record in caplog.records if LOST in record.getMessage()]
    assert len(lines) == 1 and "answered once their producers send them again" in lines[0], lines


def ticketq(args: list[str], url: str, queue: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=url, TICKETQ_QUEUE=queue)
    return subprocess.run([sys.executable, "-m", "ticketq_cli.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_a_redis_restarted_without_its_data_is_reported_in_the_log_metrics_and_status(server, tmp_path):
    queue = f"loss-{uuid.uuid4().hex[:8]}"
    env = worker_env(None, server.url, queue, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_LEASE_S="4")
    settings = ClientSettings(broker_url=server.url, queue=queue)
    with running_worker(env, tmp_path / "worker.log") as worker:
        with Producer(settings) as producer:
            before = producer.wait(producer.submit_many([f"before {n}: refund please" for n in range(20)]), timeout=60)
        assert [r["status"] for r in before] == ["ok"] * 20
        assert LOST not in worker.log()

        server.kill()
        server.start()  # no persistence: it comes back empty
        with Producer(settings) as producer:
            sent = producer.submit_many([f"after {n}: my card was charged twice" for n in range(20)])
            after = producer.wait(sent, timeout=120, resend_after=5)
        assert [r["status"] for r in after] == ["ok"] * 20, "every ticket sent after the restart is answered"
        worker.wait_log(LOST, 30, "the worker reporting the lost data")
        lost = wait_for(lambda: worker.metrics().get("ticketq_redis_data_lost_total{}"), 30, "the metric")
        status = ticketq(["status"], server.url, queue)
        log = worker.log()

    assert lost == 1
    assert status.returncode == 0, status.stdout + status.stderr  # a worker answered: 4 only without one
    assert log.count(LOST) == 1, log[-4000:]
    line = [row for row in status.stdout.splitlines() if row.startswith("redis data:")]
    assert line and line[0].startswith("redis data: LOST: Redis came back without its data"), status.stdout
    assert "by worker " in line[0], line[0]


def test_a_reader_across_the_loss_sees_each_ticket_once(server, tmp_path):
    """Tickets answered, read from the stream, Redis restarted empty, the same tickets sent again
    (idempotent: the marks that would have refused them went with the data) and answered again:
    the stream holds them twice, each entry with its epoch, and the reader that read the first
    epoch yields only the new tickets from the second; a reader that never saw the first yields all."""
    queue = f"across-{uuid.uuid4().hex[:8]}"
    env = worker_env(None, server.url, queue, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_LEASE_S="4")
    settings = ClientSettings(broker_url=server.url, queue=queue)
    tickets = [{"id": f"across-{n}", "text": f"refund {n} please"} for n in range(20)]
    fresh = [{"id": f"fresh-{n}", "text": f"my card {n} was charged twice"} for n in range(5)]
    with running_worker(env, tmp_path / "worker.log"), Producer(settings) as reader:
        with Producer(settings) as producer:
            producer.wait(producer.submit_many(tickets, idempotent=True), timeout=60)
        first = list(reader.results_stream())
        assert sorted(r["id"] for _, r in first) == sorted(t["id"] for t in tickets)
        before = {fields.get(b"epoch") for _, fields in server.client().xrange(names.RESULTS_STREAM)}

        server.kill()
        server.start()  # no persistence: it comes back empty
        with Producer(settings) as producer:
            again = producer.wait(producer.submit_many(tickets + fresh, idempotent=True), timeout=120, resend_after=5)
        assert [r["status"] for r in again] == ["ok"] * 25

        raw = server.client().xrange(names.RESULTS_STREAM)
        epochs = {fields.get(b"epoch") for _, fields in raw}
        assert len(raw) == 25 and len(epochs) == 1 and None not in epochs, "every entry carries its epoch"
        assert len(before) == 1 and None not in before and before != epochs, "another epoch after the loss"
        later = list(reader.results_stream(since_id=first[-1][0]))
        assert sorted(r["id"] for _, r in later) == sorted(t["id"] for t in fresh), "answered in both: once"
        with Producer(settings) as newcomer:
            assert len(list(newcomer.results_stream())) == 25, "a reader that never saw the first epoch sees all"
