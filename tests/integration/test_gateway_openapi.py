"""The OpenAPI document against real answers (issue 42): each documented status of each route is
produced by a real request to a real uvicorn, its body matches the documented schema, and no
answer has a status the document does not list for its route. /docs loads nothing from outside."""

from __future__ import annotations

import hashlib
import json
import uuid

import httpx
import pytest
import redis
from gateways import ADMIN, SECRETS, TOKEN, running_gateway
from test_gateway import zendesk_headers
from test_gateway_errors import raw_request
from workers import free_port, null_classifier_service

from gateway.keys import IDEMPOTENCY_KEY, TICKET_KEY

pytestmark = pytest.mark.integration


def matches(value: object, schema: dict, components: dict) -> bool:
    """`value` fits `schema` (the subset the gateway's document uses: $ref, type, required, enum, properties, items)."""
    if "$ref" in schema:
        return matches(value, components[schema["$ref"].rsplit("/", 1)[1]], components)
    if "anyOf" in schema:
        return any(matches(value, option, components) for option in schema["anyOf"])
    kinds = schema.get("type")
    types = {"object": dict, "array": list, "string": str, "integer": int, "null": type(None), "boolean": bool}
    if kinds and not any(isinstance(value, types[k]) for k in ([kinds] if isinstance(kinds, str) else kinds)):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, dict):
        if not set(schema.get("required", ())) <= set(value):
            return False
        return all(matches(value[k], sub, components) for k, sub in schema.get("properties", {}).items() if k in value)
    if isinstance(value, list) and "items" in schema:
        return all(matches(item, schema["items"], components) for item in value)
    return True


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """A served gateway (1 s body timeout) and one in front of no Redis (rate 2 at
    once, no admin tokens), as (redis url, queue, served, dead)."""
    workdir = tmp_path_factory.mktemp("gw-openapi")
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    with null_classifier_service(workdir, "gwo") as (url, queue), \
            running_gateway(workdir, url, queue, TICKETQ_GATEWAY_BODY_TIMEOUT_S="1") as served, \
            running_gateway(workdir, nowhere, "nowhere", TICKETQ_GATEWAY_RATE="0.01", TICKETQ_GATEWAY_BURST="3",
                            TICKETQ_GATEWAY_ADMIN_TOKENS="", TICKETQ_GATEWAY_SEND_RETRY_S="0") as dead:  # fmt: skip
        yield url, queue, served, dead


def _slow_body(gateway, path: str) -> tuple[int, bytes]:
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode()  # fmt: skip
    status, _, body = raw_request(gateway.url, head)
    return status, body


def _answers(url: str, queue: str, served, dead) -> list[tuple[str, str, int, bytes]]:
    """(route, method, status, body) of requests meant to produce every documented status."""
    out, client, anonymous = [], served.client, httpx.Client(base_url=served.url, timeout=30)

    def add(route: str, method: str, response: httpx.Response) -> None:
        out.append((route, method, response.status_code, response.content))

    tickets, one = "/v1/tickets", "/v1/tickets/{ticket_id}"
    first = {"id": f"oa-{uuid.uuid4().hex[:6]}", "text": "refund please"}
    key = {"Idempotency-Key": uuid.uuid4().hex}
    add(tickets, "post", client.post(tickets, json=first, headers=key))
    add(tickets, "post", client.post(tickets, json=first, headers=key))  # replayed: 202, as documented
    add(tickets, "post", client.post(tickets, content=b"{nope", headers={"Content-Type": "application/json"}))
    add(tickets, "post", anonymous.post(tickets, json=first))
    add(tickets, "post", client.put(tickets, json=first))
    out.append((tickets, "post", *_slow_body(served, tickets)))
    body = json.dumps({"text": "held"}).encode()
    held = uuid.uuid4().hex  # a key whose first POST is "still in flight": its claim, without an answer
    redis.Redis.from_url(url).set(IDEMPOTENCY_KEY.format(tenant="default", digest=hashlib.sha256(held.encode())
                                  .hexdigest()), json.dumps({"body": hashlib.sha256(body).hexdigest(),
                                  "answer": None, "claim": "x"}), ex=60)  # fmt: skip
    add(tickets, "post", client.post(tickets, content=body, headers={"Idempotency-Key": held}))
    add(tickets, "post", client.post(tickets, content=b"x" * 70_000))
    add(tickets, "post", client.post(tickets, json={"text": 42}))
    for _ in range(2):  # the dead gateway: 503 until its token's bucket of 3 is empty, then 429
        add(tickets, "post", dead.client.post(tickets, json=first))
        add(one, "get", dead.client.get("/v1/tickets/x"))
    add(tickets, "post", dead.client.post(tickets, json=first))
    add(one, "get", client.get(f"/v1/tickets/{first['id']}", params={"wait": 20}))
    redis.Redis.from_url(url).set(TICKET_KEY.format(queue=queue, ticket_id="marked"), json.dumps({"task_id": "t"}))
    add(one, "get", client.get("/v1/tickets/marked"))  # accepted (its record), no result: 202 pending
    add(one, "get", client.get("/v1/tickets/x", params={"wait": "soon"}))
    add(one, "get", anonymous.get("/v1/tickets/x"))
    add(one, "get", client.get("/v1/tickets/never-sent"))
    add(one, "get", client.post("/v1/tickets/x"))
    return out + _more_answers(served, dead, anonymous)


