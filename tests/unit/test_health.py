"""Health endpoints and the metrics server, in process on a fresh registry: no Redis, no worker."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from workers import free_port

from worker.collectors import ManyHistogram
from worker.metrics import LATENCY_BUCKETS, Metrics


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
    from worker.httpserver import MetricsPortInUse, port_problem

    metrics = Metrics()
    port = free_port()
    server = metrics.serve("127.0.0.1", port)
    try:
        assert f"TICKETQ_METRICS_PORT={port}" in (port_problem("127.0.0.1", port) or "")
        with pytest.raises(MetricsPortInUse, match=f"TICKETQ_METRICS_PORT={port}"):
            Metrics().serve("127.0.0.1", port)
    finally:
        server.shutdown()
