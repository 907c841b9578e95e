"""Celery's monitoring for ticketq's batched requests: what Flower, `celery events` and
`celery inspect` see of a real worker (the null classifier, slowed so messages are in flight).

An event receiver on the broker records every event; remote control switches task events on, as
Flower does every few seconds; `inspect` reports the buffered and running messages. With Flower
installed (`pip install flower`), a real Flower shows the worker online and each task's state
and runtime.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from functools import partial

import pytest
from celery import Celery
from faults import DELAY_ENV
from workers import Worker, free_port, redis_or_skip, wait_for, worker_command, worker_env

from ticketq.names import TASK_CLASSIFY

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/10"


class Recorder(threading.Thread):
    """Every event on the broker, from a Receiver on a connection of its own."""

    def __init__(self, app: Celery) -> None:
        super().__init__(daemon=True)
        self.app, self.events, self.ready = app, [], threading.Event()
        self.receiver = None

    def run(self) -> None:
        with self.app.connection() as connection:
            self.receiver = self.app.events.Receiver(connection, handlers={"*": self.events.append})
            self.ready.set()
            self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def of(self, kind: str) -> list[dict]:
        return [event for event in list(self.events) if event["type"] == kind]

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True


@pytest.fixture
def monitored(tmp_path) -> Iterator[tuple[Worker, Celery, Recorder, str]]:
    client = redis_or_skip(REDIS_URL)
    client.flushdb()
    queue = f"events-{uuid.uuid4().hex[:8]}"
    app = Celery("monitor", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
    recorder = Recorder(app)
    recorder.start()
    assert recorder.ready.wait(10)
    env = worker_env(None, REDIS_URL, queue, TICKETQ_NULL_CLASSIFIER="1", **{DELAY_ENV: "0.5"})
    worker = Worker(env, tmp_path / "worker.log", command=worker_command(faulty=True))
    worker.wait_ready(timeout=120)
    try:
        yield worker, app, recorder, queue
    finally:
        worker.stop(timeout=30)
        recorder.stop()
        app.close()
        client.flushdb()
        client.close()


def _hostname(recorder: Recorder, pid: int) -> str:
    wait_for(lambda: any(e["pid"] == pid for e in recorder.of("worker-heartbeat")), 15, "a worker-heartbeat")
    return next(e["hostname"] for e in recorder.of("worker-heartbeat") if e["pid"] == pid)


def test_flower_sees_the_worker_its_tasks_and_what_is_in_flight(monitored):
    from producer.api import Producer
    from worker.settings import Settings

    worker, app, recorder, queue = monitored
    hostname = _hostname(recorder, worker.pid)  # heartbeats from the events thread, not the consumer's loop
    assert recorder.of("worker-online"), "no worker-online event"
    replies = app.control.enable_events(destination=[hostname], reply=True, timeout=5)
    assert replies and "ok" in next(iter(replies[0].values())), replies

    with Producer(Settings(broker_url=REDIS_URL, queue=queue)) as producer:
        results = [producer.submit(f"ticket {i}: my invoice is wrong", id=f"e-{i}") for i in range(12)]
        inspect = app.control.inspect(destination=[hostname], timeout=5)
        wait_for(lambda: (inspect.active() or {}).get(hostname), 15, "a message reported active by inspect")
        answered = producer.wait(results, timeout=60)
    assert [r["status"] for r in answered] == ["ok"] * 12
    ids = {result.id for result in results}
    for kind in ("task-received", "task-started", "task-succeeded"):
        wait_for(lambda kind=kind: ids <= {e["uuid"] for e in recorder.of(kind)}, 15,
                 f"{kind} for every task; got {sorted({e['type'] for e in recorder.events})}")
    runtimes = [e["runtime"] for e in recorder.of("task-succeeded") if e["uuid"] in ids]
    assert all(runtime > 0 for runtime in runtimes), runtimes
    shown = {e["uuid"]: e["result"] for e in recorder.of("task-succeeded") if e["uuid"] in ids}
    assert shown == {result.id: repr(answer["label"]) for result, answer in zip(results, answered, strict=True)}
    stats = inspect.stats()[hostname]
    assert stats["total"].get("ticketq.classify", 0) >= 12
    assert inspect.active()[hostname] == [] and inspect.reserved()[hostname] == []

    app.control.disable_events(destination=[hostname], reply=True, timeout=5)
    assert "Traceback" not in worker.log(), worker.log()[-3000:]


def test_flower_shows_the_worker_and_each_task(monitored, tmp_path):
    pytest.importorskip("flower", reason="Flower is optional: pip install flower")
    import json
    import urllib.request

    from producer.api import Producer
    from worker.settings import Settings

    worker, app, recorder, queue = monitored
    port = free_port()
    env = {**os.environ, "FLOWER_UNAUTHENTICATED_API": "true"}
    log = (tmp_path / "flower.log").open("wb")
    flower = subprocess.Popen([sys.executable, "-m", "celery", "--broker", REDIS_URL, "flower", f"--port={port}",
                               "--address=127.0.0.1"], env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    def api(path: str):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/{path}", timeout=5) as reply:
            return json.loads(reply.read())

    def answers(path: str):
        try:
            return api(path)
        except OSError:
            return None

    try:
        hostname = _hostname(recorder, worker.pid)
        wait_for(lambda: hostname in (answers("workers?refresh=1") or {}), 60, "Flower listing the worker")
        app.control.enable_events(destination=[hostname], reply=True, timeout=5)  # Flower does so every few seconds
        with Producer(Settings(broker_url=REDIS_URL, queue=queue)) as producer:
            results = [producer.submit(f"ticket {i}: password reset", id=f"f-{i}") for i in range(5)]
            answered = producer.wait(results, timeout=60)
        ids = {result.id for result in results}

        def succeeded():
            tasks = answers("tasks") or {}
            return ids <= {uid for uid, task in tasks.items() if task.get("state") == "SUCCESS"} and tasks

        tasks = wait_for(succeeded, 30, "Flower showing every task SUCCESS")
        assert all(tasks[uid]["runtime"] is not None for uid in ids)
        labels = {result.id: repr(answer["label"]) for result, answer in zip(results, answered, strict=True)}
        assert {uid: tasks[uid]["result"] for uid in ids} == labels  # the answer, not an empty result

        # Dates in a task's events: Flower's task list answered 500 on a datetime where Celery sends ISO text.
        now = datetime.now(timezone.utc)
        send = partial(app.send_task, TASK_CLASSIFY, queue=queue)
        dated = {"countdown": send(args=[{"id": "f-countdown", "text": "refund"}], countdown=1),
                 "eta": send(args=[{"id": "f-eta", "text": "refund"}], eta=now + timedelta(seconds=1)),
                 "expires": send(args=[{"id": "f-expires", "text": "refund"}], expires=3600),
                 "expired": send(args=[{"id": "f-expired", "text": "refund"}], expires=now - timedelta(seconds=5))}
        want = {"countdown": "SUCCESS", "eta": "SUCCESS", "expires": "SUCCESS", "expired": "REVOKED"}

        def dated_states():
            tasks = answers("tasks") or {}
            got = {kind: tasks.get(result.id, {}).get("state") for kind, result in dated.items()}
            return got if got == want else None

        wait_for(dated_states, 60, f"Flower listing the dated tasks as {want}")
        received = {e["uuid"]: e for e in recorder.of("task-received")}
        assert isinstance(received[dated["eta"].id]["eta"], str), received[dated["eta"].id]
        assert isinstance(received[dated["expires"].id]["expires"], str)
        assert "Traceback" not in worker.log(), worker.log()[-3000:]
    finally:
        flower.terminate()
        flower.wait(timeout=10)
        log.close()


def test_events_never_hold_the_consumer_when_the_broker_is_away(tmp_path):
    """The events thread on a dead broker: sends are queued or dropped, never blocking the caller."""
    import time

    from worker.transport.events import WorkerEvents

    app = Celery("dead", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.broker_connection_timeout = 0.5
    events = WorkerEvents(app, "dead@host", task_events=True, capacity=10)
    events.start()
    started = time.monotonic()
    for i in range(1000):
        events.send("task-received", uuid=str(i))
    assert time.monotonic() - started < 0.5
    assert events.dropped >= 990 - 10
    events.stop()
    assert not events.is_alive()
    app.close()


def test_remote_control_switches_the_task_group(tmp_path):
    from celery.worker.control import disable_events, enable_events

    from worker.transport.events import WorkerEvents

    app = Celery("probe", broker="redis://127.0.0.1:1/0", set_as_current=False)
    events = WorkerEvents(app, "probe@host", task_events=False)
    state = type("State", (), {"consumer": type("Consumer", (), {"event_dispatcher": events})()})()
    assert "task" not in events.groups
    enable_events(state)
    assert "task" in events.groups
    disable_events(state)
    assert "task" not in events.groups
    events.send("task-received", uuid="x")  # the group is off: nothing queued
    assert events._queue.qsize() == 0
    app.close()
