"""Health endpoints (in-process, a fresh registry) and the operator commands against a real worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import redis
from celery import Celery
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from workers import ROOT, free_port, null_classifier_service, wait_for

from ticketq import names
from worker.metrics import LATENCY_BUCKETS, ManyHistogram, Metrics


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_many_histogram_exposes_what_a_histogram_would():
    values = [0.0, 0.005, 0.0051, 0.3, 1, 2.5, 400.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("ticketq_x_seconds", "doc", buckets=LATENCY_BUCKETS, registry=one)
    for value in values:
        histogram.observe(value)
    bulk = ManyHistogram("ticketq_x_seconds", "doc", LATENCY_BUCKETS, many)
    bulk.observe_many(values[:3])
    bulk.observe(values[3])
    bulk.observe_many(values[4:])
    bulk.observe_many([])
    for name in ("ticketq_x_seconds_count", "ticketq_x_seconds_sum"):
        assert many.get_sample_value(name) == pytest.approx(one.get_sample_value(name))
    for bound in (*LATENCY_BUCKETS, "+Inf"):  # le: a value on a bound counts in that bucket
        labels = {"le": bound if isinstance(bound, str) else str(float(bound))}
        assert many.get_sample_value("ticketq_x_seconds_bucket", labels) == one.get_sample_value(
            "ticketq_x_seconds_bucket", labels
        ), labels
    assert b"# TYPE ticketq_x_seconds histogram" in generate_latest(many)


def test_healthz_readyz_and_metrics():
    metrics = Metrics()
    redis_up = {"up": True}

    def depth() -> int:
        if not redis_up["up"]:
            raise ConnectionError("connection refused")
        return 3

    consumer = {"running": False}
    metrics.watch_queue(depth)
    port = free_port()
    server = metrics.serve("127.0.0.1", port, ready=lambda: None if consumer["running"] else "consumer not running")
    base = f"http://127.0.0.1:{port}"
    try:
        assert get(f"{base}/healthz") == (200, "ok\n")
        status, body = get(f"{base}/readyz")
        assert status == 503 and "model not loaded" in body and "consumer not running" in body
        metrics.model.info({"model": "tiny"})
        consumer["running"] = True
        assert get(f"{base}/readyz") == (200, "ready\n")
        redis_up["up"] = False
        status, body = get(f"{base}/readyz")
        assert status == 503 and "Redis unreachable" in body
        assert get(f"{base}/healthz")[0] == 200  # alive even when not ready
        status, body = get(f"{base}/metrics")
        assert status == 200 and "ticketq_model_info" in body
    finally:
        server.shutdown()


def test_metrics_port_in_use_names_the_setting():
    from worker.metrics import MetricsPortInUse, port_problem

    metrics = Metrics()
    port = free_port()
    server = metrics.serve("127.0.0.1", port)
    try:
        assert f"TICKETQ_METRICS_PORT={port}" in (port_problem("127.0.0.1", port) or "")
        with pytest.raises(MetricsPortInUse, match=f"TICKETQ_METRICS_PORT={port}"):
            Metrics().serve("127.0.0.1", port)
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with null_classifier_service(tmp_path_factory.mktemp("ops-redis"), "ops") as service:
        yield service


def ticketq(args: list[str], url: str, queue: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=url, TICKETQ_QUEUE=queue)
    return subprocess.run([sys.executable, "-m", "worker.tools.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def test_status_dead_letters_requeue_and_result_lookup(service):
    url, queue = service
    app = Celery(broker=url, backend=url)
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
    assert ticketq(["result", "nope"], url, queue).returncode == 1

    # Blank text fails on every worker: the requeue says so and sends nothing; the letter stays.
    requeued = ticketq(["dead", "requeue", bad.id], url, queue)
    assert requeued.returncode == 3 and "can never succeed" in requeued.stderr, requeued.stderr
    assert "Traceback" not in requeued.stderr and client.llen(queue) == 0
    listed = ticketq(["dead", "list"], url, queue).stdout.splitlines()
    assert len(listed) == 1 and shown["entry_id"] in listed[0] and bad.id in listed[0], listed
