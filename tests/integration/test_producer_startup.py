"""`ticketq-produce` started in a storm (issue 44 item 5): the only Redis down when it starts, a
Redis loading its data, a Redis that never comes back, Ctrl-C while it waits for Redis, replicas
that do not confirm the send, a Redis that loses its data between the producer's start and its
first wait, and a Sentinel primary that is down when it starts.

`--retry-for` covers the first connection too: the producer says once that Redis is not reachable
and asks again; every exit writes a row for every ticket to `--out`. Each test starts its own
redis-server(s) and null-classifier workers (TICKETQ_NULL_CLASSIFIER=1), and synchronises on
output lines, keys and process exits, never on sleeps.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import threading
import time

import pytest
import redis
from servers import MASTER_NAME, require_redis_server, sentinel_set
from test_producer_outages import QUEUE, Produce, rows, statuses, ticket_file
from test_producer_resends import assert_loss_said_once_and_answered_once, start_worker
from workers import RedisServer, running_worker, wait_for, worker_env

from producer.api import Producer
from producer.errors import BrokerUnavailable
from producer.outage import is_lost_connection
from ticketq import names
from ticketq.config import ClientSettings

pytestmark = pytest.mark.integration

WAITING = "Redis not reachable while connecting"  # the producer's one line while it waits for Redis


@pytest.fixture
def down_server(tmp_path):
    """A private Redis (AOF) that is not started yet: its port is free, nothing listens there."""
    workdir = tmp_path / "redis-down"
    workdir.mkdir()
    server = RedisServer(workdir, aof=True)
    yield server
    server.kill()


def test_a_producer_started_while_redis_is_down_waits_and_every_ticket_is_answered(tmp_path, down_server):
    """Before: exit 2 at once (Error 111), no --out. Now: one line saying it waits, then every
    ticket sent and answered once Redis is up, exit 0."""
    n = 300
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, down_server, "file", str(tickets), "--out", str(out), "--retry-for", "120",
                      "--timeout", "180")  # fmt: skip
    produce.wait_output(WAITING, 60)
    down_server.start()
    up = time.monotonic()
    worker = start_worker(down_server, tmp_path, "worker")
    try:
        status = produce.finish(180)
    finally:
        worker.stop(timeout=30)
    print(f"\n[started while Redis was down] exit {status} {time.monotonic() - up:.1f} s after Redis came up "
          f"(worker start-up included); {statuses(out)}")  # fmt: skip
    assert status == 0, produce.stdout + produce.stderr
    assert statuses(out) == {"ok": n}
    assert produce.stderr.count(WAITING) == 1, produce.stderr
    assert "Redis is back" in produce.stderr and "error:" not in produce.stderr
    assert down_server.client().xlen(names.RESULTS_STREAM) == n


def test_a_redis_that_never_comes_back_exits_2_with_a_row_for_every_ticket(tmp_path, down_server):
    """Past --retry-for: one error line, an `unsent` row for every ticket (`--resume` sends them), exit 2."""
    n = 50
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    started = time.monotonic()
    produce = Produce(tmp_path, down_server, "file", str(tickets), "--out", str(out), "--retry-for", "1")
    status = produce.finish(120)
    print(f"\n[Redis never up, --retry-for 1] exit {status} after {time.monotonic() - started:.1f} s (Python start-up "
          f"included); {statuses(out)}")  # fmt: skip
    assert status == 2, produce.stdout + produce.stderr
    assert [row["id"] for row in rows(out)] == [f"T-{i}" for i in range(n)]
    assert statuses(out) == {"unsent": n}
    assert all("Redis not reachable for 1 s" in row["error"] for row in rows(out))
    errors = [line for line in produce.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: Redis is not reachable"), produce.stderr
    assert produce.stderr.count(WAITING) == 1
    assert f"Redis not reachable for 1 s: 0 of {n} tickets sent, {n} not sent; every row is in {out}" in produce.stderr


def test_refused_credentials_are_not_waited_for_and_write_a_row_for_every_ticket(tmp_path):
    """Asking again cannot help: exit 2 at once (no waiting line), with an `unsent` row for every ticket."""
    workdir = tmp_path / "redis-pw"
    workdir.mkdir()
    server = RedisServer(workdir, password="right", aof=False).start()
    try:
        wrong = RedisServer(workdir, port=server.port, password="wrong")  # its url only
        tickets, out = ticket_file(tmp_path / "t.jsonl", 10), tmp_path / "r.jsonl"
        produce = Produce(tmp_path, wrong, "file", str(tickets), "--out", str(out), "--retry-for", "300")
        assert produce.finish(120) == 2, produce.stdout + produce.stderr
    finally:
        server.kill()
    assert statuses(out) == {"unsent": 10}
    assert WAITING not in produce.stderr and "refused the credentials" in produce.stderr
    assert "Redis refused the credentials: 0 of 10 tickets sent, 10 not sent" in produce.stderr


def test_ctrl_c_while_waiting_for_redis_writes_a_row_for_every_ticket(tmp_path, down_server):
    n = 50
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, down_server, "file", str(tickets), "--out", str(out), "--retry-for", "300")
    produce.wait_output(WAITING, 60)
    produce.proc.send_signal(signal.SIGINT)
    assert produce.finish(60) == 130, produce.stdout + produce.stderr
    assert statuses(out) == {"unsent": n}
    assert "interrupted while connecting to Redis: 0 of 50 tickets sent, 50 not sent" in produce.stderr


def test_replicas_that_do_not_confirm_the_send_exit_2_with_a_pending_row_for_every_ticket(tmp_path, redis_server):
    """TICKETQ_REPLICA_ACKS=1 on a Redis without a replica: Redis took every ticket, none is
    confirmed: the error line, a `pending` row for each (`--resume` waits for them), exit 2."""
    n = 20
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out),
                      env={"TICKETQ_REPLICA_ACKS": "1", "TICKETQ_REPLICA_TIMEOUT_S": "0.5"})  # fmt: skip
    assert produce.finish(120) == 2, produce.stdout + produce.stderr
    assert statuses(out) == {"pending": n}
    assert redis_server.client().llen(QUEUE) == n
    assert f"replicas did not confirm the send: {n} of {n} tickets sent, 0 not sent" in produce.stderr


def test_a_data_loss_before_the_first_wait_is_seen_and_its_messages_are_resent_at_once(
        tmp_path, redis_server, caplog):  # fmt: skip
    """The marker is read before the first send: Redis losing its data (a FLUSHALL, as a restart
    without persistence leaves it) after the send and before the wait is one loss, said once, and
    every message is re-sent at the first tick instead of after `resend_after` (600 s, far past the
    test's timeout: only the loss can make them due)."""
    n = 100
    client = redis_server.client()
    caplog.set_level(logging.WARNING, logger="producer.waiting")
    box: dict = {}
    worker = None
    with Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE)) as producer:
        try:
            sent = producer.submit_many([{"id": f"L-{i}", "text": f"ticket {i}"} for i in range(n)])
            assert client.get(names.EPOCH_KEY) is not None, "the marker is read (and set) before the first send"
            client.flushall()
            worker = start_worker(redis_server, tmp_path, "after-loss")
            waiter = threading.Thread(target=lambda: box.update(results=producer.wait(sent, timeout=240,
                                                                                      resend_after=600)))
            waiter.start()
            waiter.join(timeout=300)
        finally:
            if worker is not None:
                worker.stop(timeout=30)
    assert_loss_said_once_and_answered_once(caplog, client, box["results"], n)


