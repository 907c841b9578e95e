"""The kombu race of issue 44: a connection error while kombu declares the queue before a publish.

kombu's `Connection.ensure` recovers from it by closing the connection's channel and reviving the
queue only; the Producer it leaves publishes on that closed channel (`connection` None), which
raised `AttributeError: 'NoneType' object has no attribute 'client'` out of `submit_many`, and the
gateway answered a plain 500. Producers now publish without kombu's retry (`producer.backend`),
and `producer.outage` rides the error out.

The fault is injected in this process, at redis-py's pipeline (kombu declares a queue in one):
the next pipelines of kombu (those that declare a queue, SADD, or publish, LPUSH) raise
`ConnectionError`, as on a Redis that dropped the connection. The gateway publishes without kombu
(one script of its own), so its test drops that script's connection instead.
A private Redis (`redis_server`), so the queue holds only this test's messages.
"""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
from fastapi.testclient import TestClient

from gateway.app import create_app
from gateway.settings import GatewaySettings
from producer.api import Producer
from ticketq.config import ClientSettings

pytestmark = pytest.mark.integration

QUEUE = "publish-race"


@pytest.fixture
def dropped_pipelines(monkeypatch):
    """`drop(n)`: the next `n` of kombu's pipelines in this process raise ConnectionError (None: all)."""
    execute = redis.client.Pipeline.execute
    state = {"left": 0, "dropped": 0}

    def failing(self, *args, **kwargs):
        kombus = any(str(command[0]).upper() in ("SADD", "LPUSH") for command, _ in self.command_stack)
        if kombus and (state["left"] is None or state["left"] > 0):
            state["left"] = None if state["left"] is None else state["left"] - 1
            state["dropped"] += 1
            self.reset()
            raise redis.exceptions.ConnectionError("connection dropped (injected by the test)")
        return execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", failing)

    def drop(n: int | None) -> dict:
        state["left"] = n
        return state

    return drop


def test_submit_many_rides_out_a_connection_lost_during_the_queue_declare(redis_server, dropped_pipelines):
    """Before the fix: AttributeError("'NoneType' object has no attribute 'client'")."""
    with Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE), retry_for_s=30) as producer:
        dropped = dropped_pipelines(1)
        sent = producer.submit_many([f"ticket {i}" for i in range(20)])
    assert dropped["dropped"] == 1
    assert len(sent) == 20
    assert redis_server.client().llen(QUEUE) == 20


def test_every_later_send_works_after_the_declare_failed(redis_server, dropped_pipelines):
    """The failure at every point of the first sends (1, 2, 3 pipelines dropped in a row): each send
    is ridden out, and every message is queued exactly once."""
    with Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE), retry_for_s=30) as producer:
        for round_, n in enumerate((1, 2, 3)):
            dropped_pipelines(n)
            producer.submit_many([{"id": f"R{round_}-{i}", "text": "the app crashes"} for i in range(600)],
                                 idempotent=True)  # fmt: skip
            producer.submit(f"single {round_}")
    assert redis_server.client().llen(QUEUE) == 3 * 601


def gateway_client(url: str) -> TestClient:
    settings = GatewaySettings(broker_url=url, queue=QUEUE, gateway_anonymous=True, gateway_send_retry_s=1.0,
                               gateway_retry_after_s=7)  # fmt: skip
    return TestClient(create_app(settings), raise_server_exceptions=False)


@pytest.fixture
def dropped_pushes(monkeypatch):
    """`drop(n)`: the gateway's next `n` pushes (its script, EVALSHA, on its asyncio client) raise ConnectionError
    (None: all), as on a Redis that dropped the connection. The gateway pushes its messages in one script
    of its own (`gateway.enqueue`), not through kombu, so this is where its connection can be lost."""
    execute = redis.asyncio.Redis.execute_command
    state = {"left": 0, "dropped": 0}

    async def failing(self, *args, **kwargs):
        if str(args[0]).upper() == "EVALSHA" and (state["left"] is None or state["left"] > 0):
            state["left"] = None if state["left"] is None else state["left"] - 1
            state["dropped"] += 1
            raise redis.exceptions.ConnectionError("connection dropped (injected by the test)")
        return await execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.Redis, "execute_command", failing)

    def drop(n: int | None) -> dict:
        state["left"] = n
        return state

    return drop


def test_gateway_rides_out_a_dropped_push_and_answers_503_with_retry_after_past_the_retry(
        redis_server, dropped_pushes):  # fmt: skip
    """Before issue 44's fix: a plain-text 500 for both."""
    with gateway_client(redis_server.url) as client:
        dropped = dropped_pushes(1)
        response = client.post("/v1/tickets", json={"id": "G-1", "text": "the app crashes on upload"})
        assert response.status_code == 202, response.text
        assert dropped["dropped"] == 1
        dropped_pushes(None)  # Redis drops every push for longer than TICKETQ_GATEWAY_SEND_RETRY_S
        response = client.post("/v1/tickets", json={"id": "G-2", "text": "the app crashes on upload"})
        dropped_pushes(0)
        assert response.status_code == 503, response.text
        assert response.headers["Retry-After"] == "7"
        assert response.json()["error"] == "redis_unavailable"
    assert redis_server.client().llen(QUEUE) == 1
