"""Helpdesks as they are, through a real gateway (uvicorn, `python -m gateway`) and a real Redis:
Freshdesk's and Help Scout's webhooks signed right and wrong, Intercom's ping, a Zendesk description
above the ticket limit, re-classification per event; and the write-back (`ticketq-writeback`)
against local fakes of the helpdesks' APIs (tests/support/helpdesks.py): end to end from a signed
Zendesk webhook through a real worker on the tiny stand-in to the fake's ticket, through 429s."""

from __future__ import annotations

import base64
import hashlib
import hmac
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import redis
from gateways import queued_tickets, running_gateway
from helpdesks import FakeHelpdesk
from workers import (
    ROOT,
    RedisServer,
    free_port,
    null_classifier_service,
    running_worker,
    skip_or_fail,
    wait_for,
    worker_env,
)  # fmt: skip

from gateway.keys import WRITEBACK_DEAD_STREAM
from ticketq import codec
from ticketq.names import RESULTS_STREAM

pytestmark = pytest.mark.integration

SECRETS = {"zendesk": "zd-secret", "intercom": "ic-secret", "helpscout": "hs-secret", "freshdesk": "fd-user:fd-pass"}
WEBHOOK_ENV = {"TICKETQ_GATEWAY_WEBHOOK_SECRETS": ",".join(f"{k}={v}" for k, v in SECRETS.items()),
               "TICKETQ_GATEWAY_MAX_BODY_BYTES": "262144"}  # fmt: skip


def zendesk_headers(body: bytes, secret: str = SECRETS["zendesk"]) -> dict[str, str]:
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    digest = hmac.new(secret.encode(), stamp.encode() + body, hashlib.sha256).digest()
    return {"X-Zendesk-Webhook-Signature": base64.b64encode(digest).decode(),
            "X-Zendesk-Webhook-Signature-Timestamp": stamp, "Content-Type": "application/json"}  # fmt: skip


def zendesk_event(ticket_id: str, description: str, event_id: str | None = None, comment: str | None = None) -> bytes:
    """A Zendesk event webhook's body (ticket.created, or ticket.comment_added with `comment`)."""
    kind = "zen:event-type:ticket.comment_added" if comment else "zen:event-type:ticket.created"
    return json.dumps({
        "account_id": 22129848, "id": event_id or str(uuid.uuid4()), "subject": f"zen:ticket:{ticket_id}",
        "type": kind, "time": "2026-12-06T04:00:00Z", "zendesk_event_version": "2022-11-06",
        "event": {"comment": {"body": comment, "is_public": True}} if comment else {},
        "detail": {"id": ticket_id, "subject": "Refund", "description": description, "status": "NEW", "tags": ["vip"]},
    }).encode()  # fmt: skip


queued = queued_tickets  # the tickets waiting in the queue (no worker consumes it)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("helpdesk-redis"), aof=False).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def idle_gateway(redis_server, tmp_path):
    """A gateway on a queue no worker consumes: what was enqueued stays to be read."""
    queue = f"desk-{uuid.uuid4().hex[:8]}"
    with running_gateway(tmp_path, redis_server.url, queue, **WEBHOOK_ENV) as gateway:
        yield gateway, queue


