"""A lease is a promise of progress: a worker whose classifying loop holds work without progress
for longer than TICKETQ_WORST_BATCH_S stops renewing its lease and fetching, says so on /readyz
and in `ticketq_classifying_stalled_seconds`, and renews again once it moves.

Four tiers: the progress record alone; the service marking it (in process, on the machine's Redis,
database 3, every check by its own task ids); the lease thread on a real kombu channel over a
private redis-server, held back by a stalled record; and two real worker processes (the
fault-injecting worker, tests/support/faults.py), the first hung in a forward until the test releases it.
Every wait polls for an event (a key gone, a log line, a result, /readyz) with a generous
deadline; the one bound on time asserted (the takeover) carries half a minute of slack.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import time
import uuid
from collections import Counter

import pytest
from faults import HANG_MARKER_ENV, RELEASE_FILE_ENV
from inprocess import REDIS_URL, results_of, service_fixtures, task_request
from kombu import Connection, Consumer, Queue
from test_memory import readyz
from test_reliability import (  # noqa: F401 -- `workers` is the fixture that starts (and stops) worker processes
    dead_letters,
    finals,
    nothing_in_flight,
    null_env,
    producer_for,
    results_stream,
    submit,
    wait_all_final,
    workers,
)
from workers import wait_for

from ticketq.names import ALIVE_KEY, OWNED_KEY
from worker.engine.batching import Batch, Plan
from worker.health import Health, Progress
from worker.metrics import Metrics
from worker.nullclassifier import NullClassifier
from worker.redis.outbox import Outbox
from worker.results import BatchReport
from worker.service.core import TicketService
from worker.service.hooks import Hook
from worker.service.hooks.standard import standard_hooks
from worker.settings import Settings
from worker.transport import fetch

pytestmark = pytest.mark.integration

LABELS = ("billing", "technical", "account")


# --------------------------------------------------------------------------------------------
# the progress record


def test_progress_is_stalled_only_with_work_in_hand_past_its_bound():
    progress = Progress()
    assert progress.stalled_for() == 0.0 and progress.bound_s == math.inf, "idle: never stalled"
    progress.begin(bound_s=3600)
    assert progress.stalled_for() == 0.0 and progress.bound_s == 3600
    progress.begin(bound_s=2)
    quiet = wait_for(progress.stalled_for, 30, "the record stalled past its bound")
    assert quiet > 2
    progress.advanced()
    assert progress.stalled_for() == 0.0, "progress restarts the wait"
    wait_for(progress.stalled_for, 30, "stalled again without more progress")
    progress.end()
    assert progress.stalled_for() == 0.0 and progress.bound_s == math.inf, "work let go: idle, not stalled"
    progress.advanced()
    assert progress.stalled_for() == 0.0 and progress.bound_s == math.inf, "progress while idle holds nothing"


# --------------------------------------------------------------------------------------------
# the service marks the record: work in hand from the job's start to its end, progress per forward


client, app = service_fixtures("ticketq-watchdog-test")


class SlowSecondForward(NullClassifier, Hook):
    """The null classifier's answers, one forward per text; before its second forward it waits until
    the progress record says stalled (the test's stand-in for a forward that takes too long). As a
    hook after the standard ones, it records the progress record once each forward is computed."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(LABELS)
        self.progress = progress  # the service's classifying loop record
        self.before: list[tuple[float, float]] = []  # (bound in hand, stalled for) before each forward
        self.after: list[float] = []  # stalled for, once each forward's hooks ran

    @property
    def seen(self) -> list[tuple[float, float, float]]:
        return [(*before, after) for before, after in zip(self.before, self.after, strict=True)]

    def plan(self, encoded):
        return Plan(tuple(Batch((i,), (len(text) // 4 + 1,), len(text) // 4 + 1) for i, text in enumerate(encoded)))

    def forward_batch(self, tickets, width=None):
        if len(self.before) == 1:
            wait_for(self.progress.stalled_for, 60, "the loop seen stalled before its second forward")
        self.before.append((self.progress.bound_s, self.progress.stalled_for()))
        return super().forward_batch(tickets, width)

    def on_forward(self, report: BatchReport) -> None:
        self.after.append(self.progress.stalled_for())  # recorded, not asserted: the service retries errors


def test_the_service_holds_work_from_job_start_to_end_and_marks_each_forward(client, app):
    bound = 2.0
    settings = Settings(broker_url=REDIS_URL, metrics_port=0, worst_batch_s=bound)
    health = Health()
    classifier = SlowSecondForward(health.classifying)
    hooks = [*standard_hooks(settings, classifier, Metrics(health=health), health.classifying), classifier]
    service = TicketService(settings, classifier, Outbox.from_settings(client, settings, health), hooks)
    requests = [task_request({"id": f"wd-{n}", "text": f"watchdog ticket {n}: my invoice is wrong"}) for n in range(3)]
    service.process(requests, app.backend)
    (first_bound, first, _), (_, second, after_second), (_, third, _) = classifier.seen
    assert first_bound == bound and first == 0.0, "the job's work is in hand under TICKETQ_WORST_BATCH_S"
    assert second > bound, "no progress for longer than the bound: stalled"
    assert after_second == 0.0, "a forward computed is progress"
    assert third == 0.0, "the forward and its publish were progress"
    assert health.classifying.stalled_for() == 0.0 and health.classifying.bound_s == math.inf, "the job ended: idle"
    assert len(results_of(client, {r.id for r in requests})) == 3


# --------------------------------------------------------------------------------------------
# the lease thread on a real channel: held back while stalled, renewed once the loop moves


def test_a_stalled_loop_holds_the_lease_and_the_fetch_back_until_it_moves(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="worker.transport.lease")
    queue, client, received = Queue("watchdog-lease"), redis_server.client(), []
    health = Health()  # the worker's, handed to its channel in the transport options
    options = {"ticketq_lease_s": 1, "ticketq_health": health}
    with Connection(redis_server.url, transport=fetch.Transport, transport_options=options) as conn:
        conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue], serializer="json")
        channel = conn.channel()
        alive = ALIVE_KEY.format(consumer=channel.consumer)
        callback = lambda body, message: (received.append(body), message.ack())  # noqa: E731
        with Consumer(channel, [queue], callbacks=[callback]):
            assert client.exists(alive) and channel.may_fetch(), "registered by its first beat"
            health.classifying.begin(bound_s=1.0)
            try:
                wait_for(lambda: not client.exists(alive), 30, "the lease run out while the loop is stalled")
                assert not channel.may_fetch(), "a stalled worker fetches nothing"
                with contextlib.suppress(socket.timeout, TimeoutError):
                    conn.drain_events(timeout=1)
                assert not received and client.llen(queue.name) == 1, "the message stays in the queue"
            finally:
                health.classifying.end()  # the job let its work go: renewal resumes at the next turn
            wait_for(lambda: client.exists(alive), 30, "the lease renewed once the loop is idle")
            deadline = time.monotonic() + 30
            while not received and time.monotonic() < deadline:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    conn.drain_events(timeout=1)
    assert received == [{"n": 1}], "fetching resumed"
    lines = Counter(_kind(record.getMessage()) for record in caplog.records)
    assert lines["held"] == 1 and lines["moves"] == 1 and lines["lapsed"] == 1, caplog.text


def _kind(line: str) -> str:
    for kind, text in (("held", "no longer renewed: the classifying loop"), ("moves", "the classifying loop moves"),
                       ("lapsed", "lapsed: not renewed")):  # fmt: skip
        if text in line:
            return kind
    return "other"


# --------------------------------------------------------------------------------------------
# two workers: one hung in a forward, its messages taken over by the other, answered once


LEASE_S = 2
WORST_BATCH_S = 3
HELD, LATE = 40, 40
SLACK_S = 30  # a loaded 2-core machine: start-up and scheduling, never the mechanism itself


def test_a_hung_forward_is_taken_over_and_every_ticket_answered_once(redis_server, workers, tmp_path):  # noqa: F811
    client, release, marker = redis_server.client(), tmp_path / "release", f"hang-{uuid.uuid4().hex[:8]}"
    # An hour's visibility timeout: only the lease can bring the hung worker's messages back in time.
    base = {"TICKETQ_VISIBILITY_TIMEOUT_S": "3600", "TICKETQ_LEASE_S": str(LEASE_S),
            "TICKETQ_WORST_BATCH_S": str(WORST_BATCH_S)}  # fmt: skip
    hung = workers(null_env(redis_server, **base, **{HANG_MARKER_ENV: marker, RELEASE_FILE_ENV: str(release)}),
                   "hung", faulty=True)  # fmt: skip
    producer = producer_for(redis_server)
    try:
        tickets = [{"id": "hang-0", "text": f"{marker}: my invoice is wrong"}]
        held = submit(producer, tickets + [{"id": f"held-{n}", "text": f"held ticket {n}"} for n in range(HELD)])
        hung.wait_log("forward hung", 60, "the worker's forward hung")
        hung_at = time.monotonic()
        status, text = wait_for(lambda: _stalled(hung), 60, "/readyz saying the worker is stalled")
        assert status == 503, text
        assert hung.metrics()["ticketq_classifying_stalled_seconds{}"] > WORST_BATCH_S
        owned = sum(client.scard(key) for key in client.keys(OWNED_KEY.format(consumer="*")))

        taker = workers(null_env(redis_server, **base), "taker", faulty=True)
        ready_at = time.monotonic()
        wait_all_final(client, held, 120, "the taker answering what the hung worker held")
        taken_over_s, since_hang_s = time.monotonic() - ready_at, time.monotonic() - hung_at
        assert _stalled(hung), "still hung: the answers came from the taker"
        late = submit(producer, [{"id": f"late-{n}", "text": f"late ticket {n}"} for n in range(LATE)])
        wait_all_final(client, late, 60, "tickets sent while the worker is hung, answered by the taker")
        by_worker = Counter(result["worker"] for _, result in results_stream(client))
        assert set(by_worker) == {f"{socket.gethostname()}:{taker.pid}"}, by_worker

        release.touch()
        wait_for(lambda: readyz(hung)[0] == 200, 60, "the released worker ready again")
        hung.wait_log("another worker had recovered it", 60, "the released worker renewing its lease")
        wait_for(lambda: nothing_in_flight(client), 60, "every message acked, nothing left in flight")
    finally:
        release.touch()
        producer.close()
    counts = finals(client)
    bound_s = WORST_BATCH_S + 1.25 * LEASE_S
    rerun = hung.metrics()["ticketq_duplicate_results_total{}"]
    print(f"\n[hung forward] {len(held)} tickets sent to one worker, {owned} held by it when it stalled; a second "
          f"worker answered them {since_hang_s:.1f}s after the hang, {taken_over_s:.1f}s after it was ready (bound "
          f"{bound_s:g}s: worst batch {WORST_BATCH_S}s + 1.25 x lease {LEASE_S}s), and {len(late)} sent meanwhile; "
          f"after the release the hung worker re-ran {rerun:.0f} ticket(s), published once; "
          f"stream entries {sum(counts.values())} for {len(counts)} tickets")  # fmt: skip
    assert owned > 0, "the hung worker held messages when it stalled"
    assert taken_over_s < bound_s + SLACK_S, "taken over within worst batch + lease (+ the slack of a loaded machine)"
    assert set(counts) == held | late and set(counts.values()) == {1}, "nothing lost, nothing streamed twice"
    assert {result["status"] for _, result in results_stream(client)} == {"ok"} and not dead_letters(client)
    assert rerun > 0, "its late results were repeats, not streamed"
    assert hung.log().count("no longer renewed: the classifying loop") == 1, "logged once"


def _stalled(worker) -> tuple[int, str] | None:
    status, text = readyz(worker)
    return (status, text) if "classifying stalled for" in text else None
