"""The service end to end: real Redis, real `ticketq worker` processes, the producer CLI and API.

Redis is the one at 127.0.0.1:6379, database 3. Every worker group consumes its own uniquely
named queue and every check filters the shared streams by its own task ids, so tests (and
concurrent runs of this file) never see each other's messages; the database is not flushed.
The model workers run the tiny stand-in in float32 with the default labels and prompt, the same
settings as the `tiny_engine` fixture, so their answers can be held to `tiny_engine.reference`.

Worker start-up costs seconds (torch import), so the module starts every worker it needs at once
and shares them:

- `cli` — one worker that sees exactly the 500-ticket CLI run, so its metrics can be checked exactly;
- `pair` — two workers on one queue (shadow rate 1, small TICKETQ_MAX_TICKET_BYTES): packed
  messages, bad input and dead letters, work sharing, the shadow check;
- `null` — a TICKETQ_NULL_CLASSIFIER worker, for the queue's own ceiling (printed, not asserted).

Everything synchronises on results, streams, metrics or process exit; nothing sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
from celery import states
from celery.result import AsyncResult
from prometheus_client.parser import text_string_to_metric_families
from workers import ROOT, Worker, redis_or_skip, wait_for, worker_env

from producer.api import Producer
from producer.synthetic import generate_tickets
from ticketq import names
from worker.redis.keys import DONE_KEY
from worker.settings import Settings

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/3"  # this module's database; the worker default is /0
PAIR_MAX_TICKET_BYTES = 1024  # the `pair` workers reject longer text as oversize
CLI_TICKETS = 500
NULL_TICKETS = 2000
PROB_TOLERANCE = 1e-4
RESULT_TIMEOUT_S = 120


# --------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def broker() -> Iterator[redis.Redis]:
    """A client on this module's Redis database; skips (fails on CI) without Redis.

    Not flushed: two runs of the suite on one Redis (a developer's and a colleague's, or CI jobs)
    would wipe each other's results mid-run. Every check filters by its own task ids instead.
    """
    client = redis_or_skip(REDIS_URL)
    yield client
    client.close()


@dataclass
class Fleet:
    cli: Worker
    pair: list[Worker]
    null: Worker
    queues: dict[str, str]  # group name -> its queue


@pytest.fixture(scope="module")
def fleet(broker, tiny_model_dir, tmp_path_factory) -> Iterator[Fleet]:
    """Every worker of the module, started together (their start-ups overlap) and stopped at the end."""
    logs = tmp_path_factory.mktemp("service-workers")
    queues = {group: f"svc-{group}-{uuid.uuid4().hex[:8]}" for group in ("cli", "pair", "null")}
    pair_env = {"TICKETQ_SHADOW_RATE": "1", "TICKETQ_MAX_TICKET_BYTES": str(PAIR_MAX_TICKET_BYTES)}
    envs = {
        "cli": worker_env(tiny_model_dir, REDIS_URL, queues["cli"]),
        "pair-a": worker_env(tiny_model_dir, REDIS_URL, queues["pair"], **pair_env),
        "pair-b": worker_env(tiny_model_dir, REDIS_URL, queues["pair"], **pair_env),
        "null": worker_env(None, REDIS_URL, queues["null"], TICKETQ_NULL_CLASSIFIER="1"),
    }
    started: dict[str, Worker] = {}
    try:
        for name, env in envs.items():
            started[name] = Worker(env, logs / f"{name}.log")
        for worker in started.values():
            worker.wait_ready(timeout=180)
        yield Fleet(started["cli"], [started["pair-a"], started["pair-b"]], started["null"], queues)
    finally:
        _stop_all(list(started.values()))


def _stop_all(workers: list[Worker]) -> None:
    """SIGTERM every worker first, then wait: their warm shutdowns overlap."""
    for worker in workers:
        if worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=60)
        worker.stop()  # closes the log; kills a worker that did not stop in time


def _producer(queue: str) -> Producer:
    return Producer(Settings(broker_url=REDIS_URL, queue=queue))


@pytest.fixture
def pair(fleet) -> Iterator[Producer]:
    """A producer on the `pair` workers' queue; afterwards both workers must still be running."""
    producer = _producer(fleet.queues["pair"])
    yield producer
    producer.close()
    for worker in fleet.pair:
        assert worker.proc.poll() is None, f"worker {worker.pid} died:\n{worker.log()[-3000:]}"


@dataclass
class CliRun:
    tickets: list[dict]
    results: list[dict]
    stdout: str