def _more_answers(served, dead, anonymous) -> list[tuple[str, str, int, bytes]]:
    out, client, hook = [], served.client, "/v1/webhooks/{source}"

    def add(route: str, method: str, response: httpx.Response) -> None:
        out.append((route, method, response.status_code, response.content))

    ok = json.dumps({"detail": {"id": uuid.uuid4().hex[:8], "subject": "s", "description": "d"}}).encode()
    signed = zendesk_headers(SECRETS["zendesk"], ok)
    add(hook, "post", client.post("/v1/webhooks/zendesk", content=ok, headers=signed))
    add(hook, "post", client.post("/v1/webhooks/zendesk", content=b"[1", headers=zendesk_headers(SECRETS["zendesk"],
                                                                                                  b"[1")))  # fmt: skip
    add(hook, "post", client.post("/v1/webhooks/zendesk", content=ok, headers=zendesk_headers("wrong", ok)))
    add(hook, "post", client.post("/v1/webhooks/nope", content=ok))
    add(hook, "post", client.get("/v1/webhooks/zendesk"))
    out.append((hook, "post", *_slow_body(served, "/v1/webhooks/zendesk")))
    add(hook, "post", client.post("/v1/webhooks/zendesk", content=b"x" * 70_000))
    unmapped = json.dumps({"detail": {}}).encode()
    add(hook, "post", client.post("/v1/webhooks/zendesk", content=unmapped,
                                  headers=zendesk_headers(SECRETS["zendesk"], unmapped)))  # fmt: skip
    for _ in range(4):  # the dead gateway: 503 until its webhook bucket of 3 is empty, then 429
        add(hook, "post", dead.client.post("/v1/webhooks/zendesk", content=ok, headers=signed))
    add("/healthz", "get", client.get("/healthz"))
    add("/healthz", "get", client.post("/healthz"))
    add("/readyz", "get", client.get("/readyz"))
    add("/readyz", "get", dead.client.get("/readyz"))
    add("/readyz", "get", client.post("/readyz"))
    add("/metrics", "get", client.get("/metrics", headers=ADMIN))
    add("/metrics", "get", client.get("/metrics"))
    add("/metrics", "get", dead.client.get("/metrics"))
    add("/metrics", "get", client.post("/metrics", headers=ADMIN))
    return out


def test_openapi_lists_every_real_answer_with_its_schema(gateways):
    url, queue, served, dead = gateways
    document = served.client.get("/openapi.json", headers=ADMIN).json()
    components = document["components"]["schemas"]
    assert document["components"]["securitySchemes"]["bearer"] == {**document["components"]["securitySchemes"][
        "bearer"], "type": "http", "scheme": "bearer"}  # fmt: skip
    assert document["paths"]["/v1/tickets"]["post"]["security"] == [{"bearer": []}]
    seen: dict[tuple[str, str], set[str]] = {}
    for route, method, status, body in _answers(url, queue, served, dead):
        documented = document["paths"][route][method]["responses"]
        assert str(status) in documented, f"{method.upper()} {route} answered {status}: not documented"
        content = documented[str(status)]["content"]
        if "application/json" in content:
            assert matches(json.loads(body), content["application/json"]["schema"], components), (route, status, body)
        seen.setdefault((route, method), set()).add(str(status))
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            assert set(operation["responses"]) <= seen.get((path, method), set()), f"{method} {path}: never seen"


def test_docs_load_nothing_from_outside(gateways):
    _, _, served, _ = gateways
    page = served.client.get("/docs", headers=ADMIN)
    assert page.status_code == 200 and "/v1/tickets" in page.text
    assert "http://" not in page.text and "https://" not in page.text and "<script" not in page.text
