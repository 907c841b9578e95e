"""What a Prometheus user expects of a worker's /metrics: the process collector, build info, no
`_created` series, 404 off the three paths, running/waiting gauges, the shadow split into
near-ties and real disagreements, the worker's queue on its per-ticket series, and the backlog
exporter that needs no worker, one depth series per queue it watches."""

from __future__ import annotations

import io
import uuid

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from worker.constants import NEAR_TIE
from worker.httpserver import health_app
from worker.metrics import Metrics
from worker.results import Prediction
from worker.shadow import ShadowChecker

pytestmark = pytest.mark.integration

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


def test_the_per_ticket_series_carry_the_queue_given_at_construction():
    registry = CollectorRegistry()
    metrics = Metrics(registry, queue="fast")
    metrics.preinit(("billing", "account"), ("invalid",), [("support", "urgency", ("low", "high"))])
    metrics.watch_queue(lambda: 7)
    metrics.tickets.labels(label="billing", outcome="ok").inc(2)
    metrics.dead_letters.labels(reason="invalid").inc()
    metrics.field_answers.labels(schema="support", field="urgency", label="high", review="false").inc()
    metrics.latency.observe_many([0.1, 0.2])
    metrics.queue_wait.observe(0.05)
    value = registry.get_sample_value
    assert value("ticketq_tickets_total", {"queue": "fast", "label": "billing", "outcome": "ok"}) == 2
    assert value("ticketq_tickets_total", {"queue": "fast", "label": "account", "outcome": "ok"}) == 0  # preinit
    assert value("ticketq_dead_letters_total", {"queue": "fast", "reason": "invalid"}) == 1
    answer = {"queue": "fast", "schema": "support", "field": "urgency", "label": "high", "review": "false"}
    assert value("ticketq_field_answers_total", answer) == 1
    assert value("ticketq_latency_seconds_count", {"queue": "fast"}) == 2
    assert value("ticketq_latency_seconds_bucket", {"queue": "fast", "le": "0.25"}) == 2
    assert value("ticketq_queue_wait_seconds_count", {"queue": "fast"}) == 1
    assert value("ticketq_queue_depth", {"queue": "fast"}) == 7
    assert value("target_info", {"queue": "fast"}) == 1  # what the model's and batcher's series join on
    samples = [sample for family in registry.collect() for sample in family.samples]
    queues = {sample.labels["queue"] for sample in samples if "queue" in sample.labels}
    assert queues == {"fast"}
    tickets = [sample for sample in samples if sample.name == "ticketq_tickets_total"]
    assert {sample.labels["label"] for sample in tickets} == {"billing", "account", "none"}, "TICKETQ_LABELS'"
    assert value("ticketq_tokens_computed_total") == 0, "the process's series keep their unlabelled names"


def test_a_worker_without_a_queue_name_is_refused():
    with pytest.raises(ValueError, match="TICKETQ_QUEUE"):
        Metrics(CollectorRegistry(), queue="")


@pytest.fixture
def client():
    from workers import redis_or_skip

    client = redis_or_skip(REDIS_URL)
    yield client
    client.flushdb()
    client.close()


def test_the_exporter_reports_each_queue_s_backlog_with_no_worker(client):
    from ticketq.names import ALIVE_KEY, CONSUMERS_KEY, queue_lists
    from ticketq_cli.exporter import BacklogCollector

    queue, other, empty = (f"exporter-{uuid.uuid4().hex[:8]}" for _ in range(3))
    main, high = queue_lists(queue)[:2]
    client.rpush(main, "a", "b", "c")
    client.rpush(high, "d")  # a plain Celery client's priority message counts too
    client.rpush(queue_lists(other)[-1], "e", "f")
    client.hset(CONSUMERS_KEY, mapping={"live": "{}", "dead": "{}"})
    client.set(ALIVE_KEY.format(consumer="live"), "{}")
    registry = CollectorRegistry()
    registry.register(BacklogCollector(client, [queue, other, empty, queue]))
    depths = {sample.labels["queue"]: sample.value for family in registry.collect() for sample in family.samples
              if sample.name == "ticketq_queue_depth"}  # fmt: skip
    assert depths == {queue: 4, other: 2, empty: 0}, "one series per queue, a repeated one once"
    assert registry.get_sample_value("ticketq_consumers_alive") == 1
    assert registry.get_sample_value("ticketq_exporter_redis_up") == 1
    down = CollectorRegistry()
    down.register(BacklogCollector(redis.Redis(port=1, socket_connect_timeout=0.5), [queue]))
    assert down.get_sample_value("ticketq_exporter_redis_up") == 0
    assert down.get_sample_value("ticketq_queue_depth", {"queue": queue}) is None  # no value rather than a wrong 0


def test_the_exporter_takes_a_list_of_queues_not_a_name():
    from ticketq_cli.exporter import BacklogCollector

    for queues in ("ticketq", []):
        with pytest.raises(ValueError, match="non-empty list"):
            BacklogCollector(redis.Redis(port=1), queues)


def test_cost_model_is_exported_in_seconds():
    """The planner keeps its cost model in ms; Prometheus names carry base units (`promtool check
    metrics` refused `ticketq_cost_model_ms`), so the gauge is in seconds."""
    metrics = Metrics()
    metrics.observe_cost_model(2.0, 0.01, 0.0005)
    seconds = {term: metrics.registry.get_sample_value("ticketq_cost_model_seconds", {"term": term})
               for term in ("fixed", "token", "quad")}  # fmt: skip
    assert seconds == pytest.approx({"fixed": 0.002, "token": 1e-5, "quad": 5e-7})
