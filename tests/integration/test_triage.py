"""Triage through the queue: a real `ticketq worker` serving several schemas (TICKETQ_SCHEMAS),
a private redis-server, the producer API and CLI.

Tickets name their schema (or none: the worker's first; `default`: the single field of
TICKETQ_LABELS, answered as ticketq always answered it). Every answer equals its schema's
reference computed here on the same stand-in; results below a field's threshold are copied once
to the review stream; an unknown schema is answered `unknown_schema`, naming the ones served, and
dead-lettered; the per-field metrics count every answer; the live shadow check re-runs each
answer on its own schema's reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from schemas import REVIEW_ALL, write_review_all
from servers import require_redis_server
from workers import ROOT, RedisServer, running_worker, wait_for, worker_env

from producer.api import Producer
from producer.synthetic import generate_tickets
from ticketq import names
from ticketq.config import ClientSettings
from ticketq.schema import load_schema
from worker.engine.schemas import SchemaSet

pytestmark = pytest.mark.integration

PROB_TOL = 1e-4
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def triage(tiny_model_dir, tmp_path_factory) -> Iterator[dict]:
    require_redis_server()  # under CI a missing redis-server fails the test instead of skipping it
    workdir = tmp_path_factory.mktemp("triage")
    schemas = f"{EXAMPLES / 'schema.toml'},{EXAMPLES / 'schema-topics.toml'},{write_review_all(workdir)}"
    server = RedisServer(workdir, aof=False).start()
    queue = f"triage-{uuid.uuid4().hex[:8]}"
    env = worker_env(tiny_model_dir, server.url, queue, TICKETQ_SCHEMAS=schemas, TICKETQ_MATMUL="torch",
                     TICKETQ_SHADOW_RATE="1")  # fmt: skip
    try:
        with running_worker(env, workdir / "worker.log") as worker:
            yield {"server": server, "queue": queue, "worker": worker, "schemas": schemas, "workdir": workdir}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def references(tiny_engine) -> SchemaSet:
    """The worker's schemas on the same stand-in, here: each answer's reference."""
    loaded = [load_schema(EXAMPLES / "schema.toml"), load_schema(EXAMPLES / "schema-topics.toml")]
    from ticketq.schema import parse_schema

    return SchemaSet(tiny_engine, [*loaded, parse_schema(REVIEW_ALL)])


def producer(triage) -> Producer:
    return Producer(ClientSettings(broker_url=triage["server"].url, queue=triage["queue"]))


def check_answer(references: SchemaSet, name: str, text: str, result: dict) -> None:
    assert result["status"] == "ok", result
    want = references.runner(name).reference(text)
    if name == "default":
        assert "fields" not in result and result["label"] == want.label
        assert max(abs(result["probs"][k] - want.probs[k]) for k in want.probs) < PROB_TOL
        return
    assert result["schema"] == name and result["review"] == want.review
    assert result["truncation"] == want.truncation and result["tokens"] == want.tokens
    for field, expected in want.fields.items():
        got = result["fields"][field]
        assert got.get("labels", [got.get("label")]) == list(expected.labels), (name, field)
        assert max(abs(got["probs"][k] - expected.probs[k]) for k in expected.probs) < PROB_TOL
        assert got["review"] == expected.review


def test_tickets_of_several_schemas_are_each_answered_like_their_reference(triage, references):
    texts = [ticket["text"] for ticket in generate_tickets(24, seed=21)]
    named = [None, "support", "support-topics", "default", "review-all", "support-topics"]
    tickets = [{"id": f"t{i}", "text": text, **({"schema": named[i % 6]} if named[i % 6] else {})}
               for i, text in enumerate(texts)]  # fmt: skip
    p = producer(triage)
    try:
        single = p.submit(texts[0], schema="support-topics")
        packed = p.submit_many(tickets, pack=4)  # schemas mixed inside messages
        results = p.wait([single, *packed], timeout=120)
    finally:
        p.close()
    check_answer(references, "support-topics", texts[0], results[0])
    for ticket, result in zip(tickets, results[1:], strict=True):
        check_answer(references, ticket.get("schema") or "support", ticket["text"], result)

    # the review stream: exactly the results flagged for review, once each, as published
    client = triage["server"].client()
    reviewed = Counter(json.loads(fields[b"data"])["id"] for _, fields in client.xrange(names.REVIEW_STREAM))
    flagged = Counter(result["id"] for result in results if result.get("review"))
    assert reviewed == flagged and flagged["t4"] == 1  # review-all: every ticket
    assert all(count == 1 for count in reviewed.values())

    # the per-field metrics count every field answer once
    metrics = triage["worker"].metrics()
    answers = Counter()
    for key, value in metrics.items():
        if key.startswith("ticketq_field_answers_total{"):
            labels = dict(part.split("=", 1) for part in key[key.index("{") + 1 : -1].split(","))
            answers[labels["schema"], labels["field"], labels["review"]] += value
    want = Counter()
    for result in results:
        for field, answer in result.get("fields", {}).items():
            chosen = answer.get("labels", [answer.get("label")]) or ["none"]
            want[result["schema"], field, str(answer["review"]).lower()] += len(chosen)
    assert {k: v for k, v in answers.items() if v} == want

    # the live exactness check re-ran every answer on its own schema's reference, and agreed
    def total(name: str) -> float:
        return sum(v for k, v in triage["worker"].metrics().items() if k.startswith(name + "{"))

    ok = sum(result["status"] == "ok" for result in results)
    wait_for(lambda: total("ticketq_shadow_checked_total") + total("ticketq_shadow_dropped_total") >= ok, 60,
             "the shadow checker caught up")  # fmt: skip
    assert total("ticketq_shadow_checked_total") > 0
    assert total("ticketq_shadow_agreed_total") == total("ticketq_shadow_checked_total")


def test_an_unknown_schema_is_refused_naming_the_served_ones(triage):
    p = producer(triage)
    try:
        sent = p.submit("My invoice is wrong", schema="nope")
        (result,) = p.wait([sent], timeout=60)
    finally:
        p.close()
    assert result["status"] == "failed" and result.get("reason") == "unknown_schema", result
    assert "support, support-topics, review-all, default" in result["error"]
    letters = triage["server"].client().xrange(names.DEAD_LETTER_STREAM)
    assert any(fields[b"reason"] == b"unknown_schema" for _, fields in letters)


def test_the_cli_sends_a_file_with_a_schema_and_summarises_fields(triage, tmp_path: Path):
    rows = [{"id": f"f{i}", "text": t["text"]} for i, t in enumerate(generate_tickets(6, seed=4))]
    rows[1]["schema"] = "review-all"  # a row's own schema wins over --schema
    path = tmp_path / "tickets.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "results.jsonl"
    env = {"TICKETQ_BROKER_URL": triage["server"].url, "TICKETQ_QUEUE": triage["queue"], "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "producer.cli", "file", str(path), "--schema", "support", "--out", str(out),
               "--no-progress", "--timeout", "120"]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["schema"] for r in results] == ["support", "review-all", "support", "support", "support", "support"]
    assert "support.category" in done.stdout and "review" in done.stdout


def test_a_bad_schema_file_stops_the_worker_with_every_problem(tmp_path: Path, tiny_model_dir):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[fields.team]\nlabels = ["only"]\nthreshold = 2\n')
    env = worker_env(tiny_model_dir, "redis://127.0.0.1:1/0", "q", TICKETQ_SCHEMAS=str(bad))
    done = subprocess.run([sys.executable, "-m", "ticketq_cli.cli", "worker"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "instruction is missing" in done.stderr and "threshold must be a number" in done.stderr
    assert "needs two or more" in done.stderr
