"""The HTTP gateway: the rules without Redis (tokens, buckets, signatures, mappings, the ticket
check), then a real uvicorn server (`python -m gateway`) in front of a real Redis and a
null-classifier worker: load with duplicate retries, bad input, webhooks, a full Redis."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import httpx
import pytest
import redis
from gateways import ADMIN, SECRETS, TOKEN, queued_tickets, running_gateway
from workers import RedisServer, null_classifier_service, wait_for

from gateway import webhooks
from gateway.auth import TokenBuckets, caller, token_digest
from gateway.intake import Refused, check_tickets, parse_body
from gateway.settings import GatewaySettings
from ticketq import codec
from ticketq.names import RESULTS_STREAM

pytestmark = pytest.mark.integration



# --- the rules, no Redis ---


def test_token_is_found_by_its_digest_only():
    tokens = {"helpdesk": token_digest("s3cret"), "other": token_digest("x")}
    assert caller("Bearer s3cret", tokens) == "helpdesk"
    assert caller("bearer  s3cret ", tokens) == "helpdesk"
    assert caller("Bearer wrong", tokens) is None
    assert caller("Basic s3cret", tokens) is None
    assert caller(None, tokens) is None


def test_token_bucket_allows_the_burst_then_the_rate():
    now = [0.0]
    buckets = TokenBuckets(rate=2.0, burst=3, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(0.5)
    assert buckets.take("b") == 0.0  # buckets are per caller
    now[0] = 0.5
    assert buckets.take("a") == 0.0
    assert TokenBuckets.retry_after(0.01) == 1


def zendesk_headers(secret: str, body: bytes, at: datetime | None = None) -> dict[str, str]:
    stamp = (at or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    digest = hmac.new(secret.encode(), stamp.encode() + body, hashlib.sha256).digest()
    return {"X-Zendesk-Webhook-Signature": base64.b64encode(digest).decode(),
            "X-Zendesk-Webhook-Signature-Timestamp": stamp, "Content-Type": "application/json"}  # fmt: skip


def hub_headers(secret: str, body: bytes) -> dict[str, str]:
    return {"X-Hub-Signature-256": "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest(),
            "Content-Type": "application/json"}  # fmt: skip


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def test_zendesk_signature_and_its_time_window():
    source, body = webhooks.DEFAULT_SOURCES["zendesk"], b'{"detail": {"id": 1}}'
    webhooks.verify(source, b"k", _lower(zendesk_headers("k", body)), body, 300)
    with pytest.raises(webhooks.BadSignature, match="does not match"):
        webhooks.verify(source, b"other", _lower(zendesk_headers("k", body)), body, 300)
    with pytest.raises(webhooks.BadSignature, match="does not match"):
        webhooks.verify(source, b"k", _lower(zendesk_headers("k", body)), body + b" ", 300)
    old = datetime.fromtimestamp(time.time() - 3600, timezone.utc)
    with pytest.raises(webhooks.BadSignature, match="outside the 300 s window"):
        webhooks.verify(source, b"k", _lower(zendesk_headers("k", body, old)), body, 300)
    with pytest.raises(webhooks.BadSignature, match="missing"):
        webhooks.verify(source, b"k", {}, body, 300)


def test_hub_signature():
    source, body = webhooks.DEFAULT_SOURCES["intercom"], b'{"data": {}}'
    webhooks.verify(source, b"k", _lower(hub_headers("k", body)), body, 300)
    with pytest.raises(webhooks.BadSignature, match="does not match"):
        webhooks.verify(source, b"k", _lower(hub_headers("k2", body)), body, 300)
    sha1 = "sha1=" + hmac.new(b"k", body, "sha1").hexdigest()
    webhooks.verify(source, b"k", {"x-hub-signature": sha1}, body, 300)  # Intercom's own header


def test_mapping_file_and_ticket_of(tmp_path):
    mapping = tmp_path / "sources.toml"
    mapping.write_text('[sources.desk]\nkind = "hub"\nid = "t.key"\nsubject = "t.title"\nbody = "t.lines.0"\n'
                       'schema = "triage"\n')  # fmt: skip
    source = webhooks.load_sources(str(mapping))["desk"]
    ticket = webhooks.ticket_of(source, {"t": {"key": 7, "title": "Refund", "lines": ["charged twice"]}})
    assert ticket == {"id": "desk:7", "text": "Refund\n\ncharged twice", "schema": "triage",
                      "metadata": {"source": "desk", "source_id": "7"}}  # fmt: skip
    with pytest.raises(webhooks.Unmapped, match=r"t\.lines\.0"):
        webhooks.ticket_of(source, {"t": {"key": 7}})


def test_ticket_check_names_each_bad_field():
    settings = GatewaySettings(gateway_schemas="triage", max_ticket_bytes=100)
    raws = [{"id": 1, "text": "ok"}, {"text": 5}, {"id": True, "text": "x"}, {"text": "y" * 200},
            {"text": "z", "schema": "nope"}, {"text": "z", "colour": "red"}, {"id": "1", "text": "dup"},
            {"text": "m", "metadata": [1]}, "not an object"]  # fmt: skip
    with pytest.raises(Refused) as refused:
        check_tickets(raws, settings)
    assert refused.value.status == 422
    got = [(e["index"], e["field"], e["reason"]) for e in refused.value.errors]
    assert got == [(1, "text", "wrong_type"), (2, "id", "wrong_type"), (3, "text", "oversize"),
                   (4, "schema", "unknown_schema"), (5, None, "unknown_field"), (6, "id", "duplicate_id"),
                   (7, "metadata", "wrong_type"), (8, None, "bad_payload")]  # fmt: skip
    assert "\n" not in refused.value.message
    assert [t.id for t in check_tickets([{"text": "a"}, {"text": "b"}], settings, "seed")] == ["seed-0", "seed-1"]


@pytest.mark.parametrize("body, reason", [(b"{nope", "invalid_json"), (b"[]", "bad_payload"), (b"3", "bad_payload"),
                                          (b"\xff\xfe", "invalid_json")])  # fmt: skip
def test_bodies_that_are_no_tickets(body, reason):
    with pytest.raises(Refused) as refused:
        parse_body(body)
    assert (refused.value.status, refused.value.reason) == (400, reason)


# --- a real server ---


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A private Redis, a null-classifier worker on a fresh queue, and a gateway in front."""
    workdir = tmp_path_factory.mktemp("gateway")
    with null_classifier_service(workdir, "gw") as (url, queue), running_gateway(workdir, url, queue) as gateway:
        yield url, queue, gateway


