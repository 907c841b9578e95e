"""The gateway's security block (issue 42): tenants kept apart (ids, Idempotency-Keys, reads and
dedup per tenant, the same id in two tenants classified twice), the Idempotency-Key claim under
concurrent POSTs, admin-only endpoints, and uvicorn's header and slow-body limits. A real uvicorn
in front of a private Redis and a null-classifier worker, as in test_gateway."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from gateways import queued_tickets, running_gateway
from test_gateway import zendesk_headers
from workers import null_classifier_service, wait_for

from gateway.auth import tenant_of, token_digest
from gateway.keys import TICKET_KEY
from gateway.settings import GatewaySettings
from ticketq import codec
from ticketq.config import SettingsError
from ticketq.names import RESULTS_STREAM

pytestmark = pytest.mark.integration

ALPHA, BETA = "alpha-" + uuid.uuid4().hex, "beta-" + uuid.uuid4().hex
TENANT_TOKENS = f"a1@alpha:{token_digest(ALPHA)},b1@beta:{token_digest(BETA)}"


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- the rules, no Redis ---


def test_a_token_belongs_to_its_tenant():
    assert tenant_of("helpdesk") == "default" and tenant_of("a1@alpha") == "alpha"
    assert not GatewaySettings(gateway_tokens=f"helpdesk:{token_digest('x')}").multi_tenant
    assert GatewaySettings(gateway_tokens=TENANT_TOKENS).multi_tenant
    with pytest.raises((SettingsError, ValueError), match="tenant name"):
        GatewaySettings(gateway_tokens=f"a@b.d:{token_digest('x')}")


# --- a real server ---


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A private Redis, a null-classifier worker and a gateway with the tenants alpha and beta."""
    workdir = tmp_path_factory.mktemp("tenants")
    secrets = "zendesk@alpha=alpha-zd,zendesk@beta=beta-zd"
    with null_classifier_service(workdir, "tn") as (url, queue), \
            running_gateway(workdir, url, queue, TICKETQ_GATEWAY_TOKENS=TENANT_TOKENS,
                            TICKETQ_GATEWAY_WEBHOOK_SECRETS=secrets) as gateway:  # fmt: skip
        yield url, queue, gateway


def _results_by_id(url: str) -> Counter:
    entries = redis.Redis.from_url(url).xrange(RESULTS_STREAM)
    return Counter(codec.loads(fields[b"data"])["id"] for _, fields in entries)


def test_two_tenants_never_read_shadow_or_suppress_each_other(service):
    url, queue, gateway = service
    ticket_id = f"4711-{uuid.uuid4().hex[:6]}"
    with httpx.Client(base_url=gateway.url, headers=_auth(ALPHA), timeout=60) as alpha, \
            httpx.Client(base_url=gateway.url, headers=_auth(BETA), timeout=60) as beta:  # fmt: skip
        first = alpha.post("/v1/tickets", json={"id": ticket_id, "text": "refund please", "metadata": {"who": "a"}})
        assert first.status_code == 202, first.text
        done = alpha.get(f"/v1/tickets/{ticket_id}", params={"wait": 20})
        assert done.status_code == 200 and done.json()["id"] == ticket_id
        assert beta.get(f"/v1/tickets/{ticket_id}").status_code == 404  # beta cannot read alpha's ticket
        assert beta.get(f"/v1/tickets/alpha:{ticket_id}").status_code == 404  # nor by its sent id
        second = beta.post("/v1/tickets", json={"id": ticket_id, "text": "login broken", "metadata": {"who": "b"}})
        assert second.status_code == 202, second.text
        row_a, row_b = first.json()["tickets"][0], second.json()["tickets"][0]
        assert row_b["status"] == "accepted" and row_b["task_id"] != row_a["task_id"]  # not shadowed
        read_b = beta.get(f"/v1/tickets/{ticket_id}", params={"wait": 20})
        assert read_b.status_code == 200 and read_b.json()["task_id"] == row_b["task_id"]
        again = alpha.post("/v1/tickets", json={"id": ticket_id, "text": "refund please"})
        assert again.json()["tickets"][0] == {**row_a, "status": "duplicate"}  # still deduplicated in its tenant
        key = {"Idempotency-Key": f"shared-{ticket_id}"}  # a key is per tenant too: neither is a 422
        assert alpha.post("/v1/tickets", json={"text": "a"}, headers=key).status_code == 202
        assert beta.post("/v1/tickets", json={"text": "b"}, headers=key).status_code == 202
    wanted = {f"alpha:{ticket_id}", f"beta:{ticket_id}"}
    wait_for(lambda: wanted <= set(_results_by_id(url)), 60, "a result for each tenant's ticket")
    counts = _results_by_id(url)
    assert {name: counts[name] for name in wanted} == {name: 1 for name in wanted}  # classified twice, once each
    client = redis.Redis.from_url(url)
    for tenant, who in (("alpha", "a"), ("beta", "b")):
        marker = json.loads(client.get(TICKET_KEY.format(queue=queue, ticket_id=f"{tenant}:{ticket_id}")))
        assert (marker["tenant"], marker["metadata"]) == (tenant, {"who": who})  # the result is attributable


