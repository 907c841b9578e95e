"""Label heads end to end on the tiny stand-in (issue 43): `ticketq synthetic` and `ticketq fit` as a
user runs them (exit statuses, the head beside zero-shot), then the head served by a real worker
through Redis: every label equals the head's unbatched reference and `ticketq classify`'s offline
answer, and each result names the head; a worker whose prompt differs from the head's refuses to
start in one line, exit status 2."""

from __future__ import annotations

import json
import uuid

import pytest
from commands import engine_env, run
from workers import Worker, redis_or_skip, worker_env

from ticketq.exits import EXIT_NOTHING, EXIT_USAGE
from worker.engine.replicas import load_engine
from worker.settings import Settings

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/4"


@pytest.fixture(scope="module")
def head_file(tiny_model_dir, tmp_path_factory):
    """A head fitted by the CLI on 300 tickets of seed 1, held out on 100 of seed 2."""
    work = tmp_path_factory.mktemp("fit")
    env = engine_env(tiny_model_dir)
    for name, count, seed in (("train", 300, 1), ("held", 100, 2)):
        made = run(["ticketq", "synthetic", str(count), "--seed", str(seed), "--out", str(work / f"{name}.jsonl")])
        assert made.returncode == 0, made.stderr
    fitted = run(["ticketq", "fit", str(work / "train.jsonl"), "--holdout", str(work / "held.jsonl"), "--out",
                  str(work / "head.safetensors"), "--json", str(work / "fit.json"), "--no-progress"], env)  # fmt: skip
    assert fitted.returncode == 0, fitted.stderr
    return work, fitted


def test_fit_prints_the_head_beside_zero_shot_and_writes_the_head(head_file):
    work, fitted = head_file
    figures = json.loads((work / "fit.json").read_text())
    head, zero = figures["scores"][figures["head"]], figures["scores"]["zero-shot"]
    assert "zero-shot" in fitted.stdout and figures["head"] in fitted.stdout and "ECE" in fitted.stdout
    assert head["scored"] == zero["scored"] == 100 and head["accuracy"] > zero["accuracy"]
    assert figures["summary"]["train"] + figures["summary"]["validation"] == 300


def test_fit_refuses_to_overwrite_and_too_little_to_fit(head_file, tiny_model_dir):
    work, _ = head_file
    env = engine_env(tiny_model_dir)
    again = run(["ticketq", "fit", str(work / "train.jsonl"), "--out", str(work / "head.safetensors")], env)
    assert again.returncode == EXIT_USAGE and "--force" in again.stderr
    (work / "few.jsonl").write_text("".join(line + "\n" for line in (work / "train.jsonl").read_text().split("\n")[:5]))
    few = run(["ticketq", "fit", str(work / "few.jsonl"), "--out", str(work / "few.safetensors")], env)
    assert few.returncode == EXIT_NOTHING and "at least 20" in few.stderr and not (work / "few.safetensors").exists()


def test_a_worker_serves_the_head_as_its_reference_and_as_classify_offline(head_file, tiny_model_dir, tmp_path):
    redis_or_skip(REDIS_URL)
    work, _ = head_file
    head = str(work / "head.safetensors")
    held = [json.loads(line) for line in (work / "held.jsonl").read_text().splitlines()]
    offline = run(["ticketq", "classify", str(work / "held.jsonl"), "--out", str(tmp_path / "r.jsonl"),
                   "--no-progress"], {**engine_env(tiny_model_dir), "TICKETQ_HEAD": head})  # fmt: skip
    assert offline.returncode == 0, offline.stderr
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    queue = f"heads-{uuid.uuid4().hex[:8]}"
    worker = Worker(worker_env(tiny_model_dir, REDIS_URL, queue, TICKETQ_HEAD=head, TICKETQ_SHADOW_RATE="1"),
                    tmp_path / "worker.log")  # fmt: skip
    from producer.api import Producer

    try:
        worker.wait_ready(timeout=180)
        producer = Producer(Settings(broker_url=REDIS_URL, queue=queue))
        try:
            results = producer.wait(producer.submit_many([{"id": t["id"], "text": t["text"]} for t in held]),
                                    timeout=180)  # fmt: skip
        finally:
            producer.close()
    finally:
        worker.stop()
    reference = load_engine(Settings(**_engine_settings(tiny_model_dir), head=head))
    scorer = reference.info.scorer
    for ticket, result in zip(held, sorted(results, key=lambda r: r["id"]), strict=True):
        assert result["id"] == ticket["id"] and result["status"] == "ok"
        want = reference.reference(ticket["text"]).label
        assert result["label"] == rows[ticket["id"]]["label"] == want, ticket["id"]
        assert result["scorer"] == rows[ticket["id"]]["scorer"] == scorer


def _engine_settings(model_dir) -> dict:
    return {"model": str(model_dir), "device": "cpu", "dtype": "float32", "threads": 1}


def test_a_worker_refuses_a_head_fitted_for_another_prompt(head_file, tiny_model_dir):
    redis_or_skip(REDIS_URL)
    work, _ = head_file
    queue, head = f"heads-{uuid.uuid4().hex[:8]}", str(work / "head.safetensors")
    env = worker_env(tiny_model_dir, REDIS_URL, queue,
                     TICKETQ_HEAD=head, TICKETQ_SYSTEM_PROMPT="Route the ticket.")  # fmt: skip
    done = run(["ticketq", "worker"], env, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_USAGE, output[-3000:]
    refusals = [line for line in output.splitlines() if "cannot start" in line]
    assert len(refusals) == 1 and "another prompt" in refusals[0] and "ticketq fit" in refusals[0], output[-3000:]
    assert "Traceback" not in output
