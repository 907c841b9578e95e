"""Per-tenant delivery (issue 42): two tenants, each with its own receiver URL and signing key; the
same ticket id POSTed by both to a real gateway is classified twice by a real worker on the tiny
stand-in, and the real dispatcher (`python -m gateway deliver`) POSTs each result to its own
tenant's receiver only, naming the tenant, with the id as the tenant sent it. Its /metrics listens
on 127.0.0.1 only (TICKETQ_DELIVER_METRICS_HOST's default)."""

from __future__ import annotations

import uuid

import httpx
import psutil
import pytest
from gateways import running_gateway
from test_deliver import dispatching, receiving
from workers import RedisServer, running_worker, wait_for, worker_env

from gateway.auth import token_digest

pytestmark = pytest.mark.integration

ALPHA, BETA = "alpha-" + uuid.uuid4().hex, "beta-" + uuid.uuid4().hex
TOKENS = f"a1@alpha:{token_digest(ALPHA)},b1@beta:{token_digest(BETA)}"
KEYS = {"alpha": "alpha-delivery-key", "beta": "beta-delivery-key"}


def _listening(pid: int, port: int) -> set[str]:
    """The addresses process `pid` listens on at `port`."""
    return {c.laddr.ip for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}  # fmt: skip


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_same_id_in_two_tenants_is_classified_twice_and_delivered_to_each_tenant(tiny_model_dir, tmp_path):
    server = RedisServer(tmp_path, aof=False).start()
    queue = f"tdel-{uuid.uuid4().hex[:8]}"
    ticket_id = "4711"
    try:
        with running_worker(worker_env(tiny_model_dir, server.url, queue), tmp_path / "worker.log"), \
                running_gateway(tmp_path, server.url, queue, TICKETQ_GATEWAY_TOKENS=TOKENS) as gateway, \
                receiving(secret=KEYS["alpha"]) as alpha_hook, receiving(secret=KEYS["beta"]) as beta_hook:  # fmt: skip
            for token, text, who in ((ALPHA, "I was charged twice", "a"), (BETA, "my login is broken", "b")):
                answer = httpx.post(f"{gateway.url}/v1/tickets", headers=_auth(token), timeout=60,
                                    json={"id": ticket_id, "text": text, "metadata": {"who": who}})  # fmt: skip
                assert answer.status_code == 202, answer.text
                assert answer.json()["tickets"][0]["status"] == "accepted"  # not the other tenant's "duplicate"
            urls = f"@alpha={alpha_hook.url},@beta={beta_hook.url}"
            secrets = ",".join(f"@{tenant}={key}" for tenant, key in KEYS.items())
            with dispatching(tmp_path, server.url, queue, alpha_hook.url, "tenants", TICKETQ_DELIVER_URL="",
                             TICKETQ_DELIVER_URLS=urls, TICKETQ_DELIVER_SECRETS=secrets) as dispatcher:  # fmt: skip
                wait_for(lambda: alpha_hook.seen and beta_hook.seen, 120, "a delivery to each tenant's receiver")
                assert _listening(dispatcher.proc.pid, dispatcher.metrics_port) == {"127.0.0.1"}  # not 0.0.0.0
        for hook, tenant, who in ((alpha_hook, "alpha", "a"), (beta_hook, "beta", "b")):
            assert hook.bad_signatures == 0  # a POST signed with the other tenant's key would be counted here
            [body] = hook.bodies.values()  # one result each: neither receives the other's
            assert body["tenant"] == tenant and body["metadata"] == {"who": who}
            assert body["result"]["id"] == ticket_id and body["result"]["status"] == "ok"
            assert body["result"]["standin"] is True
        assert alpha_hook.bodies.keys().isdisjoint(beta_hook.bodies.keys())
        tasks = {next(iter(hook.bodies.values()))["result"]["task_id"] for hook in (alpha_hook, beta_hook)}
        assert len(tasks) == 2  # classified twice: two tasks, not one answer shared
    finally:
        server.stop()
