"""What a Prometheus user expects of a worker's /metrics: the process collector, build info, no
`_created` series, 404 off the three paths, running/waiting gauges, the shadow split into
near-ties and real disagreements, and the backlog exporter that needs no worker."""

from __future__ import annotations

import io
import uuid

import pytest
import redis
from prometheus_client import generate_latest

from worker.constants import NEAR_TIE
from worker.metrics import Metrics, health_app
from worker.results import Prediction
from worker.shadow import ShadowChecker

REDIS_URL = "redis://127.0.0.1:6379/9"


def _exposition(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def test_process_and_build_series_and_no_created():
    metrics = Metrics()
    metrics.tickets.labels(label="billing", outcome="ok").inc()
    text = _exposition(metrics)
    assert "process_resident_memory_bytes" in text and "process_open_fds" in text
    assert 'ticketq_build_info{' in text and 'torch="' in text and 'version="' in text
    assert "_created" not in text


def _get(app, path: str) -> tuple[str, bytes]:
    status = {}
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": "", "wsgi.input": io.BytesIO()},
                        lambda s, headers: status.setdefault("s", s)))  # fmt: skip
    return status["s"], body


def test_only_the_three_paths_answer():
    from prometheus_client import make_wsgi_app

    metrics = Metrics()
    app = health_app(make_wsgi_app(metrics.registry), [lambda: None])
    assert _get(app, "/metrics")[0].startswith("200") and b"ticketq_tickets_total" in _get(app, "/metrics")[1]
    assert _get(app, "/healthz")[0].startswith("200") and _get(app, "/readyz")[0].startswith("200")
    for path in ("/", "/favicon.ico", "/metrics/x"):
        assert _get(app, path)[0].startswith("404"), path


def test_waiting_and_running_are_sampled_at_scrape():
    from worker.transport.batches import Batches

    batches = Batches()
    batches._held.extend([object(), object()])
    batches._unacked = {"t1": [object()], "t2": [object(), object()]}
    metrics = Metrics()
    metrics.watch_requests(batches.waiting, batches.running)
    assert metrics.registry.get_sample_value("ticketq_requests_waiting") == 2
    assert metrics.registry.get_sample_value("ticketq_requests_running") == 3


class _Reference:
    def __init__(self, prediction: Prediction) -> None:
        self.prediction = prediction

    def reference(self, text: str) -> Prediction:
        return self.prediction


def _prediction(label: str, margin: float) -> Prediction:
    return Prediction(label, {label: 0.5 + margin / 2}, margin, False, 3)


@pytest.mark.parametrize(("margin", "near_tie"), [(NEAR_TIE / 2, "true"), (0.5, "false")])
def test_a_shadow_flip_is_a_near_tie_only_when_the_reference_was_close(margin, near_tie):
    metrics = Metrics()
    metrics.preinit(("billing", "account"), ())
    checker = ShadowChecker(_Reference(_prediction("account", margin)), metrics, rate=1.0)
    checker.offer("my invoice", _prediction("billing", 0.3))
    checker.join()
    value = metrics.registry.get_sample_value
    assert value("ticketq_shadow_checked_total") == 1 and value("ticketq_shadow_agreed_total") == 0
    assert value("ticketq_shadow_disagreed_total", {"near_tie": near_tie}) == 1
    other = "false" if near_tie == "true" else "true"
    assert value("ticketq_shadow_disagreed_total", {"near_tie": other}) == 0


@pytest.fixture
def client():
    from workers import redis_or_skip

    client = redis_or_skip(REDIS_URL)
    yield client
    client.flushdb()
    client.close()


@pytest.mark.integration
def test_the_exporter_reports_the_backlog_with_no_worker(client):
    from prometheus_client import CollectorRegistry

    from ticketq.names import queue_lists
    from worker import store
    from worker.tools.exporter import BacklogCollector

    queue = f"exporter-{uuid.uuid4().hex[:8]}"
    main, high = queue_lists(queue)[:2]
    client.rpush(main, "a", "b", "c")
    client.rpush(high, "d")  # a plain Celery client's priority message counts too
    client.hset(store.CONSUMERS_KEY, mapping={"live": "{}", "dead": "{}"})
    client.set(store.ALIVE_KEY.format(consumer="live"), "{}")
    registry = CollectorRegistry()
    registry.register(BacklogCollector(client, queue))
    assert registry.get_sample_value("ticketq_queue_depth") == 4
    assert registry.get_sample_value("ticketq_consumers_alive") == 1
    assert registry.get_sample_value("ticketq_exporter_redis_up") == 1
    down = CollectorRegistry()
    down.register(BacklogCollector(redis.Redis(port=1, socket_connect_timeout=0.5), queue))
    assert down.get_sample_value("ticketq_exporter_redis_up") == 0
    assert down.get_sample_value("ticketq_queue_depth") is None  # no value rather than a wrong 0