@pytest.fixture
def idle_gateway(service, tmp_path):
    """A gateway on a queue no worker consumes (what was enqueued stays to be counted), and a bucket
    of 40 requests that refills once per 20 s."""
    url, _, _ = service
    queue = f"idle-{uuid.uuid4().hex[:8]}"
    with running_gateway(tmp_path, url, queue, TICKETQ_GATEWAY_RATE="0.05", TICKETQ_GATEWAY_BURST="40") as gateway:
        yield gateway, queue


def _results_by_id(url: str) -> Counter:
    entries = redis.Redis.from_url(url).xrange(RESULTS_STREAM)
    return Counter(codec.loads(fields[b"data"])["id"] for _, fields in entries)


def test_load_with_duplicate_retries_answers_each_ticket_once(service):
    """2,000 tickets from 20 concurrent clients, 10 a POST; ~5% of POSTs sent again (half under their
    Idempotency-Key, half as bare repeats of the same ids): each ticket answered exactly once, each
    duplicate POST answered with the first POST's task ids."""
    url, _, gateway = service
    run = uuid.uuid4().hex[:6]
    batches = [[{"id": f"{run}-{n}", "text": f"ticket {n}: my invoice is wrong"} for n in range(start, start + 10)]
               for start in range(0, 2000, 10)]  # fmt: skip
    first: dict[int, list] = {}
    again: list[tuple[int, list]] = []
    lock = threading.Lock()

    def send(index: int) -> None:
        with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            headers = {"Idempotency-Key": f"{run}-batch-{index}"}
            response = client.post("/v1/tickets", json=batches[index], headers=headers)
            assert response.status_code == 202, response.text
            with lock:
                first[index] = response.json()["tickets"]
            if index % 20 == 0:  # ~5%: a client that did not see the answer sends the same POST again
                retry = client.post("/v1/tickets", json=batches[index], headers=headers if index % 40 else {})
                assert retry.status_code == 202, retry.text
                with lock:
                    again.append((index, retry.json()["tickets"]))

    with ThreadPoolExecutor(20) as pool:
        list(pool.map(send, range(len(batches))))
    assert len(again) == 10
    for index, rows in again:
        assert [r["task_id"] for r in rows] == [r["task_id"] for r in first[index]]
        assert {r["status"] for r in rows} <= {"accepted", "duplicate"}
    ids = {ticket["id"] for batch in batches for ticket in batch}
    wait_for(lambda: ids <= set(_results_by_id(url)), 120, "a result for every ticket")
    counts = _results_by_id(url)
    assert {ticket_id: counts[ticket_id] for ticket_id in ids if counts[ticket_id] != 1} == {}
    sample = gateway.client.get(f"/v1/tickets/{run}-7")
    assert sample.status_code == 200 and sample.json()["status"] == "ok"
    assert sample.json()["task_id"] == first[0][7]["task_id"]


