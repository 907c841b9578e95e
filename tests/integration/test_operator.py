"""The operator's commands against real null-classifier workers and a private redis-server:
dead letters kept whole and re-sent exactly, kept until answered, answered tickets never re-sent,
a reused task id answered, and `ticketq status` counting only the ticket queue.

Two workers on one Redis, each on its own queue: `small` refuses tickets over 1 KiB (it writes the
oversize dead letters), `large` takes them (the operator has raised TICKETQ_MAX_TICKET_BYTES: a
requeue goes to the queue the operator's settings name).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import Celery, states
from workers import ROOT, RedisServer, Worker, close_results_app, wait_for, worker_env

from ticketq import dead_letters, names
from ticketq.contract import TicketRejected
from ticketq.names import ALIVE_KEY, CONSUMERS_KEY
from ticketq_cli.dead_letters import Answered, NotRequeueable
from ticketq_cli.ops import Ops
from worker.redis import requeue
from worker.redis.keys import DONE_KEY
from worker.settings import Settings

pytestmark = pytest.mark.integration

LARGE_MAX_BYTES = 1024 * 1024


@dataclass
class Setup:
    server: RedisServer
    small: Worker
    large: Worker
    queues: dict[str, str]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Iterator[Setup]:
    workdir = tmp_path_factory.mktemp("operator")
    server = RedisServer(workdir, aof=False).start()
    queues = {name: f"op-{name}-{uuid.uuid4().hex[:6]}" for name in ("small", "large")}
    limits = {"small": "1024", "large": str(LARGE_MAX_BYTES)}
    started: dict[str, Worker] = {}
    try:
        for name, queue in queues.items():
            env = worker_env(None, server.url, queue, TICKETQ_NULL_CLASSIFIER="1",
                             TICKETQ_MAX_TICKET_BYTES=limits[name])  # fmt: skip
            started[name] = Worker(env, workdir / f"{name}.log")
        for worker in started.values():
            worker.wait_ready(timeout=180)
        yield Setup(server, started["small"], started["large"], queues)
    finally:
        for worker in started.values():
            worker.stop(timeout=30)
        server.kill()


@pytest.fixture
def app(setup) -> Iterator[Celery]:
    app = Celery(broker=setup.server.url, backend=setup.server.url, set_as_current=False)
    yield app
    close_results_app(app)  # before the module's redis-server goes


@pytest.fixture
def ops(setup) -> Iterator[Ops]:
    ops = Ops(Settings(broker_url=setup.server.url, queue=setup.queues["large"]))
    yield ops
    ops.close()


def stream(client: redis.Redis, task_id: str) -> list[dict]:
    entries = (json.loads(fields[b"data"]) for _, fields in client.xrange(names.RESULTS_STREAM))
    return [entry for entry in entries if entry["task_id"] == task_id]


def raw_letters(client: redis.Redis, task_id: str) -> list[str]:
    """Entry ids of the dead letters of `task_id`, read from Redis directly (no operator sweep)."""
    return [raw_id.decode() for raw_id, fields in client.xrange(names.DEAD_LETTER_STREAM)
            if fields.get(b"task_id") == task_id.encode()]  # fmt: skip


def cli(args: list[str], setup: Setup) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=setup.server.url, TICKETQ_QUEUE=setup.queues["large"])
    return subprocess.run([sys.executable, "-m", "ticketq_cli.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_an_oversize_ticket_is_requeued_whole_once_the_limit_is_raised(setup, app, ops):
    client = setup.server.client()
    # ~140 KB of UTF-8 whose JSON (ASCII escapes) is far over the 65,536 characters letters used to keep
    ticket = {"id": "BIG-1", "text": "Facture en double \u00e9\u20ac\x01 " * 6000, "submitted_at": 1.25}
    app.send_task(names.TASK_CLASSIFY, args=[ticket], queue=setup.queues["small"], task_id="big-1")
    wait_for(lambda: raw_letters(client, "big-1"), 60, "the oversize dead letter")
    [letter] = ops.find_dead("big-1")
    assert letter.reason == "oversize" and not letter.truncated and letter.payload == ticket

    assert ops.requeue(letter) == "big-1"
    assert raw_letters(client, "big-1") == [letter.entry_id], "kept until the re-sent ticket is answered"
    assert requeue.requeued(client) == {letter.entry_id: "big-1"}
    assert app.AsyncResult("big-1").get(timeout=60)["status"] == "ok", "the old FAILURE made way for the answer"
    assert ops.find_dead("big-1") == [] and requeue.requeued(client) == {}, "answered: the letter is dropped"
    assert [r["status"] for r in stream(client, "big-1")] == ["failed", "ok"]

    # A worker_error letter for the answered ticket (as a worker cut off from Redis wrote before it
    # checked), its ok result overwritten by that FAILURE: requeue says so, sends and clears nothing.
    app.backend.mark_as_failure("big-1", TicketRejected("worker_error", "ConnectionError: cut off"))
    entry = dead_letters.ticket_entry("big-1", None, "worker_error", "worker_error: cut off", [ticket], "w")
    client.xadd(names.DEAD_LETTER_STREAM, entry)
    [false_letter] = ops.dead_letters("worker_error")
    with pytest.raises(Answered, match="already has a result"):
        ops.requeue(false_letter)
    assert client.bitcount(DONE_KEY.format(task_id="big-1")) == 1 and client.llen(setup.queues["large"]) == 0
    requeued = cli(["dead", "requeue", "--reason", "worker_error"], setup)
    assert requeued.returncode == 3 and "already has a result" in requeued.stderr, requeued.stderr
    assert len(stream(client, "big-1")) == 2 and client.llen(setup.queues["large"]) == 0

    # A letter written before letters kept payloads whole: its JSON cut at 65,536 characters.
    cut = {**entry, "reason": "oversize", "slot": "0", "payload": dead_letters.payload_json(ticket)[:65536]}
    cut.pop("truncated")
    client.xadd(names.DEAD_LETTER_STREAM, {**cut, "task_id": "cut-1"})
    [cut_letter] = ops.find_dead("cut-1")
    assert cut_letter.truncated
    with pytest.raises(NotRequeueable, match="cut at 65536"):
        ops.requeue(cut_letter)
    listed = cli(["dead", "list"], setup)
    assert "payload truncated: not requeueable" in listed.stdout


def test_a_reused_task_id_is_answered_and_a_redelivery_counted_apart(setup, app, ops):
    client = setup.server.client()
    queue = setup.queues["large"]
    first, second = {"id": "R-1", "text": "refund please"}, {"id": "R-2", "text": "reset my password"}
    before = setup.large.metrics()
    app.send_task(names.TASK_CLASSIFY, args=[first], queue=queue, task_id="reused-1").get(timeout=60)
    app.send_task(names.TASK_CLASSIFY, args=[second], queue=queue, task_id="reused-1")
    wait_for(lambda: raw_letters(client, "reused-1"), 60, "the duplicate_task_id dead letter")
    [letter] = ops.find_dead("reused-1")
    assert letter.reason == "duplicate_task_id" and letter.payload == second
    assert [(r["id"], r["status"]) for r in stream(client, "reused-1")] == [("R-1", "ok"), ("R-2", "failed")]
    with pytest.raises(NotRequeueable, match="new id"):
        ops.requeue(letter)

    app.send_task(names.TASK_CLASSIFY, args=[first], queue=queue, task_id="reused-1")  # the same message again
    duplicates = "ticketq_duplicate_results_total{}"
    wait_for(lambda: setup.large.metrics()[duplicates] > before.get(duplicates, 0), 60, "the re-execution")
    after = setup.large.metrics()
    done = {key: value - before.get(key, 0) for key, value in after.items() if key.startswith("ticketq_tickets_total")}
    assert sum(done.values()) == 2, f"each ticket counted once: {done}"
    assert after[duplicates] - before.get(duplicates, 0) == 1
    assert len(stream(client, "reused-1")) == 2
    assert app.AsyncResult("reused-1").state == states.SUCCESS


def test_status_counts_only_the_ticket_queue(setup, ops):
    """Flower and `celery inspect` make Celery consume reply and event queues through the same
    transport: their messages sit in the unacked record, their consumers hold leases."""
    client = setup.server.client()
    queue = setup.queues["large"]
    unacked = {
        "t-1": json.dumps([{"body": "x"}, queue, queue]),
        "t-2": json.dumps([{"body": "x"}, queue, queue]),
        "r-1": json.dumps([{"body": "x"}, "reply.celery.pidbox", "f00.reply.celery.pidbox"]),
        "e-1": json.dumps([{"body": "x"}, "celeryev", "worker.heartbeat"]),
        "bad": "not kombu's",
    }
    consumers = {
        "flower:1:a": {"queues": ["f00.reply.celery.pidbox"]},
        "flower:1:b": {"queues": ["celeryev.1234"]},
        "other:2:c": {"queues": ["another-queue"]},
        "gone:3:d": {"queues": [queue]},  # its lease ran out: expired
    }
    before = ops.status()
    try:
        client.hset("unacked", mapping=unacked)
        client.hset(CONSUMERS_KEY, mapping={name: json.dumps(info) for name, info in consumers.items()})
        for name in consumers:
            if name != "gone:3:d":
                client.set(ALIVE_KEY.format(consumer=name), 1, ex=60)
        state = ops.status()
        assert state["in_flight"] == before["in_flight"] + 2
        assert state["leases"] == {"alive": before["leases"]["alive"], "expired": before["leases"]["expired"] + 1}
        assert state["leases"]["alive"] >= 1, "the large worker's own consumer"
    finally:
        client.hdel("unacked", *unacked)
        client.hdel(CONSUMERS_KEY, *consumers)


def test_status_shows_the_review_stream_and_its_consumer_groups(setup, ops):
    client = setup.server.client()
    assert ops.status()["review_stream"]["entries"] == client.xlen(names.REVIEW_STREAM)
    ids = [client.xadd(names.REVIEW_STREAM, {"data": json.dumps({"id": f"r-{n}"})}) for n in range(3)]
    try:
        client.xgroup_create(names.REVIEW_STREAM, "reviewers", id="0")
        client.xreadgroup("reviewers", "alice", {names.REVIEW_STREAM: ">"}, count=1)  # one handed out, unacked
        review = ops.status()["review_stream"]
        assert review["entries"] >= 3 and review["reviewers pending"] == 1
        if "reviewers lag" in review:  # Redis >= 7
            assert review["reviewers lag"] == review["entries"] - 1
    finally:
        client.xgroup_destroy(names.REVIEW_STREAM, "reviewers")
        client.xdel(names.REVIEW_STREAM, *ids)


def test_a_requeue_whose_cause_is_not_fixed_streams_no_second_failure(setup, app):
    """The small worker still refuses the ticket: its failure is not streamed again; the letter
    stays (replaced by the new one); once sent where the limit is raised, its answer is streamed."""
    client = setup.server.client()
    ticket = {"id": "BIG-2", "text": "x" * 4096}
    app.send_task(names.TASK_CLASSIFY, args=[ticket], queue=setup.queues["small"], task_id="big-2")
    wait_for(lambda: raw_letters(client, "big-2"), 60, "the oversize dead letter")
    small = Ops(Settings(broker_url=setup.server.url, queue=setup.queues["small"]))
    try:
        [letter] = small.find_dead("big-2")
        assert small.requeue(letter) == "big-2"
        wait_for(lambda: len(raw_letters(client, "big-2")) == 2, 60, "the second refusal's dead letter")
        assert str(app.AsyncResult("big-2").get(timeout=60, propagate=False)).startswith("oversize: ")
        [again] = small.find_dead("big-2")  # the first letter is dropped: its retry is answered
        assert again.entry_id != letter.entry_id
        assert [r["status"] for r in stream(client, "big-2")] == ["failed"], "one failed entry for one cause"
    finally:
        small.close()
    result = cli(["dead", "requeue", "big-2"], setup)  # now to the large worker, which takes it
    assert result.returncode == 0, result.stderr
    wait_for(lambda: len(stream(client, "big-2")) == 2, 60, "the answer in the results stream")
    assert [r["status"] for r in stream(client, "big-2")] == ["failed", "ok"]


def test_an_unknown_schema_letter_is_requeued_and_a_ticket_that_can_never_succeed_is_not(setup, app, ops):
    client = setup.server.client()
    queue = setup.queues["large"]
    app.send_task(names.TASK_CLASSIFY, args=[{"id": "S-1", "text": "refund", "schema": "triage"}], queue=queue,
                  task_id="schema-1")  # fmt: skip
    app.send_task(names.TASK_CLASSIFY, args=[{"id": "E-1", "text": " \t "}], queue=queue, task_id="empty-1")
    wait_for(lambda: raw_letters(client, "schema-1") and raw_letters(client, "empty-1"), 60, "the dead letters")

    # Until TICKETQ_SCHEMAS serves it here the re-sent ticket fails the same way: one stream entry.
    requeued = cli(["dead", "requeue", "--reason", "unknown_schema"], setup)
    assert requeued.returncode == 0 and "as task schema-1" in requeued.stdout, requeued.stderr
    wait_for(lambda: len(raw_letters(client, "schema-1")) == 2, 60, "the re-sent ticket's refusal")
    assert [r["reason"] for r in stream(client, "schema-1")] == ["unknown_schema"]

    [empty] = ops.find_dead("empty-1")
    with pytest.raises(NotRequeueable, match="can never succeed"):
        ops.requeue(empty)
    refused = cli(["dead", "requeue", "empty-1"], setup)
    assert refused.returncode == 3 and "can never succeed as it is (empty_text" in refused.stderr, refused.stderr
    assert client.llen(queue) == 0 and len(stream(client, "empty-1")) == 1 and raw_letters(client, "empty-1")


def test_a_requeue_that_matches_nothing_says_so(setup):
    for args in (["dead", "requeue", "no-such-task"], ["dead", "requeue", "--reason", "expired"]):
        result = cli(args, setup)
        assert result.returncode == 3 and "no dead letter" in result.stderr and "Traceback" not in result.stderr, (
            args, result.stderr)  # fmt: skip