def test_a_producer_started_while_the_sentinel_primary_is_down_is_answered_after_the_promotion(tmp_path):
    """The primary killed before the producer starts: the sentinels name the dead master (Error
    111) until they promote the replica. The producer says once that it waits, then sends, and
    every ticket is answered once by a worker on the new primary: exit 0."""
    require_redis_server()
    n = 200
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    with sentinel_set(tmp_path / "redis") as servers:
        old_port = servers.kill_primary()
        produce = Produce(tmp_path, servers, "file", str(tickets), "--out", str(out), "--retry-for", "120",
                          "--timeout", "180", env={"TICKETQ_SENTINEL_MASTER": MASTER_NAME})  # fmt: skip
        produce.wait_output(WAITING, 60)
        servers.wait_promoted(old_port, timeout=60)
        promoted = time.monotonic()
        env = worker_env(None, servers.url, QUEUE, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_SENTINEL_MASTER=MASTER_NAME)
        with running_worker(env, tmp_path / "worker.log"):
            status = produce.finish(180)
    print(f"\n[started while the Sentinel primary was down] exit {status} {time.monotonic() - promoted:.1f} s after "
          f"the promotion (worker start-up included); {statuses(out)}")  # fmt: skip
    assert status == 0, produce.stdout + produce.stderr
    assert statuses(out) == {"ok": n}
    assert produce.stderr.count(WAITING) == 1, produce.stderr


def test_a_producer_started_while_redis_loads_its_data_waits_and_every_ticket_is_answered(tmp_path, down_server):
    """Redis answering `LOADING Redis is loading the dataset in memory` (20,000 keys, each loaded
    5 ms late: `key-load-delay`, so the load outlasts the producer's start on any machine): the
    producer says it waits, naming the load; the test then ends the load (a restart without the
    delay) and every ticket is answered, exit 0."""
    n = 100
    down_server.aof = False
    down_server.start()
    pipe = down_server.client().pipeline(transaction=False)
    for i in range(20_000):
        pipe.set(f"ballast:{i}", "x")
    pipe.execute()
    down_server.client().save()
    down_server.kill()
    args = ["redis-server", "--port", str(down_server.port), "--bind", "127.0.0.1", "--dir", str(down_server.workdir),
            "--save", "", "--appendonly", "no", "--key-load-delay", "5000",
            "--loading-process-events-interval-bytes", "1024"]  # fmt: skip
    down_server.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: _loading(down_server), 30, "Redis answering LOADING", interval=0.02)
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, down_server, "file", str(tickets), "--out", str(out), "--retry-for", "120",
                      "--timeout", "180")  # fmt: skip
    produce.wait_output(WAITING, 60)
    assert "loading the dataset" in produce.stderr, produce.stderr
    down_server.kill()
    down_server.start()  # the same dump, loaded at full speed
    worker = start_worker(down_server, tmp_path, "worker")
    try:
        status = produce.finish(180)
    finally:
        worker.stop(timeout=30)
    assert status == 0, produce.stdout + produce.stderr
    assert statuses(out) == {"ok": n}
    assert produce.stderr.count(WAITING) == 1, produce.stderr


def _loading(server: RedisServer) -> bool:
    try:
        server.client().ping()
    except redis.exceptions.BusyLoadingError:
        return True
    except redis.exceptions.ConnectionError:
        return False  # not listening yet
    return False


def test_producer_waits_for_a_redis_loading_its_data_as_for_one_that_is_down():
    """`LOADING Redis is loading the dataset in memory` is redis-py's BusyLoadingError, a
    ConnectionError: a lost connection to ride out, not a refusal."""
    loading = redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory")
    assert is_lost_connection(BrokerUnavailable("redis://127.0.0.1:6379/0", loading))