def test_get_pending_unknown_and_long_poll(service, idle_gateway):
    gateway, _ = idle_gateway
    assert gateway.client.post("/v1/tickets", json={"id": "p1", "text": "no worker here"}).status_code == 202
    assert gateway.client.get("/v1/tickets/p1").status_code == 202
    started = time.monotonic()
    assert gateway.client.get("/v1/tickets/p1", params={"wait": 1}).status_code == 202
    assert time.monotonic() - started >= 0.9  # it waited
    assert gateway.client.get("/v1/tickets/never-sent").status_code == 404
    _, _, served = service
    assert served.client.post("/v1/tickets", json={"id": "lp-1", "text": "please reset my password"}).status_code == 202
    done = served.client.get("/v1/tickets/lp-1", params={"wait": 20})
    assert done.status_code == 200 and done.json()["id"] == "lp-1"


def _queued_ids(url: str, queue: str) -> list[str]:
    return [ticket["id"] for ticket in queued_tickets(url, queue)]


def test_bad_input_is_refused_with_a_reason_and_nothing_enqueued(service, idle_gateway):
    url, _, _ = service
    gateway, queue = idle_gateway
    post = gateway.client.post
    cases = [
        (post("/v1/tickets", content=b"{not json", headers={"Content-Type": "application/json"}), 400, "invalid_json"),
        (post("/v1/tickets", json={"text": 42}), 422, "invalid_tickets"),
        (post("/v1/tickets", json={"text": "x", "schema": "nope"}), 422, "invalid_tickets"),
        (post("/v1/tickets", content=b"x" * 1_000_000), 413, "body_too_large"),
        (httpx.post(gateway.url + "/v1/tickets", json={"text": "x"}), 401, "unauthorized"),
        (httpx.post(gateway.url + "/v1/tickets", json={"text": "x"}, headers={"Authorization": "Bearer nope"}),
         401, "unauthorized"),
    ]  # fmt: skip
    body = json.dumps({"detail": {"id": 9, "subject": "s", "description": "d"}}).encode()
    old = datetime.fromtimestamp(time.time() - 3600, timezone.utc)
    cases += [
        (post("/v1/webhooks/zendesk", content=body, headers=zendesk_headers("wrong", body)), 401, "bad_signature"),
        (post("/v1/webhooks/zendesk", content=body, headers=zendesk_headers(SECRETS["zendesk"], body, old)), 401,
         "bad_signature"),
        (post("/v1/webhooks/intercom", content=body, headers=hub_headers("wrong", body)), 401, "bad_signature"),
        (post("/v1/webhooks/nowhere", content=body), 404, "unknown_source"),
    ]  # fmt: skip
    for response, status, reason in cases:
        assert (response.status_code, response.json()["error"]) == (status, reason), response.text
        assert response.json()["message"] and "\n" not in response.json()["message"]
    assert cases[1][0].json()["errors"][0]["field"] == "text"
    assert "65536" in cases[3][0].json()["message"]  # the limit is named
    assert _queued_ids(url, queue) == []
    assert post("/v1/tickets", json={"id": "good", "text": "fine"}).status_code == 202  # the check can fail
    assert _queued_ids(url, queue) == ["good"]
    metrics = gateway.client.get("/metrics", headers=ADMIN).text
    assert 'ticketq_gateway_rejects_total{reason="bad_signature"} 3.0' in metrics


def test_rate_limit_answers_429_with_retry_after(idle_gateway):
    gateway, _ = idle_gateway
    responses = [gateway.client.get("/v1/tickets/none") for _ in range(60)]  # a burst of 40, then 1 per 20 s
    limited = [response for response in responses if response.status_code == 429]
    assert responses[0].status_code == 404 and len(limited) >= 10
    assert all(int(response.headers["Retry-After"]) >= 1 for response in limited)
    assert limited[0].json()["error"] == "rate_limited"