@pytest.fixture(scope="module")
def cli_run(fleet, tmp_path_factory) -> CliRun:
    """500 synthetic tickets sent and collected by `ticketq-produce synthetic --wait --out`."""
    out = tmp_path_factory.mktemp("cli") / "results.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=REDIS_URL, TICKETQ_QUEUE=fleet.queues["cli"], PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "producer.cli", "synthetic", str(CLI_TICKETS), "--seed", "7", "--wait",
               "--out", str(out), "--no-progress", "--timeout", str(RESULT_TIMEOUT_S)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=RESULT_TIMEOUT_S + 60)
    assert done.returncode == 0, f"CLI exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    return CliRun(generate_tickets(CLI_TICKETS, seed=7), results, done.stdout)


# --------------------------------------------------------------------------------------------
# helpers


def _results_stream(client: redis.Redis) -> list[dict]:
    return [json.loads(fields[b"data"]) for _, fields in client.xrange(names.RESULTS_STREAM)]


def _dead_letters(client: redis.Redis, task_id: str) -> list[dict]:
    raw = client.xrange(names.DEAD_LETTER_STREAM)
    entries = ({k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw)
    return [entry for entry in entries if entry["task_id"] == task_id]


def _stream_counts(client: redis.Redis, task_ids: set[str]) -> Counter:
    """(task_id, ticket id) -> how often the results stream holds it, for the given tasks."""
    return Counter((r["task_id"], r["id"]) for r in _results_stream(client) if r["task_id"] in task_ids)


def _metrics(worker: Worker) -> dict[str, list[tuple[dict, float]]]:
    """GET /metrics and parse it with prometheus_client: sample name -> [(labels, value)]."""
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def _total(samples: dict, name: str, **labels: str) -> float:
    rows = samples.get(name, [])
    return sum(value for row_labels, value in rows if all(row_labels.get(k) == v for k, v in labels.items()))


def _settled_metrics(worker: Worker, tickets: int) -> dict:
    """The worker's metrics once all `tickets` are counted (a result is published just before its count)."""

    def counted():
        metrics = _metrics(worker)
        return metrics if _total(metrics, "ticketq_tickets_total") == tickets else None

    return wait_for(counted, 30, f"{tickets} tickets counted in the metrics of worker {worker.pid}")


def _short_tickets(n: int, seed: int, limit: int = PAIR_MAX_TICKET_BYTES) -> list[dict]:
    """`n` synthetic tickets that fit the `pair` workers' byte limit, as `{"id", "text"}`."""
    fitting = (t for t in generate_tickets(4 * n, seed=seed) if len(t["text"].encode()) <= limit)
    return [{"id": f"s{seed}-{t['id']}", "text": t["text"]} for t in fitting][:n]


def _worker_name(worker: Worker) -> str:
    return f"{socket.gethostname()}:{worker.pid}"  # worker.service.answers.Answers.worker_name


def _send_raw(producer: Producer, args: list) -> AsyncResult:
    """Bypass the producer's validation: exactly what any Celery client could put on the queue."""
    return producer.app.send_task(names.TASK_CLASSIFY, args=args, queue=producer.settings.queue)


# --------------------------------------------------------------------------------------------
# the producer CLI, 500 tickets, against the reference path


@contextlib.contextmanager
def _one_torch_thread():
    """Batch-1 reference calls gain nothing from intra-op threads and lose ~10x to them on busy cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_cli_run_matches_the_reference_path(cli_run, tiny_engine):
    by_id = {t["id"]: t for t in cli_run.tickets}
    with _one_torch_thread():
        references = {ticket_id: tiny_engine.reference(t["text"]) for ticket_id, t in by_id.items()}
    assert sorted(r["id"] for r in cli_run.results) == sorted(by_id)
    assert {r["status"] for r in cli_run.results} == {"ok"}
    near_ties = 0
    for result in cli_run.results:
        reference = references[result["id"]]
        assert result["probs"].keys() == reference.probs.keys()
        for label, prob in reference.probs.items():
            assert result["probs"][label] == pytest.approx(prob, abs=PROB_TOLERANCE), result["id"]
        if reference.margin > 2 * PROB_TOLERANCE:
            assert result["label"] == reference.label, result["id"]
        else:  # a near tie: float noise may pick either side, the probabilities above still agree
            near_ties += 1
        assert result["standin"] is True and result["model"]
    assert near_ties < CLI_TICKETS // 50, f"{near_ties} near ties: the comparison would prove little"
    assert f"{CLI_TICKETS} ok" in cli_run.stdout


def test_cli_run_results_are_in_the_backend_and_once_in_the_stream(cli_run, fleet, broker):
    producer = _producer(fleet.queues["cli"])
    try:
        for result in cli_run.results:
            stored = AsyncResult(result["task_id"], app=producer.app)
            assert stored.state == states.SUCCESS, result["id"]
            assert stored.result == {k: v for k, v in result.items() if k != "expected"}
    finally:
        producer.close()
    task_ids = {r["task_id"] for r in cli_run.results}
    assert len(task_ids) == CLI_TICKETS, "one message per ticket (pack=1)"
    counts = _stream_counts(broker, task_ids)
    assert counts == Counter((r["task_id"], r["id"]) for r in cli_run.results), "each result exactly once"
    # The side channels live on the broker's database (/3 here), not on the default /0.
    some_task = next(iter(task_ids))
    done_key = DONE_KEY.format(task_id=some_task)
    assert broker.exists(done_key)
    default_db = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        assert not default_db.exists(done_key)
    finally:
        default_db.close()


def test_cli_run_forms_length_sorted_batches(cli_run, fleet):
    metrics = _settled_metrics(fleet.cli, CLI_TICKETS)
    batches = _total(metrics, "ticketq_batch_size_count")
    assert _total(metrics, "ticketq_batch_size_sum") == CLI_TICKETS
    assert batches <= CLI_TICKETS / 2, f"{batches:.0f} forward batches for {CLI_TICKETS} tickets: batching did not form"
    padded = _total(metrics, "ticketq_tokens_padded_total")
    computed = _total(metrics, "ticketq_tokens_computed_total")
    ratio = padded / computed
    print(f"\ncli run: {CLI_TICKETS} tickets in {batches:.0f} forward batches "
          f"({CLI_TICKETS / batches:.1f}/batch), padding ratio {ratio:.1%}")  # fmt: skip
    assert ratio < 0.2, f"padding ratio {ratio:.1%}: batches are not length-sorted"


def test_cli_run_metrics_endpoint(cli_run, fleet, tiny_engine):
    metrics = _settled_metrics(fleet.cli, CLI_TICKETS)
    outcomes = Counter()
    for labels, value in metrics["ticketq_tickets_total"]:
        outcomes[labels["outcome"]] += value
    assert +outcomes == {"ok": CLI_TICKETS}  # failed/rejected series exist (pre-created at 0) but stay 0
    real = sum(len(tiny_engine.prompt.encode(t["text"]).ids) for t in cli_run.tickets)
    assert _total(metrics, "ticketq_tokens_real_total") == real
    assert _total(metrics, "ticketq_tokens_computed_total") == real + _total(metrics, "ticketq_tokens_padded_total")
    (info,) = metrics["ticketq_model_info"]
    assert info[0]["standin"] == "true" and info[0]["dtype"] == "float32" and info[0]["device"] == "cpu"
    # the start-up lines run before Celery configures logging; they must still reach the log
    assert "ready on cpu/float32" in fleet.cli.log() and "metrics on http://" in fleet.cli.log()
    assert _total(metrics, "ticketq_latency_seconds_count") == CLI_TICKETS
    assert _total(metrics, "ticketq_dead_letters_total") == 0
    assert _total(metrics, "ticketq_queue_depth") == 0


# --------------------------------------------------------------------------------------------
# packed messages


def test_packed_messages_give_one_result_per_ticket(pair, broker):
    tickets = _short_tickets(120, seed=11)
    sent = pair.submit_many(tickets, pack=50)
    assert [len(r.ticket_ids) for r in sent] == [50, 50, 20]
    results = pair.wait(sent, timeout=RESULT_TIMEOUT_S)
    assert [r["id"] for r in results] == [t["id"] for t in tickets]
    assert {r["status"] for r in results} == {"ok"}
    for message in sent:
        stored = AsyncResult(message.id, app=pair.app).get(timeout=5)
        assert [row["id"] for row in stored] == list(message.ticket_ids)
    counts = _stream_counts(broker, {r.id for r in sent})
    assert counts == Counter((r["task_id"], r["id"]) for r in results), "one stream entry per ticket"


def test_bad_ticket_inside_a_pack_fails_alone(pair, broker):
    tickets = _short_tickets(4, seed=12)
    bad = {"id": "bad-in-pack", "text": 12345}
    message = _send_raw(pair, [[*tickets[:2], bad, *tickets[2:]]])
    rows = AsyncResult(message.id, app=pair.app).get(timeout=RESULT_TIMEOUT_S)
    ids = [t["id"] for t in tickets]
    assert [row["id"] for row in rows] == [*ids[:2], "bad-in-pack", *ids[2:]]
    assert [row["status"] for row in rows] == ["ok", "ok", "failed", "ok", "ok"]
    assert rows[2]["reason"] == "wrong_type" and "'text' must be a string" in rows[2]["error"]
    (letter,) = _dead_letters(broker, message.id)
    assert letter["slot"] == "2" and letter["reason"] == "wrong_type"
    assert json.loads(letter["payload"]) == bad
    counts = _stream_counts(broker, {message.id})
    assert counts == Counter((message.id, row["id"]) for row in rows)


# --------------------------------------------------------------------------------------------
# two workers, one queue


def test_two_workers_share_the_queue(pair, broker, fleet):
    tickets = _short_tickets(300, seed=14)
    sent = pair.submit_many(tickets)
    results = pair.wait(sent, timeout=RESULT_TIMEOUT_S)
    assert {r["status"] for r in results} == {"ok"}
    assert [r["id"] for r in results] == [t["id"] for t in tickets]
    by_worker = Counter(r["worker"] for r in results)
    assert set(by_worker) == {_worker_name(w) for w in fleet.pair}, f"work split {dict(by_worker)}"
    counts = _stream_counts(broker, {r.id for r in sent})
    assert sorted(counts.values()) == [1] * len(tickets), "every ticket exactly once in the stream"


# --------------------------------------------------------------------------------------------
# shadow check


def test_shadow_check_agrees_with_the_reference(pair, fleet):
    results = pair.wait(pair.submit_many(_short_tickets(60, seed=15)), timeout=RESULT_TIMEOUT_S)
    assert {r["status"] for r in results} == {"ok"}
    for worker in fleet.pair:
        # Every classified ticket is offered to the checker (rate 1): it is checked or, when the
        # checker's queue is full, dropped and counted. Wait until the checker has caught up.
        def caught_up(worker=worker):
            m = _metrics(worker)
            ok = _total(m, "ticketq_tickets_total", outcome="ok")
            seen = _total(m, "ticketq_shadow_checked_total") + _total(m, "ticketq_shadow_dropped_total")
            return m if ok and seen == ok else None

        metrics = wait_for(caught_up, 60, f"shadow checker of worker {worker.pid} caught up")
        checked = _total(metrics, "ticketq_shadow_checked_total")
        assert checked > 0
        assert _total(metrics, "ticketq_shadow_agreed_total") == checked
    assert "SHADOW MISMATCH" not in "".join(worker.log() for worker in fleet.pair)


# --------------------------------------------------------------------------------------------
# bad input: FAILURE with a reason, a dead letter with the raw payload, neighbours unaffected

OVERSIZE_TEXT = "x" * (PAIR_MAX_TICKET_BYTES + 1)
BAD_INPUTS = {
    "missing_text": ([{"id": "m1"}], "missing_field"),
    "text_not_a_string": ([{"id": "m2", "text": ["not", "a", "string"]}], "wrong_type"),
    "empty_text": ([{"id": "m3", "text": ""}], "empty_text"),
    "whitespace_text": ([{"id": "m4", "text": " \n\t "}], "empty_text"),
    "oversize_text": ([{"id": "m5", "text": OVERSIZE_TEXT}], "oversize"),
    "bad_id_type": ([{"id": {"nested": 1}, "text": "my invoice is wrong"}], "wrong_type"),
    "lone_surrogate": ([{"id": "m7", "text": "broken \udcff byte"}], "invalid_utf8"),
    "payload_not_an_object": (["just a string"], "bad_payload"),
    "payload_a_number": ([42], "bad_payload"),
    "two_arguments": ([{"text": "a"}, {"text": "b"}], "bad_payload"),
    "no_arguments": ([], "bad_payload"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_dead_lettered(pair, broker, fleet, case):
    args, reason = BAD_INPUTS[case]
    good = _short_tickets(4, seed=13)
    before = _send_raw(pair, [good[0]])
    bad = _send_raw(pair, args)
    after = pair.submit_many(good[1:])
    neighbours = [before, *after]
    # One wait for all: see the report on Producer.wait for why not bad.get() and then wait(neighbours).
    results = pair.wait([before, bad, *after], timeout=RESULT_TIMEOUT_S)

    collected = results.pop(1)
    assert collected["status"] == "failed" and reason in collected["error"], collected
    assert bad.state == states.FAILURE
    assert reason in str(bad.result), f"{case}: the failure must name its reason, got {bad.result!r}"
    (letter,) = _dead_letters(broker, bad.id)
    assert letter["reason"] == reason and letter["error"].startswith(f"{reason}: ")
    expected_raw = args if len(args) != 1 else args[0]
    assert json.loads(letter["payload"]) == expected_raw, "the dead letter keeps the raw payload"
    assert letter["worker"] in {_worker_name(w) for w in fleet.pair}
    (failed_entry,) = [r for r in _results_stream(broker) if r["task_id"] == bad.id]
    assert failed_entry["status"] == "failed" and failed_entry["reason"] == reason

    assert [r["status"] for r in results] == ["ok"] * 4
    assert [r["id"] for r in results] == [t["id"] for t in good]
    assert [message.state for message in neighbours] == [states.SUCCESS] * 4
    assert not any(_dead_letters(broker, message.id) for message in neighbours)
    assert all(worker.proc.poll() is None for worker in fleet.pair)


# --------------------------------------------------------------------------------------------
# the queue's own ceiling (null classifier)


def _drain(producer: Producer, tickets: list[dict], pack: int) -> tuple[float, float]:
    """(enqueue tickets/s, end-to-end tickets/s from the first send to the last result)."""
    started = time.perf_counter()
    sent = producer.submit_many(tickets, pack=pack)
    enqueued = time.perf_counter()
    results = producer.wait(sent, timeout=RESULT_TIMEOUT_S)
    finished = time.perf_counter()
    assert len(results) == len(tickets) and {r["status"] for r in results} == {"ok"}
    return len(tickets) / (enqueued - started), len(tickets) / (finished - started)


def test_null_classifier_queue_ceiling(fleet):
    tickets = [{"id": f"n-{i}", "text": f"ticket number {i}: please look at my account"} for i in range(NULL_TICKETS)]
    producer = _producer(fleet.queues["null"])
    try:
        figures = {"single messages": _drain(producer, tickets, pack=1)}
        figures["packed (pack=100)"] = _drain(producer, tickets, pack=100)
    finally:
        producer.close()
    for name, (enqueue, end_to_end) in figures.items():
        print(f"\nqueue ceiling, null classifier, {NULL_TICKETS} tickets, {name}: {end_to_end:,.0f} tickets/s "
              f"from first send to last result (enqueue alone: {enqueue:,.0f} tickets/s)")  # fmt: skip
    metrics = _settled_metrics(fleet.null, 2 * NULL_TICKETS)
    assert _total(metrics, "ticketq_tickets_total", outcome="ok") == 2 * NULL_TICKETS
    (info,) = metrics["ticketq_model_info"]
    assert info[0]["model"] == "null-classifier" and info[0]["standin"] == "false"


# --------------------------------------------------------------------------------------------
# start-up validation: refuse to run, quickly, with a message that names the fix

STARTUP_FAILURES = {
    "visibility_below_4x_worst_batch": ({"TICKETQ_VISIBILITY_TIMEOUT_S": "10"}, "TICKETQ_VISIBILITY_TIMEOUT_S"),
    "prefetch_below_window": (
        {"TICKETQ_PREFETCH_MULTIPLIER": "4", "TICKETQ_BATCH_WINDOW": "64"},
        "TICKETQ_PREFETCH_MULTIPLIER",
    ),
    "model_missing": ({"TICKETQ_MODEL": "/nonexistent/ticketq-model"}, "ticketq standin"),
    # the null classifier needs no model, so the broker is the first thing that fails
    "broker_unreachable": (
        {"TICKETQ_BROKER_URL": "redis://127.0.0.1:1/0", "TICKETQ_NULL_CLASSIFIER": "1"},
        "Redis is not reachable",
    ),
}


@pytest.mark.parametrize("case", list(STARTUP_FAILURES))
def test_worker_refuses_to_start(broker, tmp_path, case):
    extra, needle = STARTUP_FAILURES[case]
    env = worker_env(tmp_path / "no-model", REDIS_URL, f"svc-startup-{uuid.uuid4().hex[:8]}", **extra)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "ticketq_cli.cli", "worker"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=90)  # fmt: skip
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert needle in output, output[-3000:]
    assert "Traceback" not in output or case.startswith(("visibility", "prefetch")), output[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f}s to give up"