def test_freshdesk_and_helpscout_signed_right_are_taken_and_wrong_refused(redis_server, idle_gateway):
    gateway, queue = idle_gateway
    post = gateway.client.post
    freshdesk = json.dumps({"freshdesk_webhook": {"ticket_id": 1042, "ticket_subject": "Cannot log in",
                            "ticket_description": "<div>Reset mail never arrives<br>help</div>"}}).encode()  # fmt: skip
    helpscout = json.dumps({"id": 2391938111, "number": 349, "subject": "Charged twice",
                            "_embedded": {"threads": [{"id": 1, "type": "customer", "body": "<p>refund &amp; "
                                                       "thanks</p>"}]}}).encode()  # fmt: skip
    hs_sig = base64.b64encode(hmac.new(SECRETS["helpscout"].encode(), helpscout, hashlib.sha1).digest()).decode()
    basic = "Basic " + base64.b64encode(SECRETS["freshdesk"].encode()).decode()
    wrong = [
        post(
            "/v1/webhooks/freshdesk",
            content=freshdesk,
            headers={"Authorization": "Basic " + base64.b64encode(b"fd-user:guess").decode()},
        ),
        post("/v1/webhooks/freshdesk", content=freshdesk, headers={"X-Ticketq-Webhook-Secret": "guess"}),
        post("/v1/webhooks/freshdesk", content=freshdesk, headers={}),
        post("/v1/webhooks/helpscout", content=helpscout, headers={"X-HelpScout-Signature": hs_sig[:-4] + "AAA="}),
        post("/v1/webhooks/helpscout", content=helpscout + b" ", headers={"X-HelpScout-Signature": hs_sig}),
    ]
    assert [(r.status_code, r.json()["error"]) for r in wrong] == [(401, "bad_signature")] * 5
    assert queued(redis_server.url, queue) == []
    right = [
        httpx.post(gateway.url + "/v1/webhooks/freshdesk", content=freshdesk, headers={"Authorization": basic}),
        httpx.post(
            gateway.url + "/v1/webhooks/freshdesk",
            content=freshdesk,
            headers={"X-Ticketq-Webhook-Secret": SECRETS["freshdesk"]},
        ),
        httpx.post(
            gateway.url + "/v1/webhooks/helpscout", content=helpscout, headers={"X-HelpScout-Signature": hs_sig}
        ),
    ]
    assert [r.status_code for r in right] == [202, 202, 202], [r.text for r in right]
    assert [r.json()["tickets"][0]["status"] for r in right] == ["accepted", "duplicate", "accepted"]
    texts = {t["id"]: t["text"] for t in queued(redis_server.url, queue)}
    assert texts == {"freshdesk:1042": "Cannot log in\n\nReset mail never arrives\nhelp",
                     "helpscout:2391938111": "Charged twice\n\nrefund & thanks"}  # fmt: skip


def test_intercom_ping_is_answered_200_and_enqueues_nothing(redis_server, idle_gateway):
    gateway, queue = idle_gateway
    ping = json.dumps({"type": "notification_event", "topic": "ping", "id": "notif_ping", "app_id": "abc",
                       "data": {"type": "notification_event_data", "item": {"type": "ping",
                                "message": "something something interzen"}}}).encode()  # fmt: skip
    signature = "sha1=" + hmac.new(SECRETS["intercom"].encode(), ping, "sha1").hexdigest()
    answer = httpx.post(gateway.url + "/v1/webhooks/intercom", content=ping, headers={"X-Hub-Signature": signature})
    assert answer.status_code == 200, answer.text
    unsigned = httpx.post(gateway.url + "/v1/webhooks/intercom", content=ping)
    assert unsigned.status_code == 401  # a ping is checked like any webhook
    assert queued(redis_server.url, queue) == []


def test_a_zendesk_description_above_the_limit_is_cut_not_refused(redis_server, idle_gateway):
    gateway, queue = idle_gateway
    thread = "".join(f"> On day {n} you wrote: the invoice is still wrong\n" for n in range(1800))
    body = zendesk_event("88", "NEWEST " + thread + " OLDEST")
    assert len(body) > 65536
    answer = httpx.post(gateway.url + "/v1/webhooks/zendesk", content=body, headers=zendesk_headers(body))
    assert answer.status_code == 202, answer.text
    (ticket,) = queued(redis_server.url, queue)
    assert len(ticket["text"].encode()) <= 65536 and ticket["text"].startswith("Refund\n\nNEWEST")
    assert ticket["text"].endswith(" OLDEST")  # head+tail: both ends kept, as the worker's own rule cuts


