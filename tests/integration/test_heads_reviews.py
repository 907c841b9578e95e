"""`ticketq fit --from-reviews` on a private redis-server (issue 43): review items published as a
worker publishes them, decided through the review page's store (`ReviewStore.decide`, the script
the page runs), then fitted on as a user runs the command: the single field's head from the
decisions' {field: label}, a schema's field head from the decisions plus a labelled file, and
nothing to fit for a tenant without decisions (exit status 3)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from commands import engine_env, run
from schemas import write_review_all
from servers import require_redis_server
from test_review import LABELS, seed
from workers import RedisServer

from gateway.review.store import ReviewStore
from producer.synthetic import generate_tickets
from ticketq.exits import EXIT_NOTHING, EXIT_USAGE
from ticketq.names import LABELLED_STREAM
from worker.engine.head import LabelHead

pytestmark = pytest.mark.integration

DECIDED = 80


@pytest.fixture(scope="module")
def decided(tmp_path_factory) -> Iterator[RedisServer]:
    """DECIDED review items of tenant acme decided by a reviewer, each with its ticket's own label."""
    require_redis_server()
    server = RedisServer(tmp_path_factory.mktemp("reviews"), aof=False).start()
    tickets = generate_tickets(DECIDED, seed=5)
    seed(server.client(), {f"acme:{t['id']}": t["text"] for t in tickets})
    store = ReviewStore(server.client(), multi_tenant=True, decision_ttl_s=600, stream_maxlen=100_000)
    expected = {t["id"]: t["expected"] for t in tickets}
    items = store.pending("acme", DECIDED)
    assert len(items) == DECIDED
    for n, item in enumerate(items):
        assert store.decide(item, {"team": expected[item.id]}, "alice@acme", float(n)).written
    assert server.client().xlen(LABELLED_STREAM) == DECIDED
    yield server
    server.stop()


def fit_env(model_dir, server: RedisServer) -> dict[str, str]:
    return {**engine_env(model_dir), "TICKETQ_BROKER_URL": server.url}


def test_fit_from_reviews_writes_a_head_for_the_single_field(decided, tiny_model_dir, tmp_path):
    out, figures = tmp_path / "head.safetensors", tmp_path / "fit.json"
    done = run(["ticketq", "fit", "--from-reviews", "--tenant", "acme", "--out", str(out), "--json", str(figures),
                "--no-progress"], fit_env(tiny_model_dir, decided))  # fmt: skip
    assert done.returncode == 0, done.stderr
    head = LabelHead.load(out)
    assert set(head.labels) == set(LABELS) and head.field is None
    summary = json.loads(figures.read_text())["summary"]
    assert summary["train"] + summary["validation"] + summary["holdout"] == DECIDED
    assert "zero-shot" in done.stdout and "the review decisions" in json.loads(figures.read_text())["input"]


def test_fit_from_reviews_and_a_file_writes_a_schema_fields_head(decided, tiny_model_dir, tmp_path):
    schema = write_review_all(tmp_path)
    labelled = tmp_path / "more.jsonl"
    rows = [{"text": t["text"], "schema": "review-all", "expected": {"team": t["expected"]}}
            for t in generate_tickets(40, seed=6)]  # fmt: skip
    labelled.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out, figures = tmp_path / "heads", tmp_path / "fit.json"
    done = run(["ticketq", "fit", str(labelled), "--from-reviews", "--schema", str(schema), "--out", str(out),
                "--json", str(figures), "--no-progress"], fit_env(tiny_model_dir, decided))  # fmt: skip
    assert done.returncode == 0, done.stderr
    head = LabelHead.load(out / "team.safetensors")
    assert head.field == "team" and not head.multi
    team = json.loads(figures.read_text())["fields"]["team"]
    assert team["summary"]["train"] + team["summary"]["validation"] + team["summary"]["holdout"] == DECIDED + 40
    assert set(team["scores"]) == {head.scorer, "zero-shot"} and f'head = "{(out / "team.safetensors")}' in done.stdout


def test_a_tenant_without_decisions_has_nothing_to_fit_and_no_source_is_refused(decided, tiny_model_dir, tmp_path):
    out = tmp_path / "head.safetensors"
    env = fit_env(tiny_model_dir, decided)
    none = run(["ticketq", "fit", "--from-reviews", "--tenant", "beta", "--out", str(out)], env)
    assert none.returncode == EXIT_NOTHING and "at least 20" in none.stderr and not out.exists()
    nothing = run(["ticketq", "fit", "--out", str(out)], env)
    assert nothing.returncode == EXIT_USAGE and "--from-reviews" in nothing.stderr