def test_a_tenants_webhook_source_takes_its_secret_and_feeds_its_tenant(service):
    _, _, gateway = service
    source_id = uuid.uuid4().hex[:8]
    body = json.dumps({"detail": {"id": source_id, "subject": "Refund", "description": "charged twice"}}).encode()
    url = gateway.url + "/v1/webhooks/zendesk@alpha"
    wrong = httpx.post(url, content=body, headers=zendesk_headers("beta-zd", body))
    assert (wrong.status_code, wrong.json()["error"]) == (401, "bad_signature")  # beta's secret is not alpha's
    signed = httpx.post(url, content=body, headers=zendesk_headers("alpha-zd", body))
    assert signed.status_code == 202, signed.text
    assert httpx.get(gateway.url + f"/v1/tickets/zendesk:{source_id}", headers=_auth(ALPHA),
                     params={"wait": 20}).status_code == 200  # fmt: skip
    assert httpx.get(gateway.url + f"/v1/tickets/zendesk:{source_id}", headers=_auth(BETA)).status_code == 404


def _queued_ids(url: str, queue: str) -> list[str]:
    return [ticket["id"] for ticket in queued_tickets(url, queue)]


@pytest.fixture
def idle_gateway(service, tmp_path):
    """A gateway on a queue no worker consumes: what was enqueued stays to be counted."""
    url, _, _ = service
    queue = f"idle-{uuid.uuid4().hex[:8]}"
    limits = {"TICKETQ_GATEWAY_BODY_TIMEOUT_S": "1", "TICKETQ_GATEWAY_HEADER_TIMEOUT_S": "1"}
    with running_gateway(tmp_path, url, queue, TICKETQ_GATEWAY_TOKENS=TENANT_TOKENS, **limits) as gateway:
        yield url, queue, gateway


def test_one_idempotency_key_two_bodies_at_once_queues_one(idle_gateway):
    """20 pairs, each the same key with two bodies released together: one 202 and one 422 a pair,
    and only the 202's tickets queued."""
    url, queue, gateway = idle_gateway
    pairs = 20
    barrier = threading.Barrier(2 * pairs)

    def send(index: int) -> tuple[int, int, httpx.Response]:
        pair, side = divmod(index, 2)
        body = [{"id": f"p{pair}-{side}-{n}", "text": f"body {side} of pair {pair}"} for n in range(3)]
        with httpx.Client(base_url=gateway.url, headers=_auth(ALPHA), timeout=60) as client:
            barrier.wait(timeout=60)
            return pair, side, client.post("/v1/tickets", json=body, headers={"Idempotency-Key": f"race-{pair}"})

    with ThreadPoolExecutor(2 * pairs) as pool:
        answers = list(pool.map(send, range(2 * pairs)))
    winners = {}
    for pair in range(pairs):
        got = sorted((response.status_code, side) for p, side, response in answers if p == pair)
        assert [status for status, _ in got] == [202, 422], [r.text for p, _, r in answers if p == pair]
        winners[pair] = got[0][1]
    refused = [response for _, _, response in answers if response.status_code == 422]
    assert {response.json()["error"] for response in refused} == {"idempotency_key_reused"}
    expected = {f"alpha:p{pair}-{side}-{n}" for pair, side in winners.items() for n in range(3)}
    assert sorted(_queued_ids(url, queue)) == sorted(expected)