def test_reclassify_takes_each_event_once(redis_server, tmp_path):
    mapping = tmp_path / "sources.toml"
    mapping.write_text('[sources.zendesk]\nkind = "zendesk"\nid = "detail.id"\nsubject = "detail.subject"\n'
                       'body = "detail.description"\ncomment = "event.comment.body"\nevent = "id"\n'
                       'reclassify = true\n')  # fmt: skip
    queue = f"desk-{uuid.uuid4().hex[:8]}"
    with running_gateway(tmp_path, redis_server.url, queue, TICKETQ_GATEWAY_WEBHOOK_MAPPING=str(mapping),
                         **WEBHOOK_ENV) as gateway:  # fmt: skip
        created = zendesk_event("35", "charged twice", event_id="ev-1")
        comment = zendesk_event("35", "charged twice", event_id="ev-2", comment="and I cannot log in")
        statuses = []
        for body in (created, created, comment, comment):  # each event delivered twice (a helpdesk's retry)
            answer = httpx.post(gateway.url + "/v1/webhooks/zendesk", content=body, headers=zendesk_headers(body))
            statuses.append(answer.json()["tickets"][0]["status"])
    assert statuses == ["accepted", "duplicate", "accepted", "duplicate"]
    tickets = sorted(queued(redis_server.url, queue), key=lambda ticket: ticket["id"])
    assert [t["id"] for t in tickets] == ["zendesk:35:ev-1", "zendesk:35:ev-2"]
    assert tickets[1]["text"] == "Refund\n\ncharged twice\n\nand I cannot log in"


# --- write-back ---


