"""Re-sends with a budget (producer/resends.py): the FIFO rule, the backoff and the budget on plain
data; then, for real (private redis-servers, null-classifier workers), a backlog that is re-sent
nothing, a lost message re-sent within the stated bound, and `--resume` after Redis lost its queue.

The integration tests synchronise on events (results, queue contents, process exits); the only
clock they read is to print figures and to check the stated bound with a wide margin.
Figures are printed: `pytest -s`.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
import time
from collections import Counter

import pytest
import redis
from faults import DELAY_ENV
from test_producer_outages import QUEUE, Produce, rows, statuses, ticket_file
from workers import Worker, free_port, wait_for, worker_command, worker_env

from producer import resends
from producer.api import Producer
from producer.resends import RESEND_FLOOR, RESEND_GROWTH, Resends, Whereabouts, task_id_of
from ticketq import names
from ticketq.config import ClientSettings

pytestmark = pytest.mark.integration


def message(task_id: str) -> bytes:
    """A queue item as kombu writes it (only what `task_id_of` reads)."""
    return json.dumps({"body": "e30=", "headers": {"id": task_id, "root_id": task_id}, "properties": {}}).encode()


# --------------------------------------------------------------------------------------------
# the rule, the backoff and the budget (no Redis)


def test_task_ids_are_read_from_queue_items_and_unacked_records_and_nothing_else():
    assert task_id_of(message("t-1")) == "t-1"
    assert task_id_of(json.dumps([json.loads(message("t-2")), "", "q"]).encode(), in_record=True) == "t-2"
    for junk in (b"not json", b"[]", b'{"headers": {}}', b'{"headers": {"id": 7}}', b"\xff"):
        assert task_id_of(junk) is None and task_id_of(junk, in_record=True) is None


def test_out_of_the_queue_only_when_a_later_send_is_nearer_its_end_or_the_whole_queue_was_read():
    sends = {"a": 0, "b": 1, "c": 2, "d": 3}
    # The queue's consuming end holds c (and a foreign message); the queue is longer than the scan.
    where = Whereabouts.of(length=5000, scanned=[message("foreign"), message("c")], unacked=[],
                           fetching=[message("b")], sends=sends)  # fmt: skip
    assert not where.whole_queue and where.newest_scanned == 2
    assert where.lost("a", 0), "sent before c, which reached the consuming end: a has left the queue"
    assert not where.lost("b", 1), "fetched by a worker"
    assert not where.lost("c", 2), "queued"
    assert not where.lost("d", 3), "sent after c: may be queued behind the scanned end"
    # Nothing of ours in the scanned end of a long queue: nothing can be said.
    blind = Whereabouts.of(length=5000, scanned=[message("foreign")], unacked=[], fetching=[], sends=sends)
    assert not any(blind.lost(task_id, send) for task_id, send in sends.items())
    # The whole queue read: whatever is nowhere is lost.
    record = json.dumps([json.loads(message("a")), "", QUEUE]).encode()
    whole = Whereabouts.of(length=1, scanned=[message("d")], unacked=[record], fetching=[], sends=sends)
    assert [task_id for task_id, send in sends.items() if whole.lost(task_id, send)] == ["b", "c"]


def test_backoff_doubles_with_jitter_up_to_its_cap_and_an_earlier_runs_message_is_due_at_once():
    plan = Resends([("new", 5), ("old", None)], resend_after=2.0, now=100.0, rng=random.Random(1))
    assert plan.due(100.0) == ["old"] and plan.due(102.0) == ["old", "new"]  # oldest send first
    due_at, now = [], 102.0
    for send in range(6, 16):
        plan.resent("new", send, now)
        due_at.append(plan.tracked["new"].due - now)
        now = plan.tracked["new"].due
    for k, pause in enumerate(due_at, 1):
        nominal = min(resends.BACKOFF_CAP_S, 2.0 * 2**k)
        assert nominal * (1 - resends.JITTER) <= pause <= nominal * (1 + resends.JITTER)
    assert max(due_at) <= resends.BACKOFF_CAP_S * (1 + resends.JITTER)
    assert plan.period == min(2.0, resends.PERIOD_MAX_S)


def test_the_budget_follows_the_answers_of_the_last_period():
    plan = Resends([(f"t{n}", n) for n in range(1000)], resend_after=1.0, now=0.0)
    assert plan.budget() == RESEND_FLOOR  # nothing answered yet: the floor
    for n in range(300):
        plan.answered(f"t{n}")
    plan.answered("not ours")  # a task this plan does not track is not counted
    assert plan.budget() == RESEND_GROWTH * 300
    assert plan.budget() == RESEND_FLOOR, "each period counts its own answers"
    assert len(plan.sends()) == 700


# --------------------------------------------------------------------------------------------
# for real: a private redis-server, null-classifier workers


def start_worker(server, tmp_path, name: str, delay_s: float | None = None, **env: str) -> Worker:
    settings = worker_env(None, server.url, QUEUE, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_METRICS_PORT=str(free_port()),
                          **env)  # fmt: skip
    if delay_s is not None:
        settings[DELAY_ENV] = str(delay_s)
    worker = Worker(settings, tmp_path / f"{name}.log", command=worker_command(faulty=delay_s is not None))
    worker.wait_ready(timeout=120)
    return worker


def in_redis(client: redis.Redis) -> int:
    """Messages Redis holds for the queue: queued, being fetched, unacked."""
    fetching = client.keys(names.FETCHING_KEY.format(consumer="*", queue=QUEUE))
    return client.llen(QUEUE) + client.hlen(names.unacked_key()) + sum(client.llen(key) for key in fetching)


def resent_counts(caplog) -> list[int]:
    return [int(m.group(1)) for record in caplog.records
            if (m := re.match(r"re-sent (\d+) message", record.getMessage()))]  # fmt: skip


def stream_counts(client: redis.Redis) -> Counter:
    return Counter((json.loads(f[b"data"])["task_id"], json.loads(f[b"data"])["id"])
                   for _, f in client.xrange(names.RESULTS_STREAM))  # fmt: skip


def assert_loss_said_once_and_answered_once(caplog, client: redis.Redis, results: list[dict], n: int) -> None:
    """After Redis lost its data under a waiting producer: one warning naming the `n` messages still
    waited for, every ticket answered `ok`, and each published once in the results stream."""
    said = [r.getMessage() for r in caplog.records if "Redis lost its data" in r.getMessage()]
    assert len(said) == 1 and f"the {n} message(s) still waited for" in said[0], said
    assert [r["status"] for r in results] == ["ok"] * n
    counts = stream_counts(client)
    assert len(counts) == n and set(counts.values()) == {1}


def test_a_backlog_is_resent_nothing_and_redis_never_holds_much_more_than_what_is_outstanding(
    tmp_path, redis_server, caplog
):
    """One slow worker (8 tickets per 0.1 s) behind 600 tickets, resend_after 0.3 s: the old
    re-send re-sent every unanswered message every period. Sampled throughout: the messages Redis
    holds stay within 1.1x the tickets outstanding (plus the worker's one batch answered but not yet
    acked), and every ticket is answered once."""
    n, window = 600, 8
    client = redis_server.client()
    worker = start_worker(redis_server, tmp_path, "slow", delay_s=0.1, TICKETQ_BATCH_WINDOW=str(window),
                          TICKETQ_PREFETCH_MULTIPLIER=str(window))  # fmt: skip
    producer = Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE))
    answered, samples, done = [0], [], threading.Event()

    def sample() -> None:
        probe = redis_server.client()
        while not done.is_set():
            outstanding = n - answered[0]  # read first: answers only lower it meanwhile
            samples.append((in_redis(probe), outstanding))
            done.wait(0.02)

    caplog.set_level(logging.WARNING, logger="producer.waiting")
    try:
        sent = producer.submit_many([{"id": f"B-{i}", "text": f"backlog ticket {i}"} for i in range(n)])
        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.monotonic()
        results = producer.wait(sent, timeout=240, resend_after=0.3,
                                on_result=lambda rows: answered.__setitem__(0, answered[0] + len(rows)))  # fmt: skip
        took = time.monotonic() - started
    finally:
        done.set()
        producer.close()
        worker.stop(timeout=30)
    sampler.join(timeout=30)
    worst = max(held / max(outstanding, 1) for held, outstanding in samples if outstanding > 10 * window)
    over = [(held, outstanding) for held, outstanding in samples if held > 1.1 * outstanding + window]
    counts = stream_counts(client)
    print(f"\n[backlog] {n} tickets, one worker at {n / took:.0f} tickets/s, resend_after 0.3 s: {took:.1f} s, "
          f"{len(samples)} samples, max messages/outstanding {worst:.3f} (outstanding > {10 * window}); "
          f"re-sent {sum(resent_counts(caplog))}; stream entries {sum(counts.values())}")  # fmt: skip
    assert took > 10 * 0.3, "a backlog of many periods"
    assert not over, f"Redis held more than 1.1x outstanding: {over[:5]}"
    assert sum(resent_counts(caplog)) <= n // 20
    assert [r["status"] for r in results] == ["ok"] * n
    assert len(counts) == n and set(counts.values()) == {1}


@pytest.mark.parametrize("scan", [resends.QUEUE_SCAN, 50], ids=["whole-queue-read", "queue-longer-than-scan"])
def test_a_lost_message_is_resent_within_the_bound(tmp_path, redis_server, caplog, monkeypatch, scan):
    """No worker yet, 300 queued; one message deleted from the queue list (as a Redis that lost its
    last writes loses it). With the whole queue read, it is re-sent within resend_after + one
    period; with a queue longer than the scan, not while the queue holds still (it may be queued
    behind the scanned end), and once a worker moves the queue past where it was."""
    monkeypatch.setattr(resends, "QUEUE_SCAN", scan)
    n, resend_after = 300, 0.5
    client = redis_server.client()
    producer = Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE))
    caplog.set_level(logging.WARNING, logger="producer.waiting")
    worker = None
    try:
        sent = producer.submit_many([{"id": f"L-{i}", "text": f"ticket {i}"} for i in range(n)])
        lost = sent[n // 3]
        [item] = [item for item in client.lrange(QUEUE, 0, -1) if task_id_of(item) == lost.id]
        assert client.lrem(QUEUE, 1, item) == 1
        deleted = time.monotonic()
        if scan < n:
            held = producer.wait(sent, timeout=5 * resend_after, resend_after=resend_after)
            assert {r["status"] for r in held} == {"timeout"}
            assert not resent_counts(caplog), "nothing re-sent while the queue holds still"
            worker = start_worker(redis_server, tmp_path, "drain")
            results = producer.wait(sent, timeout=120, resend_after=resend_after)
        else:
            box: dict = {}

            def wait_all() -> None:
                box["results"] = producer.wait(sent, timeout=120, resend_after=resend_after)

            waiter = threading.Thread(target=wait_all)
            waiter.start()
            queued = lambda: any(task_id_of(i) == lost.id for i in client.lrange(QUEUE, 0, -1))  # noqa: E731
            wait_for(queued, 60, "the lost message re-sent", interval=0.01)
            resent_s = time.monotonic() - deleted
            worker = start_worker(redis_server, tmp_path, "drain")
            waiter.join(timeout=120)
            results = box["results"]
            print(f"\n[lost] re-sent {resent_s:.2f} s after it was deleted (resend_after {resend_after} s)")
            # resend_after + one period, and a wide margin for a loaded machine
            assert resent_s <= resend_after + min(resend_after, resends.PERIOD_MAX_S) + 5
    finally:
        producer.close()
        if worker is not None:
            worker.stop(timeout=30)
    counts = stream_counts(client)
    print(f"\n[lost, scan {scan}] re-sent {resent_counts(caplog)}; answered {len(counts)}")
    assert sum(resent_counts(caplog)) == 1, "only the lost message was re-sent"
    assert [r["status"] for r in results] == ["ok"] * n
    assert len(counts) == n and set(counts.values()) == {1}


def test_resume_after_redis_lost_its_queue_resends_the_lost_tickets(tmp_path, redis_server):
    """A run times out with 200 pending rows; Redis then loses everything (FLUSHALL, as a restart
    without persistence does). `--resume`, without --resend-after, re-sends them (neither answered,
    queued nor fetched) instead of waiting out its timeout: exit 0, each answered once."""
    n = 200
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    first = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--timeout", "0.5")
    assert first.finish(60) == 3, first.stderr
    assert statuses(out) == {"pending": n}
    client = redis_server.client()
    client.flushall()
    worker = start_worker(redis_server, tmp_path, "after-loss")
    try:
        started = time.monotonic()
        resume = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--resume",
                         "--timeout", "120")  # fmt: skip
        status = resume.finish(150)
        took = time.monotonic() - started
    finally:
        worker.stop(timeout=30)
    counts = stream_counts(client)
    print(f"\n[resume after loss] {n} lost tickets re-sent and answered in {took:.1f} s; "
          f"{[line for line in resume.stderr.splitlines() if 're-sent' in line]}")  # fmt: skip
    assert status == 0, resume.stdout + resume.stderr
    assert statuses(out) == {"ok": n}
    assert len(counts) == n and set(counts.values()) == {1}
    assert all(row["status"] == "ok" for row in rows(out))


def test_all_due_makes_every_waited_message_due_past_its_backoff():
    tracker = resends.Resends([("a", 1), ("b", 2)], resend_after=60, now=0.0)
    assert tracker.due(1.0) == []
    assert tracker.all_due(1.0) == 2 and tracker.due(1.0) == ["a", "b"]


@pytest.mark.integration
def test_a_producer_waiting_when_redis_loses_its_data_says_so_once_and_resends_every_ticket(
        tmp_path, redis_server, caplog):  # fmt: skip
    """Redis flushed (what a restart without persistence leaves) while a producer waits: one line
    says so, every message is re-sent at once, and each ticket is answered once."""
    n, resend_after = 200, 30.0  # a backoff far longer than the test: only the loss makes them due
    client = redis_server.client()
    producer = Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE))
    caplog.set_level(logging.WARNING, logger="producer.waiting")
    box: dict = {}
    worker = None
    try:
        sent = producer.submit_many([{"id": f"E-{i}", "text": f"ticket {i}"} for i in range(n)])
        waiter = threading.Thread(target=lambda: box.update(results=producer.wait(sent, timeout=180,
                                                                                  resend_after=resend_after)))
        waiter.start()
        wait_for(lambda: client.get(names.EPOCH_KEY) is not None, 60, "the producer's epoch marker")
        client.flushall()
        wait_for(lambda: client.llen(QUEUE) == n, 60, "every message re-sent after the loss", interval=0.05)
        worker = start_worker(redis_server, tmp_path, "after-loss")
        waiter.join(timeout=180)
    finally:
        producer.close()
        if worker is not None:
            worker.stop(timeout=30)
    assert_loss_said_once_and_answered_once(caplog, client, box["results"], n)
