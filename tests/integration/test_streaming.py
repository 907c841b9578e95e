"""Results stream out per forward batch: the engine's callback, the service's publishing, expiry.

Two tiers: the engine on the tiny stand-in (its offline `on_predictions` callback), and `TicketService` in
process against the real Redis at 127.0.0.1:6379 (database 3, never flushed: every check filters
by its own task ids) with Celery's real Redis result backend. A scripted classifier checks, at the
moment it starts forward batch k, what the service has already published for batches < k: the
synchronisation is the classifier's own call, not a sleep.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import states
from celery.result import AsyncResult
from celery_batches import SimpleRequest
from inprocess import REDIS_URL, results_of, service_fixtures, task_request

from ticketq import names
from ticketq.names import ATTEMPTS_KEY
from worker.engine.batching import Batch, Plan
from worker.health import Health, Progress
from worker.metrics import Metrics
from worker.nullclassifier import NullClassifier
from worker.redis.outbox import Outbox
from worker.results import Prediction
from worker.service.core import TicketService
from worker.service.hooks.standard import standard_hooks
from worker.settings import Settings

pytestmark = pytest.mark.integration

LABELS = ("billing", "technical", "account")


# --------------------------------------------------------------------------------------------
# the engine hands over each forward batch as soon as it is computed


def test_engine_hands_each_forward_batch_to_on_predictions(tiny_engine):
    texts = [f"ticket {i}: " + "my invoice is wrong " * (1 + i % 7) for i in range(40)]
    seen: list[tuple[tuple[int, ...], list[Prediction]]] = []
    reports = []

    def on_predictions(indices: Sequence[int], predictions: list[Prediction]) -> None:
        assert len(reports) == len(seen) + 1, "on_batch (metrics) runs first, then the batch's predictions"
        seen.append((tuple(indices), predictions))

    plan = tiny_engine.plan(tiny_engine.encode(texts))
    predictions, _ = tiny_engine.classify(texts, plan=plan, on_batch=reports.append, on_answers=on_predictions)
    assert [indices for indices, _ in seen] == [batch.indices for batch in plan.batches]
    for indices, batch_predictions in seen:
        assert batch_predictions == [predictions[i] for i in indices]


# --------------------------------------------------------------------------------------------
# the service, in process, on the real Redis and Celery's Redis backend


client, app = service_fixtures("ticketq-streaming-test")


class ScriptedClassifier(NullClassifier):
    """The null classifier's answers, `batch` texts per forward, in order; `before(k, texts)` runs
    before forward k.

    `fail_once_at`: forward batch k raises once (an engine error after earlier batches succeeded).
    """

    def __init__(self, batch: int, before=None, fail_once_at: int | None = None) -> None:
        super().__init__(LABELS)
        self.batch, self.before, self.fail_once_at = batch, before, fail_once_at
        self.computed: list[str] = []
        self.forwards = 0

    def plan(self, encoded):
        lengths = [len(text) // 4 + 1 for text in encoded]
        cuts = range(0, len(encoded), self.batch)
        return Plan(tuple(Batch(tuple(range(i, min(i + self.batch, len(encoded)))), tuple(lengths[i:i + self.batch]),
                                max(lengths[i:i + self.batch])) for i in cuts))  # fmt: skip

    def forward_batch(self, tickets, width=None):
        k, self.forwards = self.forwards, self.forwards + 1
        if self.before:
            self.before(k, tickets)
        if k == self.fail_once_at:
            self.fail_once_at = None
            raise RuntimeError("scripted engine fault")
        self.computed += tickets
        return super().forward_batch(tickets, width)


def _service(classifier, client: redis.Redis, metrics: Metrics | None = None) -> TicketService:
    settings = Settings(broker_url=REDIS_URL, metrics_port=0, max_retries=1)
    hooks = standard_hooks(settings, classifier, metrics or Metrics(), Progress())
    return TicketService(settings, classifier, Outbox.from_settings(client, settings, Health()), hooks)


def _ticket(i: int, tag: str) -> dict:
    return {"id": f"{tag}-{i}", "text": f"{tag} ticket {i}: my invoice is wrong", "submitted_at": 1.0}


def test_each_forward_batch_is_published_before_the_next_is_computed(client, app):
    requests = [task_request(_ticket(i, "stream")) for i in range(6)]
    ids = {r.id for r in requests}
    published_before: list[int] = []

    def before(k: int, texts) -> None:
        published_before.append(len(results_of(client, ids)))
        done = [AsyncResult(r.id, app=app).state == states.SUCCESS for r in requests]
        assert sum(done) == published_before[-1], "the backend is written with the stream, per forward batch"

    metrics = Metrics()
    _service(ScriptedClassifier(batch=2, before=before), client, metrics).process(requests, app.backend)
    assert published_before == [0, 2, 4]
    stream = results_of(client, ids)
    assert sorted(entry["id"] for entry in stream) == sorted(f"stream-{i}" for i in range(6))
    for request in requests:
        stored = AsyncResult(request.id, app=app)
        assert stored.state == states.SUCCESS and stored.result["task_id"] == request.id
    assert not any(client.exists(ATTEMPTS_KEY.format(task_id=r.id)) for r in requests)
    registry = metrics.registry
    assert registry.get_sample_value("ticketq_publish_seconds_count") == 3
    assert registry.get_sample_value("ticketq_time_to_first_result_seconds_count") == 1


def test_packed_message_is_done_once_its_last_ticket_is(client, app):
    pack = task_request([_ticket(i, "pack") for i in range(4)])
    states_seen: list[tuple[int, str]] = []

    def before(k: int, texts) -> None:
        states_seen.append((len(results_of(client, {pack.id})), AsyncResult(pack.id, app=app).state))

    _service(ScriptedClassifier(batch=3, before=before), client).process([pack], app.backend)
    assert states_seen == [(0, states.PENDING), (3, states.PENDING)], "stream entries first, backend at the end"
    rows = AsyncResult(pack.id, app=app).get(timeout=5)
    assert [row["id"] for row in rows] == [f"pack-{i}" for i in range(4)]
    assert len(results_of(client, {pack.id})) == 4


def test_engine_error_after_a_published_batch_retries_only_the_rest(client, app):
    requests = [task_request(_ticket(i, "retry")) for i in range(6)]
    classifier = ScriptedClassifier(batch=2, fail_once_at=1)
    _service(classifier, client).process(requests, app.backend)
    texts = [r.args[0]["text"] for r in requests]
    assert classifier.computed.count(texts[0]) == 1, "a published batch is not computed again"
    assert sorted(classifier.computed) == sorted(texts)
    stream = results_of(client, {r.id for r in requests})
    assert sorted(e["id"] for e in stream) == sorted(f"retry-{i}" for i in range(6))
    assert {e["status"] for e in stream} == {"ok"}
    assert all(AsyncResult(r.id, app=app).state == states.SUCCESS for r in requests)


class RecordingFeed:
    """A feed that brings nothing new and records which messages the service acknowledged."""

    def __init__(self) -> None:
        self.acked: list[str] = []

    def more(self) -> list[SimpleRequest]:
        return []

    def done(self, task_ids: Sequence[str], failures=None, answers=None, revoked=()) -> None:
        self.acked += task_ids


def test_a_failed_publish_leaves_no_message_unanswered_or_acked_early(client, app):
    """The second forward batch's publish fails (Redis refusing, past its retries): the first batch
    stays published and acked; every other message gets a FAILURE result (none is left PENDING)
    and is acked as answered only if its results are out; a publish error is not retried."""
    requests = [task_request(_ticket(i, "pubfail")) for i in range(6)]
    classifier = ScriptedClassifier(batch=2)
    service = _service(classifier, client)
    publish, calls = service.outbox.publish, []

    def failing_publish(slots, finished, review=()):
        calls.append(len(slots))
        if len(calls) == 2:
            raise redis.ResponseError("scripted: the publish script failed")
        return publish(slots, finished, review)

    service.outbox.publish = failing_publish
    feed = RecordingFeed()
    service.process(requests, app.backend, feed)
    state = {r.id: AsyncResult(r.id, app=app).state for r in requests}
    answered = {task_id for task_id, st in state.items() if st == states.SUCCESS}
    failed = [r.id for r in requests[2:4]]  # the batch whose publish failed
    assert {r.id for r in requests[:2]} <= answered, "what was published before the failure stays published"
    assert [state[task_id] for task_id in failed] == [states.FAILURE] * 2 and "publish" in str(
        AsyncResult(failed[0], app=app).result)  # fmt: skip
    assert set(state.values()) <= {states.SUCCESS, states.FAILURE}, f"a message left unanswered: {state}"
    assert sorted(feed.acked) == sorted(answered), "acked as answered exactly when its results are out"
    assert {e["task_id"] for e in results_of(client, set(state))} == answered
    assert calls == [2, 2] and len(classifier.computed) == 4, "a publish error stops the job, is not retried"


def test_re_execution_publishes_nothing_twice(client, app):
    requests = [task_request(_ticket(i, "twice")) for i in range(3)] + [task_request([_ticket(9, "twice-pack")])]
    first = _service(ScriptedClassifier(batch=2), client)
    first.process(requests, app.backend)
    stored = {r.id: AsyncResult(r.id, app=app).result for r in requests}
    metrics = Metrics()
    again = _service(ScriptedClassifier(batch=2), client, metrics)
    again.process(requests, app.backend)  # a crash-redelivery: attempts keys are gone, results are not
    assert len(results_of(client, {r.id for r in requests})) == 4
    assert {r.id: AsyncResult(r.id, app=app).result for r in requests} == stored, "a stored result is kept"
    assert metrics.registry.get_sample_value("ticketq_duplicate_results_total") == 4


def test_expired_message_is_answered_without_being_computed(client, app):
    now = datetime.now(timezone.utc)
    late = task_request(_ticket(0, "late"), expires=now - timedelta(seconds=5))
    late_pack = task_request([_ticket(1, "late"), _ticket(2, "late")], expires=now - timedelta(seconds=1))
    timely = task_request(_ticket(3, "timely"), expires=now + timedelta(hours=1))
    classifier = ScriptedClassifier(batch=8)
    metrics = Metrics()
    _service(classifier, client, metrics).process([late, late_pack, timely], app.backend)
    assert classifier.computed == [timely.args[0]["text"]]
    stream = {e["id"]: e for e in results_of(client, {late.id, late_pack.id, timely.id})}
    assert {i: e["status"] for i, e in stream.items()} == {"late-0": "failed", "late-1": "failed",
                                                          "late-2": "failed", "timely-3": "ok"}  # fmt: skip
    assert {stream[i]["reason"] for i in ("late-0", "late-1", "late-2")} == {"expired"}
    failed = AsyncResult(late.id, app=app)
    assert failed.state == states.REVOKED and "expired" in str(failed.result), "ended as Celery ends it"
    assert [row["reason"] for row in AsyncResult(late_pack.id, app=app).get(timeout=5)] == ["expired", "expired"]
    value, queue = metrics.registry.get_sample_value, metrics.queue
    assert value("ticketq_tickets_total", {"queue": queue, "label": "none", "outcome": "expired"}) == 3
    assert value("ticketq_dead_letters_total", {"queue": queue, "reason": "expired"}) is None, "not dead-lettered"


# --------------------------------------------------------------------------------------------
# a real worker reads Celery's `expires` from a real message


def test_worker_answers_an_expired_message_as_expired(client, tmp_path):
    from workers import running_worker, worker_env

    from producer.api import Producer

    queue = f"stream-expiry-{uuid.uuid4().hex[:8]}"
    env = worker_env(None, REDIS_URL, queue, TICKETQ_NULL_CLASSIFIER="1")
    producer = Producer(Settings(broker_url=REDIS_URL, queue=queue))
    with running_worker(env, tmp_path / "worker.log"), producer:
        send = producer.app.send_task
        past = datetime.now(timezone.utc) - timedelta(seconds=30)
        late = send(names.TASK_CLASSIFY, args=[_ticket(0, "real-late")], queue=queue, expires=past)
        timely = send(names.TASK_CLASSIFY, args=[_ticket(1, "real-timely")], queue=queue, expires=3600)
        assert timely.get(timeout=60)["status"] == "ok"
        with pytest.raises(Exception, match="expired"):
            late.get(timeout=60)
        assert late.state == states.REVOKED, "a message past its expires ends as Celery ends it"
    (entry,) = results_of(client, {late.id})
    assert entry["status"] == "failed" and entry["reason"] == "expired" and entry["id"] == "real-late-0"


# --------------------------------------------------------------------------------------------
# a real worker plans over everything that arrived while its model was busy


class EndlessFeed:
    """A feed under steady traffic: two new requests every time it is asked; records what is acked."""

    def __init__(self) -> None:
        self.given: list[SimpleRequest] = []
        self.acked: list[str] = []

    def more(self) -> list[SimpleRequest]:
        arrived = [task_request(_ticket(len(self.given) + i, "endless")) for i in range(2)]
        self.given += arrived
        return arrived

    def done(self, task_ids: Sequence[str], failures=None, answers=None, revoked=()) -> None:
        self.acked += task_ids


def test_requests_arriving_between_forwards_join_the_job_and_are_acked_as_answered(client, app):
    """A job takes arrivals between forwards, answers each exactly once, acks each as it is answered,
    and ends under steady traffic once it has taken `job_limit` tickets."""
    service = _service(NullClassifier(("billing", "other")), client)
    service.job_limit = 20
    feed, first = EndlessFeed(), [task_request(_ticket(i, "first")) for i in range(3)]
    service.process(first, app.backend, feed)
    ids = {r.id for r in first} | {r.id for r in feed.given}
    assert 20 <= len(ids) <= 22, "the job stopped taking requests at its limit"
    assert sorted(feed.acked) == sorted(ids), "every request taken in was acked once, as it was answered"
    entries = results_of(client, ids)
    assert sorted(e["task_id"] for e in entries) == sorted(ids) and all(e["status"] == "ok" for e in entries)


def test_a_running_job_takes_held_requests_and_acks_each_once_its_result_is_out(monkeypatch):
    """The protocol between worker.transport.batches.Batches and the service, with a pool that runs jobs inline."""
    from types import SimpleNamespace

    import celery_batches
    from celery.concurrency.thread import TaskPool

    from worker.transport import batches as transport_batches

    acked: list[str] = []

    def request(task_id: str) -> SimpleNamespace:
        return SimpleNamespace(
            id=task_id, name="t", _payload=(({"text": task_id},), {}, None), delivery_info={}, hostname="h",
            reply_to=None, correlation_id=None, request_dict={}, task=SimpleNamespace(acks_late=True),
            acknowledge=lambda: acked.append(task_id),
        )  # fmt: skip

    class InlinePool(TaskPool):
        def __init__(self) -> None:  # no threads: apply_async runs the job and its callbacks at once
            pass

        def apply_async(self, target, args, accept_callback=None, callback=None, **_):
            accept_callback(0, 0.0)
            callback(target(*args))

    batches = transport_batches.Batches()
    batches._pool = InlinePool()
    jobs: list[list[str]] = []

    def job(task, args, loglevel, logfile):
        jobs.append([r.id for r in args[0]])
        if len(jobs) == 1:
            batches.flush([request("b"), request("c")])  # arrive while the job runs: held
            assert [r.id for r in batches.more()] == ["b", "c"], "held requests join the running job"
            assert batches.more() == []
            broken = request("e")
            broken.acknowledge = lambda: 1 / 0
            batches.flush([broken])
            assert [r.id for r in batches.more()] == ["e"]
            batches.done(["e"])  # an ack that fails is logged, never raised into the publishing path
            batches.flush([request("d")])  # held, never taken: it is the next job
            batches.done(["a", "b"])
            assert acked == ["a", "b"], "acked as soon as their results are out, not at the job's end"

    monkeypatch.setattr(celery_batches, "apply_batches_task", job)
    batches.flush([request("a")])
    assert jobs == [["a"], ["d"]]  # "e" joined the first job
    assert sorted(acked) == ["a", "b", "c", "d"], "every request acked exactly once (c and d when their job returned)"


def test_flushes_held_while_the_model_is_busy_become_one_job(client, tmp_path):
    """40 single messages reach a worker whose classifier takes 0.5 s a forward, window 4.

    Stock celery-batches made each 4-message flush its own pool job: 10 jobs of 4, queued behind
    each other. Here flushes that come while a job runs are held and the running job takes them
    between two forwards, so the engine plans over nearly all of them at once: 1-2 jobs, one
    forward holding most tickets. The first ticket's forward hangs until the other 39 are fetched,
    so they arrive during a forward (the job takes what is waiting before its first one too).
    """
    import sys

    from faults import COMMAND, DELAY_ENV, HANG_MARKER_ENV, RELEASE_FILE_ENV
    from workers import wait_for, worker_env

    from producer.api import Producer
    from ticketq_bench.procs import WorkerProcess

    queue = f"stream-held-{uuid.uuid4().hex[:8]}"
    release, marker = tmp_path / "release", "held-first-forward"
    env = worker_env(None, REDIS_URL, queue, TICKETQ_BATCH_WINDOW="4", TICKETQ_MAX_WAIT_MS="20",
                     TICKETQ_PREFETCH_MULTIPLIER="64",
                     **{DELAY_ENV: "0.5", HANG_MARKER_ENV: marker, RELEASE_FILE_ENV: str(release)})  # fmt: skip
    log = tmp_path / "worker.log"
    worker = WorkerProcess(env, log, command=[sys.executable, *COMMAND])
    producer = Producer(Settings(broker_url=REDIS_URL, queue=queue))
    try:
        worker.wait_ready(120)
        with producer:
            first = producer.submit_many([{**_ticket(0, "held"), "text": f"{marker}: my invoice is wrong"}])
            wait_for(lambda: "forward hung" in log.read_text(), 60, "the first forward running")
            rest = producer.submit_many([_ticket(i, "held") for i in range(1, 40)])
            wait_for(lambda: client.llen(queue) == 0, 60, "the other 39 fetched while the first forward runs")
            release.touch()
            results = producer.wait([*first, *rest], timeout=60)
        metrics = worker.metrics()
    finally:
        worker.stop()
    jobs = metrics["ticketq_flushes_total{}"]
    forwards = metrics["ticketq_batch_size_count{}"]
    above_16 = forwards - metrics["ticketq_batch_size_bucket{le=16.0}"]
    print(f"\n[held flushes] 40 messages, window 4, 0.5 s per forward: {jobs:.0f} jobs, {forwards:.0f} forwards, "
          f"{above_16:.0f} above 16 tickets")  # fmt: skip
    assert [r["status"] for r in results] == ["ok"] * 40
    assert jobs <= 4, "flushes held while the model was busy must go as one job"
    assert above_16 >= 1, "one job must hold most of the tickets"
    assert forwards > jobs, "a running job takes what arrived during its forward"
