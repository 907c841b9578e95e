"""A real gateway for integration tests: `python -m gateway` on a free port in front of a broker
and queue, with a tickets token (TOKEN) and an admin token (ADMIN_TOKEN)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis
from workers import ROOT, free_port, wait_for

from gateway.auth import token_digest
from ticketq.names import queue_lists

TOKEN = "test-token-" + uuid.uuid4().hex
ADMIN_TOKEN = "test-admin-" + uuid.uuid4().hex
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SECRETS = {"zendesk": "zd-secret", "intercom": "ic-secret"}


class Gateway:
    """`python -m gateway` on a free port, in front of `broker_url`/`queue`."""

    def __init__(self, workdir: Path, broker_url: str, queue: str, **extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TICKETQ_BROKER_URL=broker_url, TICKETQ_QUEUE=queue,
                   TICKETQ_GATEWAY_TOKENS=f"tests:{token_digest(TOKEN)}",
                   TICKETQ_GATEWAY_ADMIN_TOKENS=f"ops:{token_digest(ADMIN_TOKEN)}", TICKETQ_GATEWAY_RATE="100000",
                   TICKETQ_GATEWAY_BURST="100000", TICKETQ_GATEWAY_WEBHOOK_SECRETS=",".join(
                       f"{name}={secret}" for name, secret in SECRETS.items()),
                   TICKETQ_GATEWAY_SCHEMAS="triage", TICKETQ_GATEWAY_MAX_BODY_BYTES="65536")  # fmt: skip
        env.update(extra)
        self.log = (workdir / f"gateway-{self.port}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "--port", str(self.port)], cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for(self._up, 60, f"the gateway on port {self.port}")
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited with {self.proc.returncode}; see {self.log.name}")
        try:
            return httpx.get(self.url + "/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()


@contextmanager
def running_gateway(workdir: Path, broker_url: str, queue: str, **extra: str):
    gateway = Gateway(workdir, broker_url, queue, **extra)
    try:
        yield gateway
    finally:
        gateway.stop()


def queued_tickets(url: str, queue: str) -> list[dict]:
    """The tickets waiting in `queue` (no worker consumes it), oldest message last: a gateway's POST is
    one packed message (its argument a list of tickets), another producer's message one ticket."""
    client, tickets = redis.Redis.from_url(url), []
    for name in queue_lists(queue):
        for raw in client.lrange(name, 0, -1):
            arg = json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
            tickets.extend(arg if isinstance(arg, list) else [arg])
    client.close()
    return tickets
