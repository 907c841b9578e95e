"""The gateway's connection limit (TICKETQ_GATEWAY_MAX_CONNECTIONS, `gateway.server`): above it
every answer is the documented error shape, 503 `too_many_connections` with Retry-After, never
uvicorn's plain-text 503. A real uvicorn (`python -m gateway`) in front of a private Redis. And
neither deadline (the head's, the keep-alive's) drops a request already waiting in the socket: a
uvicorn in this process, the gateway's protocol in front of a stub app."""

from __future__ import annotations

import json
import select
import socket
import threading
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn
from gateways import ADMIN, TOKEN, running_gateway
from test_gateway_errors import raw_request
from workers import wait_for

from gateway.metrics import GatewayMetrics
from gateway.server import uvicorn_options
from gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_server(volatile_redis_server):
    return volatile_redis_server


def test_above_the_connection_limit_the_answer_is_the_error_shape_with_retry_after(redis_server, tmp_path):
    """TICKETQ_GATEWAY_MAX_CONNECTIONS=2 with two POSTs holding their bodies back and four idle
    connections (above any margin below uvicorn's own limit, which counts idle connections): a new
    request is answered 503 `too_many_connections` as JSON with Retry-After, never uvicorn's plain
    text; counted; once they are closed, answered again."""
    url, queue = redis_server.url, "conn-limit"
    head = (b"POST /v1/tickets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
            b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")  # fmt: skip
    probe = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    with running_gateway(tmp_path, url, queue, TICKETQ_GATEWAY_MAX_CONNECTIONS="2",
                         TICKETQ_GATEWAY_BODY_TIMEOUT_S="120") as gateway:  # fmt: skip
        address = (urlsplit(gateway.url).hostname, urlsplit(gateway.url).port)
        held = [socket.create_connection(address, timeout=10) for _ in range(6)]
        answers = []
        try:
            for sock in held[:2]:
                sock.sendall(head)
            wait_for(lambda: answers.append(raw_request(gateway.url, probe)) or answers[-1][0] == 503, 60,
                     "a request above the limit refused")  # fmt: skip
        finally:
            for sock in held:
                sock.close()
        for status, headers, body in answers:  # 200 until the server had taken the held connections
            assert status == 200 or (headers["content-type"], json.loads(body)["error"]) == (
                "application/json", "too_many_connections"), (status, headers, body)
        status, headers, body = answers[-1]
        assert int(headers["retry-after"]) == 5 and "TICKETQ_GATEWAY_MAX_CONNECTIONS=2" in json.loads(body)["message"]
        wait_for(lambda: raw_request(gateway.url, probe)[0] == 200, 60, "answered again once they are closed")
        metrics = httpx.get(gateway.url + "/metrics", headers=ADMIN, timeout=10).text.splitlines()
        counted = [line for line in metrics if line.startswith('ticketq_gateway_rejects_total{reason="too_many_conn')]
        assert counted and float(counted[0].split()[-1]) >= sum(status == 503 for status, _, _ in answers) > 0


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def _ok(scope: dict, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _served():
    """uvicorn (its default loop: uvloop where installed, as `python -m gateway`) with the gateway's protocol."""
    options = uvicorn_options(GatewaySettings(), GatewayMetrics.build())
    server = uvicorn.Server(uvicorn.Config(_ok, lifespan="off", log_level="warning", **options))
    listener = socket.create_server(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "uvicorn started")
        yield server, listener.getsockname()
    finally:
        server.should_exit = True
        thread.join(30)
        listener.close()


def _answer(sock: socket.socket) -> bytes:
    """What the server sends until its response ends ("ok") or it closes the connection (b"" if reset)."""
    got = b""
    try:
        while not got.endswith(b"ok") and (chunk := sock.recv(65536)):
            got += chunk
    except ConnectionResetError:
        pass
    return got


@pytest.mark.parametrize("deadline", ["keep-alive", "head"])
def test_a_request_waiting_in_the_socket_when_a_deadline_fires_is_answered(deadline):
    """The deadline fires (as uvloop fires a due timer before reading what came in while it was busy)
    with the next request already in the server's socket: it is answered, not reset. With nothing
    waiting, the same deadline still closes the connection."""
    with _served() as (server, address), socket.create_connection(address, timeout=60) as client:
        if deadline == "keep-alive":
            client.sendall(GET)
            assert _answer(client).startswith(b"HTTP/1.1 200")
        protocol = wait_for(lambda: next(iter(server.server_state.connections), None), 30, "the connection")
        fire = protocol.timeout_keep_alive_handler if deadline == "keep-alive" else protocol._head_overdue
        fired = threading.Event()

        def with_the_request_waiting() -> None:  # on the server's loop: it reads nothing until this returns
            client.sendall(GET)
            poller = select.poll()
            poller.register(protocol.transport.get_extra_info("socket").fileno(), select.POLLIN)
            assert poller.poll(30_000), "the request reached the server's socket"
            fire()
            fired.set()

        protocol.loop.call_soon_threadsafe(with_the_request_waiting)
        assert _answer(client).startswith(b"HTTP/1.1 200") and fired.is_set()
        protocol.loop.call_soon_threadsafe(fire)  # nothing waiting now
        assert _answer(client) == b""
