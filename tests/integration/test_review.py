"""The review page without a browser: the store on a private redis-server, and a real gateway
(`python -m gateway`, uvicorn) in front of it.

Review items are written by the worker's own publish path (`Outbox.publish`, the script a worker
runs), for two tenants. A decision is written once: threads racing on one item write one record;
a second reviewer is told who decided first; another tenant neither sees nor decides an item. The
gateway's page logs in with a form, sets an HttpOnly SameSite=Strict cookie, refuses a post without
its CSRF token, counts decisions, and `ticketq reviews export` writes exactly the decisions as the
labelled file `ticketq eval` reads.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from gateways import ADMIN, running_gateway
from servers import require_redis_server
from workers import ROOT, RedisServer

from gateway.auth import token_digest
from gateway.review.store import Item, ReviewStore
from ticketq.names import LABELLED_STREAM, RESULTS_STREAM, REVIEW_GROUP, REVIEW_STREAM
from worker.health import Health
from worker.redis.outbox import Outbox

pytestmark = pytest.mark.integration

ACME, BETA = "acme-token-" + uuid.uuid4().hex, "beta-token-" + uuid.uuid4().hex
TOKENS = f"alice@acme:{token_digest(ACME)},bob@beta:{token_digest(BETA)}"
SECRET = "review-secret-" + "x" * 32
LABELS = ("billing", "technical", "account")


def result(wire_id: str, label: str = "technical") -> dict:
    probs = {name: (0.4 if name == label else 0.3) for name in LABELS}
    return {
        "id": wire_id,
        "task_id": "t",
        "status": "ok",
        "schema": "review-all",
        "review": True,
        "model": "stand-in",
        "standin": True,
        "fields": {"team": {"label": label, "probs": probs, "confidence": 0.1, "review": True}},
    }


def seed(client: redis.Redis, tickets: dict[str, str]) -> None:
    """Publish results flagged for review (wire id -> text) as a worker does."""
    task = f"review-{uuid.uuid4().hex}"
    slots = [(task, n, json.dumps(result(wire)).encode()) for n, wire in enumerate(tickets)]
    review = {(task, n): text for n, text in enumerate(tickets.values())}
    outbox = Outbox(client, Health(), stream_maxlen=100_000, result_expires_s=600, worst_batch_s=5)
    outbox.publish(slots, [task], review)


@pytest.fixture
def server(tmp_path) -> Iterator[RedisServer]:
    require_redis_server()
    redis_server = RedisServer(tmp_path, aof=False).start()
    yield redis_server
    redis_server.stop()


def store(server: RedisServer) -> ReviewStore:
    return ReviewStore(server.client(), multi_tenant=True, decision_ttl_s=600, stream_maxlen=100_000)


def labelled_records(client: redis.Redis) -> list[dict]:
    return [json.loads(fields[b"data"]) for _, fields in client.xrange(LABELLED_STREAM)]


def test_each_tenant_sees_its_own_items_oldest_first(server):
    client = server.client()
    seed(client, {"acme:A1": "acme one", "beta:B1": "beta one", "acme:A2": "acme two", "loose": "no tenant"})
    reviews = store(server)
    assert [(i.id, i.text) for i in reviews.pending("acme", 10)] == [("A1", "acme one"), ("A2", "acme two")]
    assert [i.id for i in reviews.pending("beta", 10)] == ["B1"]
    assert [i.id for i in reviews.pending("default", 10)] == ["loose"]
    assert [i.id for i in reviews.pending("acme", 1)] == ["A1"]
    first = reviews.pending("acme", 1)[0]
    assert reviews.item("beta", first.review_id) is None, "another tenant's item is not found"
    assert reviews.decide(first, {"team": "billing"}, "bob@beta", 1.0).written, "decided as its own tenant's"


def test_a_decision_is_written_once_and_the_second_reviewer_is_told_who_was_first(server):
    client = server.client()
    seed(client, {"acme:A1": "acme one", "acme:A2": "acme two"})
    reviews = store(server)
    one, two = reviews.pending("acme", 10)
    first = reviews.decide(one, {"team": "billing"}, "alice@acme", 100.0)
    again = reviews.decide(one, {"team": "account"}, "carol@acme", 101.0)
    assert first.written and not again.written
    assert again.record["reviewer"] == "alice@acme" and again.record["expected"] == {"team": "billing"}
    assert [i.id for i in reviews.pending("acme", 10)] == ["A2"], "a decided item leaves the list"
    records = labelled_records(client)
    assert [(r["id"], r["tenant"], r["expected"], r["corrected"], r["reviewer"]) for r in records] == [
        ("A1", "acme", {"team": "billing"}, ["team"], "alice@acme")]  # fmt: skip
    assert client.xpending(REVIEW_STREAM, REVIEW_GROUP)["pending"] == 1, "acked in the review stream"
    as_beta = Item(two.review_id, two.id, "beta", two.text, two.result)  # acme's item, claimed as beta's
    assert not reviews.decide(as_beta, {"team": "billing"}, "bob@beta", 1.0).written, "not pending for beta"


def test_reviewers_racing_on_one_item_write_one_decision(server):
    client = server.client()
    seed(client, {f"acme:R{n}": f"race {n}" for n in range(5)})
    items = store(server).pending("acme", 10)
    barrier, written = threading.Barrier(8), []

    def reviewer(n: int) -> None:
        reviews = store(server)  # a client of its own, like a gateway replica
        barrier.wait()
        for item in items:
            written.append((item.id, reviews.decide(item, {"team": LABELS[n % 3]}, f"r{n}@acme", n).written))

    threads = [threading.Thread(target=reviewer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(i for i, won in written if won) == [f"R{n}" for n in range(5)], "one winner per item"
    assert sorted(r["id"] for r in labelled_records(client)) == [f"R{n}" for n in range(5)]


def login(gateway_url: str, token: str) -> httpx.Client:
    client = httpx.Client(base_url=gateway_url, timeout=30)
    answer = client.post("/review/login", data={"token": token})
    assert answer.status_code == 303, answer.text
    attributes = answer.headers["set-cookie"].lower().split("; ")
    assert "httponly" in attributes and "samesite=strict" in attributes and "path=/review" in attributes
    assert token not in answer.headers["set-cookie"], "the token itself is never in the cookie"
    return client


def csrf_of(page: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', page).group(1)


def test_the_gateway_page_logs_in_decides_once_and_keeps_tenants_apart(server, tmp_path):
    client = server.client()
    seed(client, {"acme:A1": "acme <b>one</b>", "acme:A2": "acme two", "beta:B1": "beta one"})
    env = {"TICKETQ_GATEWAY_TOKENS": TOKENS, "TICKETQ_GATEWAY_REVIEW_SECRET": SECRET,
           "TICKETQ_GATEWAY_REVIEW_INSECURE_COOKIE": "1"}  # fmt: skip
    with running_gateway(tmp_path, server.url, "review", **env) as gateway:
        assert "Log in" in httpx.get(gateway.url + "/review").text
        assert httpx.post(gateway.url + "/review/login", data={"token": "nope"}).status_code == 401
        acme = login(gateway.url, ACME)
        page = acme.get("/review").text
        assert "acme &lt;b&gt;one&lt;/b&gt;" in page and "beta one" not in page, "escaped, and acme's only"
        one = store(server).pending("acme", 10)[0]
        form = {"field:team": "billing"}
        assert acme.post(f"/review/items/{one.review_id}", data=form).status_code == 403, "no CSRF token"
        assert acme.post(f"/review/items/{one.review_id}", data={**form, "csrf": csrf_of(page)}).status_code == 303
        again = acme.post(f"/review/items/{one.review_id}", data={**form, "csrf": csrf_of(page)})
        assert again.status_code == 409 and "already decided by alice@acme" in again.text
        beta = {"Authorization": f"Bearer {BETA}"}
        assert "acme two" not in httpx.get(gateway.url + "/review", headers=beta).text
        two = store(server).pending("acme", 10)[0]
        refused = httpx.post(f"{gateway.url}/review/items/{two.review_id}", data=form, headers=beta)
        assert refused.status_code == 404, "another tenant's item is not found"
        metrics = httpx.get(gateway.url + "/metrics", headers=ADMIN).text
        assert 'ticketq_gateway_review_decisions_total{outcome="corrected",queue="review"} 1.0' in metrics
        assert 'ticketq_gateway_review_conflicts_total{queue="review"} 1.0' in metrics
    assert [(r["id"], r["reviewer"]) for r in labelled_records(client)] == [("A1", "alice@acme")]


def test_the_page_is_off_without_a_secret_and_its_cookie_is_secure_by_default(server, tmp_path):
    with running_gateway(tmp_path, server.url, "review", TICKETQ_GATEWAY_TOKENS=TOKENS) as gateway:
        assert httpx.get(gateway.url + "/review").json()["error"] == "review_off"
    env = {"TICKETQ_GATEWAY_TOKENS": TOKENS, "TICKETQ_GATEWAY_REVIEW_SECRET": SECRET}
    with running_gateway(tmp_path, server.url, "review", **env) as gateway:
        answer = httpx.post(gateway.url + "/review/login", data={"token": ACME})
        assert "secure" in answer.headers["set-cookie"].lower().split("; ")


def test_export_writes_the_decisions_as_a_labelled_file(server, tmp_path):
    client = server.client()
    seed(client, {"acme:A1": "acme one", "acme:A2": "acme two", "beta:B1": "beta one"})
    reviews = store(server)
    for item in reviews.pending("acme", 10) + reviews.pending("beta", 10):
        reviews.decide(item, {"team": "account"}, f"someone@{item.tenant}", 1.0)
    client.xadd(LABELLED_STREAM, {"data": "not a record"})  # skipped, not fatal
    out = tmp_path / "labelled.jsonl"
    env = {"TICKETQ_BROKER_URL": server.url, "PATH": str(Path(sys.executable).parent)}
    run = subprocess.run([sys.executable, "-m", "ticketq_cli", "reviews", "export", "--out", str(out), "--tenant",
                          "acme"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"id": "A1", "text": "acme one", "schema": "review-all", "expected": {"team": "account"}},
        {"id": "A2", "text": "acme two", "schema": "review-all", "expected": {"team": "account"}},
    ]
    assert "2 decision(s), 2 corrected" in run.stdout


def test_with_delivery_on_the_reviewed_result_joins_the_results_stream_once(server):
    client = server.client()
    seed(client, {"acme:A1": "acme one"})
    reviews = ReviewStore(client, multi_tenant=True, decision_ttl_s=600, stream_maxlen=100_000, deliver=True)
    before = client.xlen(RESULTS_STREAM)
    one = reviews.pending("acme", 10)[0]
    assert reviews.decide(one, {"team": "account"}, "alice@acme", 1.0).written
    assert not reviews.decide(one, {"team": "billing"}, "carol@acme", 2.0).written
    added = [json.loads(fields[b"data"]) for _, fields in client.xrange(RESULTS_STREAM)][before:]
    assert len(added) == 1 and added[0]["id"] == "acme:A1", "the wire id: the dispatcher finds its metadata"
    assert added[0]["fields"]["team"]["label"] == "account" and added[0]["review"] is False
    assert added[0]["reviewed"] == {"by": "alice@acme", "at": "1970-01-01T00:00:01.000Z", "corrected": ["team"]}
