"""Every error the documented one (issue 42): 400 for deep nesting and non-finite numbers, the
contract's id rule at the gateway, a hard queue-depth bound that counts the request's own tickets
(also under concurrent POSTs), and `{error, message}` on the framework's and h11's own answers.
A real uvicorn in front of a private Redis; the bound is checked on a queue no worker consumes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import pytest
import redis
from gateways import TOKEN, queued_tickets, running_gateway
from workers import ROOT, null_classifier_service

pytestmark = pytest.mark.integration

BOUND = 100


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """A private Redis, a null-classifier worker, and a gateway in front (bodies timed out after 1 s)."""
    workdir = tmp_path_factory.mktemp("gw-errors")
    with null_classifier_service(workdir, "gwe") as (url, queue), \
            running_gateway(workdir, url, queue, TICKETQ_GATEWAY_BODY_TIMEOUT_S="1") as gateway:  # fmt: skip
        yield url, queue, gateway


@pytest.fixture
def idle(service, tmp_path):
    """A gateway on a queue no worker consumes, bounded at BOUND waiting messages: (gateway, queue)."""
    url, _, _ = service
    queue = f"idle-{uuid.uuid4().hex[:8]}"
    with running_gateway(tmp_path, url, queue, TICKETQ_GATEWAY_MAX_QUEUE_DEPTH=str(BOUND)) as gateway:
        yield gateway, queue


def queued(url: str, queue: str) -> int:
    """Tickets waiting in `queue` (a POST's are one packed message)."""
    return len(queued_tickets(url, queue))


def raw_request(base_url: str, request: bytes, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Send `request` as is on a new connection; (status, headers, body) of the answer (read to close)."""
    parts = urlsplit(base_url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def test_deep_nesting_and_non_finite_numbers_are_400_and_nothing_is_queued(service, idle):
    url, _, _ = service
    gateway, queue = idle
    nested = '{"text": "x", "metadata": ' + '{"a": ' * 40 + "1" + "}" * 40 + "}"
    cases = {
        nested: "too_deep",
        "[" * 20_000 + "]" * 20_000: "too_deep",  # past Python's own recursion limit: no 500
        '{"text": "x", "metadata": {"score": NaN}}': "invalid_json",
        '{"text": "x", "metadata": {"score": -Infinity}}': "invalid_json",
        '{"text": "x", "metadata": {"score": 1e999}}': "non_finite_number",
    }
    for body, reason in cases.items():
        answer = gateway.client.post("/v1/tickets", content=body.encode(), headers={"Content-Type": "application/json"})
        assert (answer.status_code, answer.json()["error"]) == (400, reason), body[:60]
        assert set(answer.json()) == {"error", "message"}
    shallow = {"text": "x", "metadata": json.loads('{"a": ' * 30 + "1" + "}" * 30)}  # 31 levels with the ticket
    assert gateway.client.post("/v1/tickets", json=shallow).status_code == 202
    assert queued(url, queue) == 1


def test_ids_follow_the_contracts_rule(service, idle):
    url, _, _ = service
    gateway, queue = idle
    for bad in ("a/b", "x" * 192, "tab\there", "ok\x85"):
        answer = gateway.client.post("/v1/tickets", json={"id": bad, "text": "hello"})
        assert answer.status_code == 422, bad
        assert answer.json()["errors"][0]["reason"] == "invalid_id" and answer.json()["errors"][0]["field"] == "id"
    longest = "y" * 191  # MAX_ID_CHARS less the room kept for `tenant:`
    assert gateway.client.post("/v1/tickets", json={"id": longest, "text": "hello"}).status_code == 202
    assert gateway.client.get(f"/v1/tickets/{longest}").json()["status"] == "pending"  # readable back
    assert queued(url, queue) == 1


def test_the_queue_bound_counts_the_requests_own_tickets(service, idle):
    url, _, _ = service
    gateway, queue = idle
    post = gateway.client.post
    assert post("/v1/tickets", json=[{"text": f"t{n}"} for n in range(90)]).status_code == 202
    thousand = post("/v1/tickets", json=[{"text": f"big{n}"} for n in range(1000)])
    assert (thousand.status_code, thousand.json()["error"]) == (413, "too_many_tickets")  # never fits: no retry
    twenty = post("/v1/tickets", json=[{"text": f"twenty{n}"} for n in range(20)])
    assert (twenty.status_code, twenty.json()["error"]) == (429, "queue_full")
    assert int(twenty.headers["Retry-After"]) >= 1
    assert post("/v1/tickets", json=[{"text": f"ten{n}"} for n in range(10)]).status_code == 202  # exactly full
    assert post("/v1/tickets", json={"text": "one more"}).status_code == 429
    assert queued(url, queue) == BOUND


def test_concurrent_posts_never_overshoot_the_bound(service, idle):
    url, _, _ = service
    gateway, queue = idle

    def post(n: int):
        return gateway.client.post("/v1/tickets", json=[{"text": f"c{n}-{k}"} for k in range(10)])

    with ThreadPoolExecutor(30) as pool:
        answers = list(pool.map(post, range(30)))
    accepted = [a for a in answers if a.status_code == 202]
    refused = [a for a in answers if a.status_code == 429]
    assert len(accepted) + len(refused) == 30 and accepted
    assert all(a.json()["error"] == "queue_full" and a.headers["Retry-After"] for a in refused)
    assert queued(url, queue) == 10 * len(accepted) <= BOUND


def test_the_bound_counts_the_tickets_of_packed_messages_as_workers_take_them(service, idle):
    """A POST is one packed message, yet the bound counts tickets: after a worker's worth of takes
    (the oldest messages, as a worker fetches them), exactly the tickets taken are room again."""
    url, _, _ = service
    gateway, queue = idle
    client = redis.Redis.from_url(url)
    for n in range(10):  # 10, 9, ..., 1 tickets: 55 waiting, in 10 messages
        tickets = [{"text": f"p{n}-{k}"} for k in range(10 - n)]
        assert gateway.client.post("/v1/tickets", json=tickets).status_code == 202
    assert client.llen(queue) == 10 and queued(url, queue) == 55
    for _ in range(3):  # the three oldest messages: 10 + 9 + 8 tickets
        client.rpop(queue)
    assert queued(url, queue) == 28
    refused = gateway.client.post("/v1/tickets", json=[{"text": f"big{k}"} for k in range(BOUND - 28 + 1)])
    assert (refused.status_code, refused.json()["error"]) == (429, "queue_full")
    assert gateway.client.post("/v1/tickets", json=[{"text": f"fits{k}"} for k in range(BOUND - 28)]).status_code == 202
    assert queued(url, queue) == BOUND


def test_concurrent_posts_of_the_same_tickets_queue_each_once(service, idle):
    """POSTs racing with overlapping tickets: each ticket is in exactly one message, and every POST that
    names it is answered with that message's task id."""
    url, _, _ = service
    gateway, queue = idle

    def post(n: int):
        return gateway.client.post("/v1/tickets", json=[{"id": f"o{k}", "text": "same"} for k in range(n, n + 8)])

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(post, range(0, 24, 2)))
    assert all(answer.status_code == 202 for answer in answers)
    ids = [ticket["id"] for ticket in queued_tickets(url, queue)]
    assert sorted(ids) == sorted({f"o{k}" for k in range(30)})
    task_ids: dict[str, set] = {}
    for answer in answers:
        for row in answer.json()["tickets"]:
            task_ids.setdefault(row["id"], set()).add(row["task_id"])
    assert all(len(named) == 1 for named in task_ids.values()), task_ids
    assert sum(row["status"] == "accepted" for a in answers for row in a.json()["tickets"]) == 30


def test_every_refusal_has_the_error_shape(service):
    _, _, gateway = service
    client = gateway.client
    cases = [
        (client.get("/v2/nothing"), 404, "not_found"),
        (client.delete("/v1/tickets"), 405, "method_not_allowed"),
        (client.get("/v1/tickets/x", params={"wait": "soon"}), 400, "invalid_request"),
        (client.get("/v1/tickets/never-sent"), 404, "unknown_ticket"),
    ]
    for answer, status, reason in cases:
        assert (answer.status_code, answer.json()["error"]) == (status, reason), answer.text
        assert answer.json()["message"] and answer.headers["content-type"] == "application/json"
    assert "POST" in cases[1][0].headers["Allow"]
    # a head past its 16 KiB bound, still incomplete: h11 refuses it (the whole of it is read, so no reset)
    huge = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000
    status, headers, body = raw_request(gateway.url, huge)
    assert (status, headers["content-type"], json.loads(body)["error"]) == (400, "application/json", "bad_http_request")
    garbage = b"NOT HTTP AT ALL\r\n\r\n"
    status, _, body = raw_request(gateway.url, garbage)
    assert status == 400 and set(json.loads(body)) == {"error", "message"}
    slow = (b"POST /v1/tickets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
    status, _, body = raw_request(gateway.url, slow)  # the rest never comes: 408 after 1 s
    assert (status, json.loads(body)["error"]) == (408, "body_timeout")


@pytest.mark.parametrize("command", [["ticketq_cli", "deliver"], ["gateway", "deliver"]], ids=" ".join)
def test_deliver_reports_bad_settings_under_its_own_name(command):
    """`ticketq deliver` is `ticketq-deliver` (`python -m gateway deliver`): same exit code, its own name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    done = subprocess.run([sys.executable, "-m", *command], env={**env, "TICKETQ_DELIVER_MAX_ATTEMPTS": "0"},
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    name = "ticketq deliver" if command[0] == "ticketq_cli" else "ticketq-deliver"
    assert done.returncode == 1 and done.stderr.startswith(f"{name}: invalid settings"), done.stderr
    assert "TICKETQ_DELIVER_MAX_ATTEMPTS" in done.stderr and "gateway" not in done.stderr.splitlines()[0]


def test_ticketq_gateway_is_the_gateway_program():
    done = subprocess.run([sys.executable, "-m", "ticketq_cli", "gateway", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("usage: ticketq gateway") and "--port" in done.stdout
