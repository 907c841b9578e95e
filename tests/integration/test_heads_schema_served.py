"""Schema-field heads end to end on the tiny stand-in (issue 43): `ticketq fit --schema` as a user
runs it (one head per field, head beside zero-shot per field), then a real worker serving the
schema with the heads named in its file (TICKETQ_SCHEMAS) through a private redis-server: every
field equals the unbatched reference and `ticketq classify --schema`'s offline answer and names
its head, the live shadow check agrees on every answer, `ticketq_model_info` names the heads; a
worker whose schema prompt differs from the heads' refuses to start in one line, exit status 2.
`ticketq eval --schema` prints each headed field's accuracy beside zero-shot's."""

from __future__ import annotations

import json
import uuid

import pytest
from commands import engine_env, run
from servers import require_redis_server
from workers import RedisServer, running_worker, wait_for, worker_env

from producer.api import Producer
from producer.synthetic import generate_tickets
from ticketq.config import ClientSettings
from ticketq.exits import EXIT_USAGE
from ticketq.schema import load_schema
from worker.engine.replicas import load_engine
from worker.settings import Settings

pytestmark = pytest.mark.integration

LABELS = ["billing", "technical", "account"]


def schema_text(heads: bool, system: str = "You are a support ticket assistant.") -> str:
    head = (lambda name: f'head = "heads/{name}.safetensors"\n') if heads else (lambda name: "")
    return (f'name = "triage-heads"\nsystem = "{system}"\n\n[fields.team]\ninstruction = "Which team?"\n'
            f'labels = {LABELS}\n{head("team")}\n[fields.mentions]\ninstruction = "Which topics?"\n'
            f'labels = {LABELS}\nmulti = true\n{head("mentions")}')  # fmt: skip


def labelled(path, count: int, seed: int) -> None:
    rows = [{"id": t["id"], "text": t["text"], "schema": "triage-heads",
             "expected": {"team": t["expected"], "mentions": [t["expected"]]}}
            for t in generate_tickets(count, seed=seed)]  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture(scope="module")