class Writeback:
    """`ticketq-writeback` as a process, with its metrics port."""

    def __init__(self, workdir: Path, broker_url: str, queue: str, config: Path, secrets: str, **extra: str) -> None:
        self.metrics_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TICKETQ_BROKER_URL=broker_url, TICKETQ_QUEUE=queue,
                   TICKETQ_WRITEBACK_CONFIG=str(config), TICKETQ_WRITEBACK_SECRETS=secrets,
                   TICKETQ_WRITEBACK_METRICS_PORT=str(self.metrics_port), TICKETQ_WRITEBACK_CONSUMER="wb-test",
                   TICKETQ_DELIVER_BACKOFF_S="0.05", TICKETQ_DELIVER_BACKOFF_MAX_S="2", **extra)  # fmt: skip
        self.env = env
        self.log = (workdir / f"writeback-{self.metrics_port}.log").open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "gateway.writeback.cli"], cwd=ROOT, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)  # fmt: skip
        wait_for(lambda: self.metric("ticketq_writeback_lag_results") is not None, 60, "the write-back's metrics")

    def metric(self, name: str) -> float | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"ticketq-writeback exited with {self.proc.returncode}; see {self.log.name}")
        try:
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
        return values[0] if values else (0.0 if name.endswith("_total") or "_total{" in name else None)

    def command(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "gateway.writeback.cli", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


@contextmanager
def writing_back(*args: object, **extra: str):
    writeback = Writeback(*args, **extra)
    try:
        yield writeback
    finally:
        writeback.stop()


ZENDESK_CONFIG = """
[targets.zendesk]
kind = "zendesk"
url = "{url}"
email = "bot@acme.example"
{labels}
"""


def test_zendesk_write_back_end_to_end_through_429s(tmp_path, tiny_model_dir):
    """Signed Zendesk webhook → gateway → a worker on the tiny stand-in → ticketq-writeback → the fake
    Zendesk's ticket carries the label's tags, group and field; the fake answered 429 (Retry-After 1)
    to the first three writes. The same answer again is not re-written."""
    labels = "".join(f'[targets.zendesk.labels.{label}]\ntags = ["ai-{label}"]\ngroup_id = {100 + n}\n'
                     f'custom_fields = {{ 360002 = "{label}" }}\n\n'
                     for n, label in enumerate(("billing", "technical", "account")))  # fmt: skip
    server = RedisServer(tmp_path, aof=False).start()
    queue = f"wb-{uuid.uuid4().hex[:8]}"
    try:
        with FakeHelpdesk("zendesk", "bot@acme.example/token:ZD-API-TOKEN", [35], throttled=3) as zendesk:
            config = tmp_path / "writeback.toml"
            config.write_text(ZENDESK_CONFIG.format(url=zendesk.url, labels=labels))
            env = worker_env(tiny_model_dir, server.url, queue, TICKETQ_MATMUL="torch")
            with running_worker(env, tmp_path / "worker.log"), \
                    running_gateway(tmp_path, server.url, queue, **WEBHOOK_ENV) as gateway, \
                    writing_back(tmp_path, server.url, queue, config, "zendesk=ZD-API-TOKEN") as writeback:  # fmt: skip
                body = zendesk_event("35", "I was charged twice for my subscription, please refund")
                answer = httpx.post(gateway.url + "/v1/webhooks/zendesk", content=body, headers=zendesk_headers(body))
                assert answer.status_code == 202, answer.text
                wait_for(lambda: writeback.metric("ticketq_writeback_writes_total") == 1, 120, "the label written back")
                (_entry_id, fields), = redis.Redis.from_url(server.url).xrange(RESULTS_STREAM)  # fmt: skip
                result = codec.loads(fields[b"data"])
                assert result["id"] == "zendesk:35" and result["standin"] is True
                label = result["label"]
                ticket = zendesk.tickets["35"]
                assert ticket.tags == {"vip", f"ai-{label}"}  # its own tags kept
                assert ticket.group_id == 100 + ("billing", "technical", "account").index(label)
                assert ticket.custom_fields == {360002: label}
                assert zendesk.statuses() == [429, 429, 429, 200]
                gaps = [later - earlier for earlier, later in itertools.pairwise(zendesk.times)]
                assert min(gaps) >= 1.0, gaps  # each 429's Retry-After: 1 honoured (a correctness bound, not speed)
                assert writeback.metric('ticketq_writeback_requests_total{outcome="http_429"}') == 3
                assert writeback.metric("ticketq_writeback_dead_letters_total") == 0
                # The same result again (a re-read, a repair): the state is there already, nothing is sent.
                redis.Redis.from_url(server.url).xadd(RESULTS_STREAM, {b"data": fields[b"data"]})
                wait_for(lambda: writeback.metric('ticketq_writeback_skipped_total{reason="unchanged"}') == 1, 30,
                         "the repeated result skipped")  # fmt: skip
                assert len(zendesk.statuses()) == 4
    finally:
        server.stop()


LABELS = ("billing", "technical", "account")
FRESHDESK_CONFIG = """
[targets.freshdesk]
kind = "freshdesk"
url = "{url}"
{labels}
"""


def test_freshdesk_write_back_skips_what_is_not_its_own_and_dead_letters_what_fails(tmp_path):
    """Null classifier: a Freshdesk ticket is written (custom field, group, tags merged with its own);
    one the fake does not know (404) is dead-lettered after TICKETQ_DELIVER_MAX_ATTEMPTS and listed by
    `ticketq-writeback dead`; a bearer-token ticket whose metadata names a Freshdesk ticket is never written."""
    labels = "".join(f'[targets.freshdesk.labels.{label}]\ncustom_fields = {{ cf_category = "{label}" }}\n'
                     f'group_id = 7\ntags = ["ai-{label}"]\n\n' for label in LABELS)  # fmt: skip
    secrets = "freshdesk=FD-API-KEY"
    with null_classifier_service(tmp_path, "wbfd") as (url, queue), \
            FakeHelpdesk("freshdesk", "FD-API-KEY:X", [1042]) as freshdesk, \
            running_gateway(tmp_path, url, queue, **WEBHOOK_ENV) as gateway:  # fmt: skip
        config = tmp_path / "writeback.toml"
        config.write_text(FRESHDESK_CONFIG.format(url=freshdesk.url, labels=labels))
        basic = {"Authorization": "Basic " + base64.b64encode(SECRETS["freshdesk"].encode()).decode()}
        for ticket_id in (1042, 9999):
            body = json.dumps(
                {
                    "freshdesk_webhook": {
                        "ticket_id": ticket_id,
                        "ticket_subject": "Invoice",
                        "ticket_description": "<p>wrong amount</p>",
                    }
                }
            ).encode()
            assert httpx.post(gateway.url + "/v1/webhooks/freshdesk", content=body, headers=basic).status_code == 202
        forged = gateway.client.post("/v1/tickets", json={"id": "f-1", "text": "x", "metadata": {
            "source": "freshdesk", "source_id": "1042"}})  # fmt: skip
        assert forged.status_code == 202
        with writing_back(tmp_path, url, queue, config, secrets, TICKETQ_DELIVER_MAX_ATTEMPTS="2") as writeback:
            wait_for(lambda: writeback.metric("ticketq_writeback_dead_letters_total") == 1, 60, "the dead letter")
            wait_for(lambda: writeback.metric("ticketq_writeback_writes_total") == 1, 60, "the write")
            wait_for(lambda: writeback.metric('ticketq_writeback_skipped_total{reason="not_webhook"}') == 1, 60,
                     "the bearer-token ticket skipped")  # fmt: skip
            assert freshdesk.tickets["1042"].group_id == 7
            assert set(freshdesk.tickets["1042"].custom_fields) == {"cf_category"}
            label = freshdesk.tickets["1042"].custom_fields["cf_category"]
            assert freshdesk.tickets["1042"].tags == {"vip", f"ai-{label}"}  # read first: its own tag kept
            assert [path for _, path, _ in freshdesk.requests].count("/api/v2/tickets/1042") == 2  # GET, PUT
            listed = writeback.command("dead")
        assert listed.returncode == 0, listed.stderr
        assert "/api/v2/tickets/9999" in listed.stdout and "answered 404" in listed.stdout
        assert "1 dead letter(s) in ticketq:writeback:dead" in listed.stderr
        assert redis.Redis.from_url(url).xlen(WRITEBACK_DEAD_STREAM) == 1
        freshdesk.tickets["9999"] = type(freshdesk.tickets["1042"])()  # the ticket exists now: the repair writes it
        again = writeback.command("dead", "--redeliver")
        assert again.returncode == 0 and "1 written, 0 failed" in again.stdout, again.stdout + again.stderr
        assert freshdesk.tickets["9999"].group_id == 7
        assert redis.Redis.from_url(url).xlen(WRITEBACK_DEAD_STREAM) == 0


# --- docs/helpdesks.md's examples, as written ---

DOC = (ROOT / "docs" / "helpdesks.md").read_text(encoding="utf-8")


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, flags=re.S)