def test_signed_webhooks_become_tickets_and_replays_are_no_ops(service):
    _, _, gateway = service
    detail = {"id": 4711, "subject": "Refund", "description": "charged twice"}
    zendesk = json.dumps({"type": "zen:event-type:ticket.created", "detail": detail}).encode()
    headers = zendesk_headers(SECRETS["zendesk"], zendesk)
    first = httpx.post(gateway.url + "/v1/webhooks/zendesk", content=zendesk, headers=headers)
    assert first.status_code == 202, first.text
    replay = httpx.post(gateway.url + "/v1/webhooks/zendesk", content=zendesk, headers=headers)
    assert replay.json()["tickets"][0]["task_id"] == first.json()["tickets"][0]["task_id"]
    intercom = json.dumps({"topic": "conversation.user.created", "data": {"item": {
        "id": "c-1", "source": {"subject": "", "body": "cannot log in"}}}}).encode()  # fmt: skip
    accepted = httpx.post(gateway.url + "/v1/webhooks/intercom", content=intercom,
                          headers=hub_headers(SECRETS["intercom"], intercom))  # fmt: skip
    assert accepted.status_code == 202, accepted.text
    for ticket_id in ("zendesk:4711", "intercom:c-1"):
        done = gateway.client.get(f"/v1/tickets/{ticket_id}", params={"wait": 20})
        assert done.status_code == 200, done.text


def test_ops_endpoints(service):
    _, _, gateway = service
    assert httpx.get(gateway.url + "/healthz").json() == {"status": "ok"}
    assert httpx.get(gateway.url + "/readyz").status_code == 200
    assert "/v1/tickets" in httpx.get(gateway.url + "/openapi.json", headers=ADMIN).json()["paths"]
    assert httpx.get(gateway.url + "/docs", headers=ADMIN).status_code == 200
    assert "ticketq_gateway_request_seconds_bucket" in httpx.get(gateway.url + "/metrics", headers=ADMIN).text
    for path in ("/metrics", "/docs", "/openapi.json"):  # admin only: the tickets' token is not enough
        refused = gateway.client.get(path)
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"].startswith("Bearer")


def test_full_redis_answers_503_and_every_202_is_kept(tmp_path):
    """Redis under maxmemory + noeviction, nobody consuming: POSTs fill it until it refuses writes.
    Every answer is a 202 or a 503/429 with Retry-After, and every 202'd ticket is in the queue."""
    server = RedisServer(tmp_path, aof=False, args=["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]).start()
    queue = f"full-{uuid.uuid4().hex[:8]}"
    try:
        with running_gateway(tmp_path, server.url, queue) as gateway:
            accepted, refused = [], []
            for n in range(400):  # ~4 KB a ticket: Redis is full long before
                batch = [{"id": f"t{n}-{i}", "text": f"{n} {i} " + "x" * 4000} for i in range(5)]
                response = gateway.client.post("/v1/tickets", json=batch)
                if response.status_code == 202:
                    accepted += [ticket["id"] for ticket in batch]
                    continue
                assert response.status_code in (429, 503), response.text
                assert int(response.headers["Retry-After"]) >= 1
                refused.append(response.json()["error"])
                if len(refused) >= 5:
                    break
            assert accepted and refused, (len(accepted), refused)
            assert set(refused) <= {"redis_refused_write", "queue_full"}
            assert set(accepted) <= set(_queued_ids(server.url, queue))
    finally:
        server.kill()


def test_redis_killed_mid_load_answers_503_and_keeps_every_202(redis_server, tmp_path):
    """Redis (AOF, fsync always) killed -9 between POSTs, then restarted: every answer is a 202 or a
    503 with Retry-After, and every 202'd ticket is in the queue after the restart."""
    queue = f"killed-{uuid.uuid4().hex[:8]}"
    statuses: list[int] = []
    accepted: list[str] = []
    with running_gateway(tmp_path, redis_server.url, queue, TICKETQ_GATEWAY_SEND_RETRY_S="0.5") as gateway:
        for n in range(45):
            if n == 15:
                redis_server.kill()
            if n == 30:
                redis_server.start()
            batch = [{"id": f"k{n}-{i}", "text": f"ticket {n} {i}"} for i in range(5)]
            response = gateway.client.post("/v1/tickets", json=batch)
            statuses.append(response.status_code)
            if response.status_code == 202:
                accepted += [ticket["id"] for ticket in batch]
            else:
                assert response.status_code == 503, response.text
                assert response.json()["error"] == "redis_unavailable"
                assert int(response.headers["Retry-After"]) >= 1
    assert set(statuses[:15]) == {202} and set(statuses[15:30]) == {503}
    assert 202 in statuses[30:]  # the gateway found Redis again
    assert len(accepted) >= 75 and set(accepted) <= set(_queued_ids(redis_server.url, queue))