def fitted(tiny_model_dir, tmp_path_factory):
    """Heads fitted by the CLI on 300 tickets of seed 1, held out on 60 of seed 2; the schema naming them."""
    work = tmp_path_factory.mktemp("fit-schema")
    (work / "plain.toml").write_text(schema_text(heads=False))
    labelled(work / "train.jsonl", 300, 1)
    labelled(work / "held.jsonl", 60, 2)
    done = run(["ticketq", "fit", str(work / "train.jsonl"), "--schema", str(work / "plain.toml"), "--holdout",
                str(work / "held.jsonl"), "--out", str(work / "heads"), "--json", str(work / "fit.json"),
                "--no-progress"], engine_env(tiny_model_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    (work / "schema.toml").write_text(schema_text(heads=True))
    return work, done


def test_fit_prints_each_fields_head_beside_zero_shot(fitted):
    work, done = fitted
    figures = json.loads((work / "fit.json").read_text())
    assert set(figures["fields"]) == {"team", "mentions"}
    for name, found in figures["fields"].items():
        assert found["head"] in done.stdout and f"triage-heads.{name}" in done.stdout
        assert found["scores"][found["head"]]["scored"] == found["scores"]["zero-shot"]["scored"] == 60
    assert "ECE" in done.stdout and f'under [fields.mentions]: head = "{work / "heads" / "mentions.safetensors"}"' \
        in done.stdout  # fmt: skip


def test_eval_scores_the_field_heads_beside_zero_shot(fitted, tiny_model_dir):
    work, _ = fitted
    done = run(["ticketq", "eval", str(work / "held.jsonl"), "--schema", str(work / "schema.toml"), "--no-progress"],
               engine_env(tiny_model_dir))  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if "zero-shot on the same 60 rows" in line]
    assert [line.split()[0] for line in lines] == ["team", "mentions"], done.stdout[-2000:]


def test_a_worker_serves_the_field_heads_as_their_reference_and_offline(fitted, tiny_model_dir, tmp_path):
    require_redis_server()
    work, _ = fitted
    held = [json.loads(line) for line in (work / "held.jsonl").read_text().splitlines()]
    offline = run(["ticketq", "classify", str(work / "held.jsonl"), "--schema", str(work / "schema.toml"), "--out",
                   str(tmp_path / "r.jsonl"), "--no-progress"], engine_env(tiny_model_dir))  # fmt: skip
    assert offline.returncode == 0, offline.stderr
    rows = {row["id"]: row for row in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    server = RedisServer(tmp_path, aof=False).start()
    queue = f"field-heads-{uuid.uuid4().hex[:8]}"
    env = worker_env(tiny_model_dir, server.url, queue, TICKETQ_SCHEMAS=str(work / "schema.toml"),
                     TICKETQ_MATMUL="torch", TICKETQ_SHADOW_RATE="1")  # fmt: skip
    try:
        with running_worker(env, tmp_path / "worker.log") as worker:
            producer = Producer(ClientSettings(broker_url=server.url, queue=queue))
            try:
                results = producer.wait(producer.submit_many([{"id": t["id"], "text": t["text"]} for t in held]),
                                        timeout=180)  # fmt: skip
            finally:
                producer.close()
            shadow_agreed(worker, len(held))
            info = next(key for key in worker.metrics() if key.startswith("ticketq_model_info{"))
    finally:
        server.stop()
    runner = load_engine(Settings(model=str(tiny_model_dir), device="cpu", dtype="float32", threads=1,
                                  matmul="torch")).fields(load_schema(work / "schema.toml"))  # fmt: skip
    assert f"heads=triage-heads.team={runner.heads.scorer_of('team')}" in info
    for ticket, result in zip(held, results, strict=True):
        want = runner.reference(ticket["text"]).to_json()["fields"]
        assert result["status"] == "ok" and result["scorer"] == runner.heads.scorer, result
        for name, answer in result["fields"].items():
            assert answer.get("labels", answer.get("label")) == want[name].get("labels", want[name].get("label"))
            assert answer["scorer"] == want[name]["scorer"] == rows[ticket["id"]]["fields"][name]["scorer"]
            assert answer.get("labels", answer.get("label")) == rows[ticket["id"]]["fields"][name].get(
                "labels", rows[ticket["id"]]["fields"][name].get("label"))  # fmt: skip


def shadow_agreed(worker, answered: int) -> None:
    """The live shadow check re-ran every answer on the schema's reference (its heads'), and agreed."""

    def total(name: str) -> float:
        return sum(v for k, v in worker.metrics().items() if k.startswith(name + "{"))

    wait_for(lambda: total("ticketq_shadow_checked_total") + total("ticketq_shadow_dropped_total") >= answered, 60,
             "the shadow checker caught up")  # fmt: skip
    assert total("ticketq_shadow_checked_total") > 0
    assert total("ticketq_shadow_agreed_total") == total("ticketq_shadow_checked_total")


def test_a_worker_refuses_field_heads_fitted_for_another_prompt(fitted, tiny_model_dir, tmp_path):
    require_redis_server()
    work, _ = fitted
    (work / "changed.toml").write_text(schema_text(heads=True, system="Route the ticket."))
    server = RedisServer(tmp_path, aof=False).start()
    try:
        env = worker_env(tiny_model_dir, server.url, "q", TICKETQ_SCHEMAS=str(work / "changed.toml"))
        done = run(["ticketq", "worker"], env, timeout=180)
    finally:
        server.stop()
    output = done.stdout + done.stderr
    assert done.returncode == EXIT_USAGE, output[-3000:]
    refusals = [line for line in output.splitlines() if "cannot start" in line]
    assert len(refusals) == 1 and "another prompt" in refusals[0] and "field team" in refusals[0], output[-3000:]
    assert "Traceback" not in output
