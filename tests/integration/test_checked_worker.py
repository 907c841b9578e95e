"""A real worker in a fast precision, re-checked (TICKETQ_DTYPE=int8, TICKETQ_RECHECK on by default),
on the tiny stand-in: every label is the float32 reference's, every result says which precision
answered it, and /metrics counts the answers by precision, the re-checks, the bound, the
duplicates computed once and the answer cache's hits (TICKETQ_ANSWER_CACHE_S); a backlog on a
loaded machine is answered whole. The tiny stand-in's int8 error is large, so many tickets are
re-checked."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from contextlib import contextmanager

import pytest
from workers import Worker, redis_or_skip, wait_for, worker_env

from producer.api import Producer
from producer.synthetic import generate_tickets
from worker.settings import Settings

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/4"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def checked_worker(tiny_model_dir, tmp_path_factory):
    redis_or_skip(REDIS_URL)
    queue = f"checked-{uuid.uuid4().hex[:8]}"
    cache = tmp_path_factory.mktemp("cache")
    env = worker_env(tiny_model_dir, REDIS_URL, queue, TICKETQ_DTYPE="int8", TICKETQ_RECHECK="always",
                     TICKETQ_SHADOW_RATE="1",
                     TICKETQ_ANSWER_CACHE_S="600", XDG_CACHE_HOME=str(cache))  # fmt: skip
    worker = Worker(env, tmp_path_factory.mktemp("logs") / "checked.log")
    try:
        worker.wait_ready(timeout=180)
        yield worker, queue, cache
    finally:
        worker.stop()


def test_a_rechecked_worker_answers_with_float32s_labels(checked_worker, tiny_engine):
    worker, queue, cache = checked_worker
    run = uuid.uuid4().hex[:8]  # texts of this run only: the answer cache outlives a run on the shared Redis
    texts = [f"{t['text']} (ref {run})" for t in generate_tickets(60, seed=31)]
    # exact copies in one packed message (one job): computed once, each answered under its own id
    copies = [{"id": f"copy{i}", "text": texts[0]} for i in range(5)]
    tickets = [{"id": f"c{i}", "text": text} for i, text in enumerate(texts)]  # c0: in the answer cache by now
    resent = [{"id": f"again{i}", "text": text} for i, text in enumerate(texts[:10])]  # all ten in the cache
    producer = Producer(Settings(broker_url=REDIS_URL, queue=queue))
    try:
        results = producer.wait(producer.submit_many(copies, pack=len(copies)), timeout=TIMEOUT_S)
        results += producer.wait(producer.submit_many(tickets), timeout=TIMEOUT_S)
        results += producer.wait(producer.submit_many(resent), timeout=TIMEOUT_S)
    finally:
        producer.close()
    by_id = {r["id"]: r for r in results}
    assert {r["status"] for r in results} == {"ok"}
    for ticket in [*copies, *tickets, *resent]:
        result = by_id[ticket["id"]]
        assert result["label"] == tiny_engine.reference(ticket["text"]).label, ticket["id"]
        assert result["precision"] in ("int8", "float32") and result["rechecked"] == (result["precision"] == "float32")
    for ticket in resent:  # answered from the cache: the same answer
        original = by_id[ticket["id"].replace("again", "c")]
        assert {k: by_id[ticket["id"]][k] for k in ("label", "probs", "precision")} == {
            k: original[k] for k in ("label", "probs", "precision")}
    assert 0 < sum(r["rechecked"] for r in results) < len(results)  # the tiny model's near-ties: some, not all

    def counted():
        metrics = worker.metrics()
        answers = sum(v for k, v in metrics.items() if k.startswith("ticketq_answers_total{"))
        return metrics if answers == len(results) else None  # every result, copies and cached ones too

    metrics = wait_for(counted, 30, "every answer counted by precision")
    computed = [by_id["copy0"], *(by_id[t["id"]] for t in tickets[1:])]  # what the engine computed
    assert metrics["ticketq_rechecked_tickets_total{}"] == sum(r["rechecked"] for r in computed)
    assert metrics["ticketq_deduplicated_tickets_total{}"] == len(copies) - 1
    assert metrics["ticketq_answer_cache_lookups_total{result=hit}"] == 1 + len(resent)
    assert metrics["ticketq_answer_cache_lookups_total{result=miss}"] == len(copies) + len(tickets) - 1
    assert metrics["ticketq_precision_error_bound{precision=int8,schema=default}"] > 0
    info = next(k for k in metrics if k.startswith("ticketq_model_info{"))
    assert "dtype=int8" in info and "recheck=true" in info
    assert "re-checked in float32" in worker.log()
    (bound_file,) = (cache / "ticketq" / "precision").glob("int8-*.json")
    assert json.loads(bound_file.read_text())["measured"] > 0
    assert Counter(r["precision"] for r in results)["int8"] > 0


@contextmanager
def busy_cores(n: int = 2):
    """A loaded machine: `n` processes spinning on the CPU for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_a_backlog_on_a_loaded_machine_is_answered_in_float32s_labels(checked_worker, tiny_engine):
    """300 tickets at once while two processes spin on the CPU: the re-checks wait for the fast
    forwards' backlog only a bounded number of forwards, so every ticket is answered (none left
    unsettled behind a queue that never empties), each with the reference's label."""
    worker, queue, _ = checked_worker
    run = uuid.uuid4().hex[:8]
    texts = [f"{t['text']} (backlog {run})" for t in generate_tickets(300, seed=37)]
    tickets = [{"id": f"b{i}", "text": text} for i, text in enumerate(texts)]
    before = worker.metrics().get("ticketq_rechecked_tickets_total{}", 0)
    producer = Producer(Settings(broker_url=REDIS_URL, queue=queue))
    try:
        with busy_cores():
            started = time.monotonic()
            results = producer.wait(producer.submit_many(tickets), timeout=4 * TIMEOUT_S)
            took = time.monotonic() - started
    finally:
        producer.close()
    assert sorted(r["id"] for r in results) == sorted(t["id"] for t in tickets)
    assert {r["status"] for r in results} == {"ok"}
    by_id = {r["id"]: r for r in results}
    assert all(by_id[t["id"]]["label"] == tiny_engine.reference(t["text"]).label for t in tickets)
    rechecked = sum(r["rechecked"] for r in results)
    assert 0 < rechecked < len(results)
    wait_for(lambda: worker.metrics()["ticketq_rechecked_tickets_total{}"] - before == rechecked, 30,
             "the backlog's re-checks counted")  # fmt: skip
    print(f"\n[checked backlog] {len(results)} tickets on a loaded machine in {took:.1f} s, {rechecked} re-checked")
