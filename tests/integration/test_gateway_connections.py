"""The gateway's connection limit (TICKETQ_GATEWAY_MAX_CONNECTIONS, `gateway.server`): above it
every answer is the documented error shape, 503 `too_many_connections` with Retry-After, never
uvicorn's plain-text 503. A real uvicorn (`python -m gateway`) in front of a private Redis."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from gateways import ADMIN, TOKEN, running_gateway
from servers import require_redis_server
from test_gateway_errors import raw_request
from workers import RedisServer, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def redis_server(tmp_path):
    require_redis_server()
    server = RedisServer(tmp_path, aof=False).start()
    yield server
    server.kill()


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
