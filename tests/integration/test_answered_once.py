"""One answer per ticket, in process: `TicketService` with the null classifier against a private
redis-server and Celery's real Redis result backend.

- a worker that fails its batch after another worker answered it (cut off from Redis longer than its
  lease, then healed) writes no `worker_error` FAILURE or dead letter for what is answered;
- a second message under a used task id, with another ticket, is answered `duplicate_task_id` with a
  dead letter; a re-delivery of the same message is published once, as before;
- `ticketq_tickets_total` counts each ticket once; re-executions go to
  `ticketq_duplicate_results_total` only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import redis
from celery import Celery, states
from celery_batches import SimpleRequest
from prometheus_client import CollectorRegistry
from workers import RedisServer, close_results_app

from ticketq import names
from worker.health import Health, Progress
from worker.metrics import Metrics
from worker.nullclassifier import NullClassifier
from worker.redis.keys import DONE_KEY
from worker.redis.outbox import Outbox
from worker.service.core import TicketService
from worker.service.hooks.standard import standard_hooks
from worker.settings import Settings

pytestmark = pytest.mark.integration

LABELS = ("billing", "technical", "account")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("answered-redis"), aof=False).start()
    yield server
    server.kill()


@pytest.fixture
def client(server) -> Iterator[redis.Redis]:
    client = server.client()
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def app(server) -> Iterator[Celery]:
    app = Celery("ticketq-answered-test", broker=server.url, backend=server.url, set_as_current=False)
    app.conf.update(result_serializer="json", accept_content=["json"], result_accept_content=["json"],
                    result_expires=600, result_extended=False)  # fmt: skip
    yield app
    close_results_app(app)  # before the module's redis-server goes


def service_on(server: RedisServer, client: redis.Redis) -> tuple[TicketService, CollectorRegistry]:
    registry = CollectorRegistry()
    settings, classifier = Settings(broker_url=server.url, metrics_port=0, max_retries=1), NullClassifier(LABELS)
    hooks = standard_hooks(settings, classifier, Metrics(registry), Progress())
    return TicketService(settings, classifier, Outbox.from_settings(client, settings, Health()), hooks), registry


def request(task_id: str, payload: object) -> SimpleRequest:
    return SimpleRequest(task_id, names.TASK_CLASSIFY, (payload,), {}, {}, "test", False, None, None, {})


def stream(client: redis.Redis, task_id: str) -> list[dict]:
    entries = (json.loads(fields[b"data"]) for _, fields in client.xrange(names.RESULTS_STREAM))
    return [entry for entry in entries if entry["task_id"] == task_id]


def dead(client: redis.Redis, task_id: str) -> list[dict]:
    entries = client.xrange(names.DEAD_LETTER_STREAM)
    letters = ({k.decode(): v.decode() for k, v in fields.items()} for _, fields in entries)
    return [letter for letter in letters if letter["task_id"] == task_id]


def dead_letters(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("ticketq_dead_letters_total", {"queue": names.QUEUE, "reason": reason})


def tickets_total(registry: CollectorRegistry) -> float:
    return sum(sample.value for metric in registry.collect() if metric.name == "ticketq_tickets"
               for sample in metric.samples if sample.name == "ticketq_tickets_total")  # fmt: skip


def test_a_failed_batch_spares_what_another_worker_answered(server, client, app):
    answered = request("answered-1", {"id": "A-1", "text": "I was charged twice"})
    pack = request("answered-pack", [{"id": "P-1", "text": "refund"}, {"id": "P-2", "text": "login fails"}])
    open_ = request("open-1", {"id": "O-1", "text": "the app crashes"})
    other_worker, _ = service_on(server, client)
    other_worker.process([answered, pack], app.backend)
    assert app.AsyncResult(answered.id).state == states.SUCCESS

    # the cut-off worker comes back and fails the batch it still held: only what has no answer
    healed, registry = service_on(server, client)
    healed.defence.fail_open([answered, pack, open_], app.backend, ConnectionError("Redis unreachable for 40s"))
    assert app.AsyncResult(answered.id).state == states.SUCCESS, "the answer is not overwritten by a FAILURE"
    assert app.AsyncResult(pack.id).state == states.SUCCESS
    assert not dead(client, answered.id) and not dead(client, pack.id)
    assert app.AsyncResult(open_.id).state == states.FAILURE
    assert [letter["reason"] for letter in dead(client, open_.id)] == ["worker_error"]
    assert dead_letters(registry, "worker_error") == 1

    # every ticket streamed, backend result not written yet (the other worker is between the two): spared too
    streamed_only = request("streamed-only", {"id": "S-1", "text": "wrong VAT"})
    other_worker.outbox.publish([(streamed_only.id, 0, b'{"task_id": "streamed-only"}')], [])
    healed.defence.fail_open([streamed_only], app.backend, ConnectionError("cut off"))
    assert app.AsyncResult(streamed_only.id).state == states.PENDING and not dead(client, streamed_only.id)


def test_a_reused_task_id_is_answered_and_a_redelivery_published_once(server, client, app):
    service, registry = service_on(server, client)
    first = {"id": "T-1", "text": "my invoice is wrong"}
    service.process([request("reused", first)], app.backend)
    assert tickets_total(registry) == 1

    # another message, another ticket, the same task id: answered, dead-lettered, never dropped
    second = {"id": "T-2", "text": "please delete my account"}
    service.process([request("reused", second)], app.backend)
    results = stream(client, "reused")
    assert [(r["id"], r["status"], r.get("reason")) for r in results] == [
        ("T-1", "ok", None), ("T-2", "failed", "duplicate_task_id")]  # fmt: skip
    letters = dead(client, "reused")
    assert [letter["reason"] for letter in letters] == ["duplicate_task_id"]
    assert json.loads(letters[0]["payload"]) == second
    assert app.AsyncResult("reused").get(timeout=5)["id"] == "T-1", "the backend keeps the first message's answer"
    assert dead_letters(registry, "duplicate_task_id") == 1

    # the first message delivered again (a crash, a lease recovery, a re-send): published once,
    # counted as a re-execution, not as a ticket done
    service.process([request("reused", dict(first))], app.backend)
    assert len(stream(client, "reused")) == 2
    assert tickets_total(registry) == 2
    assert registry.get_sample_value("ticketq_duplicate_results_total") == 1

    # packed: the same pack again is a repeat; a pack with other tickets under its id, a conflict
    pack = [{"text": "refund"}, {"text": "export broken"}]
    service.process([request("pack", pack)], app.backend)
    service.process([request("pack", [dict(t) for t in pack])], app.backend)
    service.process([request("pack", [{"text": "refund"}, {"text": "another"}])], app.backend)
    statuses = [(r["id"], r["status"], r.get("reason")) for r in stream(client, "pack")]
    reused = [("pack:0", "failed", "duplicate_task_id"), ("pack:1", "failed", "duplicate_task_id")]
    assert statuses == [("pack:0", "ok", None), ("pack:1", "ok", None), *reused]
    assert registry.get_sample_value("ticketq_duplicate_results_total") == 3
    assert tickets_total(registry) == 6
    assert client.bitcount(DONE_KEY.format(task_id="pack")) == 2