def test_the_docs_config_files_load(tmp_path):
    from gateway.webhooks import load_sources
    from gateway.writeback.config import load_targets

    sources, targets = doc_blocks("toml")
    (tmp_path / "sources.toml").write_text(sources)
    assert set(load_sources(str(tmp_path / "sources.toml"))) == {"zendesk", "freshdesk"}
    (tmp_path / "writeback.toml").write_text(targets)
    loaded = load_targets(tmp_path / "writeback.toml")
    assert loaded["zendesk"].labels["billing"].group_id == 360001
    assert (loaded["intercom"].admin_id, loaded["intercom"].labels["billing"].tags) == ("991267618", ("ai-billing",))


def test_the_docs_shell_examples_run_as_written(redis_server, idle_gateway, tmp_path):
    gateway, queue = idle_gateway
    by_hand, writeback = doc_blocks("bash")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")},
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "GATEWAY": gateway.url,
           "HELPSCOUT_SECRET": SECRETS["helpscout"], "FRESHDESK_AUTH": SECRETS["freshdesk"],
           "TICKETQ_BROKER_URL": redis_server.url, "ZENDESK_API_TOKEN": "zd", "FRESHDESK_API_KEY": "fd",
           "INTERCOM_TOKEN": "ic"}  # fmt: skip
    sent = subprocess.run(["bash", "-ec", by_hand], env=env, capture_output=True, text=True, timeout=60)
    assert sent.returncode == 0 and sent.stdout.count('"accepted"') == 2, sent.stdout + sent.stderr
    assert sorted(t["id"] for t in queued(redis_server.url, queue)) == ["freshdesk:1042", "helpscout:2391938111"]
    (tmp_path / "writeback.toml").write_text(doc_blocks("toml")[1])
    listed = subprocess.run(["bash", "-ec", writeback], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "0 dead letter(s) in ticketq:writeback:dead" in listed.stderr


def test_the_writeback_alert_rules_fire_and_stay_quiet():
    """deploy/prometheus/writeback-alerts.yml: a lagging write-back and its dead letters page, each with
    its text, and a healthy one does not (promtool's rule unit tests)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        skip_or_fail("no promtool (Debian package `prometheus`)")
    rules = ROOT / "deploy" / "prometheus"
    for command in (["check", "rules", "writeback-alerts.yml"], ["test", "rules", "writeback-alerts.test.yml"]):
        done = subprocess.run([promtool, *command[:2], str(rules / command[2])], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