def test_one_idempotency_key_one_body_at_once_is_answered_once(idle_gateway):
    """The same key and body from 8 clients together: 202s with the same tickets, or 409 with
    Retry-After while the first is in flight; the tickets queued once."""
    url, queue, gateway = idle_gateway
    barrier = threading.Barrier(8)
    body = [{"id": f"same-{n}", "text": "the same body"} for n in range(3)]

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=gateway.url, headers=_auth(BETA), timeout=60) as client:
            barrier.wait(timeout=60)
            return client.post("/v1/tickets", json=body, headers={"Idempotency-Key": "same-body"})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, range(8)))
    accepted = [answer for answer in answers if answer.status_code == 202]
    in_flight = [answer for answer in answers if answer.status_code == 409]
    assert accepted and len(accepted) + len(in_flight) == 8, [answer.text for answer in answers]
    assert all(answer.headers["Retry-After"] == "1" for answer in in_flight)
    assert {json.dumps(answer.json(), sort_keys=True) for answer in accepted} == {
        json.dumps(accepted[0].json(), sort_keys=True)}  # fmt: skip
    assert sorted(_queued_ids(url, queue)) == [f"beta:same-{n}" for n in range(3)]


def test_admin_endpoints_are_off_without_admin_tokens(idle_gateway, tmp_path):
    url, queue, _ = idle_gateway
    with running_gateway(tmp_path, url, queue, TICKETQ_GATEWAY_ADMIN_TOKENS="") as gateway:
        for path in ("/metrics", "/docs", "/openapi.json"):
            answer = gateway.client.get(path)
            assert (answer.status_code, answer.json()["error"]) == (404, "admin_off")
        unauthorized = httpx.post(gateway.url + "/v1/tickets", json={"text": "x"})
        assert unauthorized.status_code == 401 and unauthorized.headers["WWW-Authenticate"].startswith("Bearer")


def _raw_exchange(port: int, request: bytes) -> bytes:
    """Send `request`; read until the server answers or closes (a socket timeout after 60 s fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
        return b"".join(chunks)


def test_a_huge_header_and_a_stalled_body_are_cut(idle_gateway):
    _, _, gateway = idle_gateway
    # Above TICKETQ_GATEWAY_MAX_HEADER_BYTES (16 KiB): refused, or the connection closed on it.
    with contextlib.suppress(httpx.TransportError):
        assert httpx.get(gateway.url + "/healthz", headers={"X-Filler": "x" * 200_000}).status_code in (400, 431)
    assert httpx.get(gateway.url + "/healthz", headers={"X-Filler": "x" * 8_000}).status_code == 200
    head = (f"POST /v1/tickets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ALPHA}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"text\": ").encode()  # fmt: skip
    answer = _raw_exchange(gateway.port, head)  # 991 bytes never come: cut after TICKETQ_GATEWAY_BODY_TIMEOUT_S
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    slow_head = _raw_exchange(gateway.port, b"POST /v1/tickets HTTP/1.1\r\nHost: x\r\n")  # and no more headers
    assert slow_head == b""  # closed after TICKETQ_GATEWAY_HEADER_TIMEOUT_S, unanswered
