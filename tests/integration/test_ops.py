"""The operator commands against a real worker (health endpoints in process: tests/unit/test_health.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import redis
from celery import Celery
from servers import require_redis_server
from workers import ROOT, close_results_app, free_port, null_classifier_service, skip_or_fail, wait_for

from ticketq import names

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with null_classifier_service(tmp_path_factory.mktemp("ops-redis"), "ops") as service:
        yield service


@pytest.fixture
def app(service):
    app = Celery(broker=service[0], backend=service[0])
    yield app
    close_results_app(app)  # before the module's redis-server goes


def ticketq(args: list[str], url: str, queue: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=url, TICKETQ_QUEUE=queue)
    return subprocess.run([sys.executable, "-m", "ticketq_cli.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_status_dead_letters_requeue_and_result_lookup(service, app):
    url, queue = service
    client = redis.Redis.from_url(url)
    good = app.send_task(names.TASK_CLASSIFY, args=[{"id": "OK-1", "text": "refund please"}], queue=queue)
    bad = app.send_task(names.TASK_CLASSIFY, args=[{"id": "BAD-1", "text": "   "}], queue=queue)

    def arrived() -> bool:
        return client.xlen(names.DEAD_LETTER_STREAM) >= 1 and client.xlen(names.RESULTS_STREAM) >= 2

    wait_for(arrived, 60, "results")

    # The failure contract, seen from a plain Celery client: state FAILURE, get() raises
    # TicketRejected("<reason>: <detail>"), get(propagate=False) returns it; a success is the dict.
    assert good.get(timeout=30)["status"] == "ok"
    failure = bad.get(timeout=30, propagate=False)
    assert bad.state == "FAILURE" and type(failure).__name__ == "TicketRejected"
    assert str(failure) == "empty_text: ticket text is empty or whitespace only"
    with pytest.raises(Exception, match=r"^empty_text: "):
        bad.get(timeout=5)

    status = json.loads(ticketq(["status", "--json"], url, queue).stdout)
    assert status["workers"] and status["queue"] == queue and status["queue_depth"] == 0
    assert status["dead_letters"] == {"empty_text": 1} and status["results_stream"] >= 2
    assert status["leases"]["alive"] >= 1, "the worker's consumer holds a lease (atomic fetch)"

    listed = ticketq(["dead", "list"], url, queue)
    assert bad.id in listed.stdout and "empty_text" in listed.stdout
    shown = json.loads(ticketq(["dead", "show", bad.id], url, queue).stdout)
    assert shown["payload"]["id"] == "BAD-1" and shown["reason"] == "empty_text"

    found = ticketq(["result", "OK-1"], url, queue)
    assert found.returncode == 0 and json.loads(found.stdout.splitlines()[0])["task_id"] == good.id
    assert ticketq(["result", "nope"], url, queue).returncode == 3

    # Blank text fails on every worker: the requeue says so and sends nothing; the letter stays.
    requeued = ticketq(["dead", "requeue", bad.id], url, queue)
    assert requeued.returncode == 3 and "can never succeed" in requeued.stderr, requeued.stderr
    assert "Traceback" not in requeued.stderr and client.llen(queue) == 0
    listed = ticketq(["dead", "list"], url, queue).stdout.splitlines()
    assert len(listed) == 1 and shown["entry_id"] in listed[0] and bad.id in listed[0], listed


def test_an_empty_pack_is_refused_with_a_reason_that_names_it(service, app):
    _, queue = service
    [failed] = app.send_task(names.TASK_CLASSIFY, args=[[]], queue=queue).get(timeout=60)
    assert failed["reason"] == "bad_payload" and "empty pack `[]`" in failed["error"], failed
    assert "NoneType" not in failed["error"]


# --- TLS: a private redis-server on a TLS port, its certificate signed by a CA of the test's own ---


def _tls_files(workdir) -> dict[str, str]:
    if shutil.which("openssl") is None:
        skip_or_fail("openssl is not installed (it makes the test's certificates)")
    files = {name: str(workdir / name) for name in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt")}
    ext = workdir / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", files["ca.key"], "-out", files["ca.crt"],
         "-days", "2", "-subj", "/CN=ticketq test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", files["server.key"], "-out", files["server.csr"],
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", files["server.csr"], "-CA", files["ca.crt"], "-CAkey", files["ca.key"],
         "-CAcreateserial", "-out", files["server.crt"], "-days", "2", "-extfile", str(ext)],
    ]  # fmt: skip
    for step in steps:
        subprocess.run(["openssl", *step], check=True, capture_output=True, timeout=60)
    return files


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    require_redis_server()
    workdir = tmp_path_factory.mktemp("tls-redis")
    files, port = _tls_files(workdir), free_port()
    proc = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", files["server.crt"], "--tls-key-file", files["server.key"],
                             "--tls-ca-cert-file", files["ca.crt"], "--tls-auth-clients", "no", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=files["ca.crt"], socket_connect_timeout=2)

    def pings() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        wait_for(pings, 20, "redis-server on its TLS port")
        yield f"rediss://127.0.0.1:{port}/0", files["ca.crt"]
    finally:
        proc.kill()
        proc.wait()


def run(command: list[str], url: str, **extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=url, TICKETQ_QUEUE="tls", TICKETQ_METRICS_PORT="0", **extra)
    return subprocess.run([sys.executable, "-m", *command], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=90)  # fmt: skip


def test_a_bare_rediss_url_uses_the_system_store_or_says_what_to_give(tls_redis):
    url, ca = tls_redis
    commands = {
        "status": ["ticketq_cli.cli", "status"],
        "producer": ["producer.cli", "synthetic", "3"],
        "worker": ["ticketq_cli.cli", "worker"],
    }
    for name, command in commands.items():  # the test CA is in no system store: one line, exit 2
        done = run(command, url, TICKETQ_NULL_CLASSIFIER="1")
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and "Traceback" not in done.stdout + done.stderr, (name, done.stderr[-3000:])
        assert len(errors) == 1 and "refused the TLS connection" in errors[0] and "ssl_ca_certs=" in errors[0], (
            name, done.stderr[-3000:])  # fmt: skip
        assert "Check that it is running" not in errors[0]
    # SSL_CERT_FILE makes the test CA the system store, as a managed Redis's CA is: the bare URL works.
    trusted = run(commands["status"], url, SSL_CERT_FILE=ca)
    assert trusted.returncode == 4 and "queue: tls" in trusted.stdout, trusted.stdout + trusted.stderr  # 4: no worker
    named = run(commands["status"], f"{url}?ssl_ca_certs={ca}")
    assert named.returncode == 4 and "queue: tls" in named.stdout, named.stdout + named.stderr
