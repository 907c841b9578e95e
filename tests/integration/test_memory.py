"""Redis memory, for real: a private redis-server with a maxmemory-policy, real worker processes.

- An evicting policy (allkeys-lru drops the queue, the unacked record and the results stream
  without a word) stops the worker at start-up with one line that names the fix, even where
  CONFIG is disabled (managed Redis); TICKETQ_ALLOW_EVICTION=true lets it start.
- noeviction with memory full: nothing crashes. The worker stops fetching, keeps retrying its
  results, says so once ("Redis is full (maxmemory)") and on /readyz; the producer gets one line;
  a worker started while Redis is full waits instead of dying; once maxmemory is raised (CONFIG
  SET) everything resumes by itself and every ticket is answered once.
- On a full Redis, acks still go through (a script of deletions), freeing memory.

Figures are printed: `pytest -s`. The first tests need no Redis: how a refusal is named.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import kombu.exceptions
import pytest
import redis
from faults import DELAY_ENV
from kombu import Connection, Consumer, Queue
from servers import require_redis_server
from workers import ROOT, RedisServer, Worker, free_port, running_worker, wait_for, worker_command, worker_env

from producer.api import Producer
from producer.errors import BrokerUnavailable
from ticketq import connections, names
from ticketq.config import ClientSettings
from ticketq.names import ATTEMPTS_KEY
from ticketq_cli.ops import Ops
from worker.health import refusals
from worker.settings import Settings

pytestmark = pytest.mark.integration

QUEUE = "memory"
FULL = "Redis is full (maxmemory)"
OOM = redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")


# --------------------------------------------------------------------------------------------
# naming a refusal (no Redis)


def test_a_refused_write_is_named_in_one_line_and_not_as_unreachable():
    wrapped = kombu.exceptions.OperationalError("publish failed")
    wrapped.__cause__ = OOM  # kombu and Celery wrap redis-py's errors
    assert connections.write_refusal(wrapped) == connections.OUT_OF_MEMORY
    noreplicas = redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas to write.")
    assert connections.write_refusal(noreplicas) == connections.NOT_ENOUGH_REPLICAS
    assert connections.write_refusal(redis.exceptions.ResponseError("WRONGTYPE")) is None

    detail = "maxmemory 20.00M, used 20.10M, maxmemory-policy noeviction"
    full = BrokerUnavailable("redis://:pw@h:6379/0", wrapped, detail)
    few = BrokerUnavailable("redis://:pw@h:6379/0", noreplicas)
    assert str(full).startswith("Redis refused the write: out of memory (maxmemory 20.00M"), str(full)
    assert str(few).startswith("Redis refused the write: not enough replicas (min-replicas-to-write"), str(few)
    for error in (full, few):
        assert "\n" not in str(error) and "pw" not in str(error) and "not reachable" not in str(error)


def test_a_refusal_episode_is_logged_once(caplog):
    episode = refusals.Episode("Redis is full (maxmemory)", "retrying", "Redis takes writes again", quiet_s=0.0)
    with caplog.at_level(logging.INFO, logger="worker.health.refusals"):
        for _ in range(5):
            episode.begin("a write refused")
        assert episode.active
        episode.end()
        episode.end()
        episode.begin("refused again")
    lines = [record.getMessage() for record in caplog.records]
    assert [line.split(":")[0].split(",")[0] for line in lines] == [
        "Redis is full (maxmemory)", "Redis takes writes again", "Redis is full (maxmemory)",
    ]  # fmt: skip


def test_a_server_at_the_edge_of_its_limit_makes_one_episode(caplog):
    """Refusals with a write squeezing through between them (memory rises and falls with the
    replies Redis buffers), at the outbox's and the fetch's retry pace: one episode, logged once."""
    now = [0.0]
    episode = refusals.Episode("Redis is full (maxmemory)", "retrying", "Redis takes writes again",
                               clock=lambda: now[0])  # fmt: skip
    with caplog.at_level(logging.INFO, logger="worker.health.refusals"):
        for _ in range(10):  # refused, then one write accepted 1.5 s later, refused again 0.5 s after that
            episode.begin("a write refused")
            now[0] += 1.5
            episode.end()
            now[0] += 0.5
        assert episode.active
        now[0] += refusals.Episode.QUIET_S
        episode.end()
    lines = [record.getMessage().split(":")[0].split(",")[0] for record in caplog.records]
    assert lines == ["Redis is full (maxmemory)", "Redis takes writes again"], lines
    assert not episode.active


# --------------------------------------------------------------------------------------------
# real servers


def test_status_on_a_full_redis_says_the_workers_could_not_be_asked(tmp_path):
    """Celery's ping writes (its reply queue), which a full Redis refuses: one line, not a traceback."""
    server = start_redis(tmp_path, "--maxmemory-policy", "noeviction")
    try:
        fill(server.client())
        env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        done = subprocess.run([sys.executable, "-m", "ticketq_cli.cli", "status"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env={**env, "TICKETQ_BROKER_URL": server.url})  # fmt: skip
    finally:
        server.kill()
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stdout + done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("workers:")]
    assert line.startswith("workers: unknown, not asked: Redis refuses the writes a Celery ping makes (out of memory)")
    assert "maxmemory_policy=noeviction" in done.stdout


def start_redis(tmp_path: Path, *args: str) -> RedisServer:
    require_redis_server()
    workdir = tmp_path / "redis"
    workdir.mkdir(exist_ok=True)
    return RedisServer(workdir, aof=False, args=args).start()


def fill(client: redis.Redis, headroom: int = 2 << 20) -> int:
    """Set maxmemory a little above what is used, write ballast until Redis refuses, then lower
    maxmemory 1 MB below what is used: full, and the acks that free a little do not change that.
    Returns the ballast keys written."""
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + headroom)
    for n in range(10_000):
        try:
            client.set(f"test:ballast:{n}", b"x" * (256 << 10))
        except redis.exceptions.OutOfMemoryError:
            client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - (1 << 20))
            return n
    raise AssertionError("Redis never refused a write")


def readyz(worker: Worker) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/readyz", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def test_an_evicting_policy_stops_the_worker_with_the_fix(tmp_path):
    # CONFIG renamed away, as managed Redis does: the policy is read from INFO memory instead.
    server = start_redis(tmp_path, "--maxmemory", "20mb", "--maxmemory-policy", "allkeys-lru",
                         "--rename-command", "CONFIG", "")  # fmt: skip
    try:
        env = worker_env(None, server.url, QUEUE, TICKETQ_NULL_CLASSIFIER="1")
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "ticketq_cli.cli", "worker"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        elapsed = time.monotonic() - started
        output = done.stdout + done.stderr
        line = next((line for line in output.splitlines() if "allkeys-lru" in line), "")
        print(f"\n[eviction] exit {done.returncode} in {elapsed:.1f}s: {line}")
        assert done.returncode != 0 and elapsed < 30, output[-3000:]
        assert "maxmemory-policy noeviction" in line and "TICKETQ_ALLOW_EVICTION" in line, output[-3000:]
        assert "Traceback" not in output

        with running_worker({**env, "TICKETQ_ALLOW_EVICTION": "true"}, tmp_path / "allowed.log") as worker:
            status, body = readyz(worker)
            assert status == 200 and "maxmemory-policy allkeys-lru" in body, body
            assert "TICKETQ_ALLOW_EVICTION is on" in worker.log()
    finally:
        server.kill()


def test_acks_go_through_on_a_full_redis(tmp_path):
    """The unacked record of delivered messages can be removed while Redis refuses every new write."""
    from worker.transport import fetch

    server = start_redis(tmp_path, "--maxmemory-policy", "noeviction")
    client = server.client()
    try:
        queue, received = Queue("full-acks"), []
        with Connection(server.url, transport=fetch.Transport) as conn:
            for n in range(5):
                conn.Producer().publish({"n": n}, routing_key=queue.name, declare=[queue], serializer="json")
            with Consumer(conn, [queue], callbacks=[lambda body, message: received.append(message)],
                          prefetch_count=5):  # fmt: skip
                conn.drain_events(timeout=10)
                assert len(received) == 5 and client.hlen("unacked") == 5
                fill(client)
                for message in received:
                    message.ack()  # a plain kombu consumer (no event loop) writes each ack at once
                assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    finally:
        server.kill()


def test_a_full_redis_stops_nothing_and_everything_resumes(tmp_path):
    server = start_redis(tmp_path, "--maxmemory-policy", "noeviction")
    client = server.client()
    # Each batch takes 0.1 s, so Redis fills while one is open; lease 2 s: the dead worker's
    # messages come back soon after memory does.
    env = {**worker_env(None, server.url, QUEUE, TICKETQ_LEASE_S="2"), DELAY_ENV: "0.1"}
    command = worker_command(faulty=True)
    first = Worker({**env, "TICKETQ_METRICS_PORT": str(free_port())}, tmp_path / "first.log", command=command)
    second = None
    producer = Producer(ClientSettings(broker_url=server.url, queue=QUEUE))
    try:
        first.wait_ready(timeout=120)
        sent = producer.submit_many([f"ticket {n}: my card was charged twice" for n in range(300)])
        wait_for(lambda: client.keys(ATTEMPTS_KEY.format(task_id="*")), 60, "a batch in progress", 0.005)
        ballast = fill(client)
        full_at = time.monotonic()

        with pytest.raises(BrokerUnavailable) as refused:
            producer.submit("one more ticket")
        cli = subprocess.run([sys.executable, "-m", "producer.cli", "synthetic", "3"], cwd=ROOT, timeout=60,
                             env={**env, "TICKETQ_BROKER_URL": server.url}, capture_output=True, text=True)  # fmt: skip

        first.wait_log(FULL, 30, "the worker saying Redis is full")
        wait_for(lambda: "Redis is full" in readyz(first)[1], 30, "/readyz saying Redis is full")
        status, body = readyz(first)
        # Full across a refresh of Celery's control bindings, which kombu >= 5.7 runs by script
        # every control_queue_expires / 3 (3.3 s): refused, it is part of the episode, no traceback.
        time.sleep(10.0 / 3 + 1)
        first.proc.kill()  # it dies while Redis is full; the next one starts on a full Redis
        first.proc.wait()
        second = Worker({**env, "TICKETQ_METRICS_PORT": str(free_port())}, tmp_path / "second.log", command=command)
        wait_for(lambda: "Redis is full" in readyz(second)[1], 120, "the restarted worker up, waiting for memory")
        assert second.proc.poll() is None, second.log()[-3000:]

        client.config_set("maxmemory", "512mb")
        freed_at = time.monotonic()
        second.wait_ready(timeout=60)
        ready_s = time.monotonic() - freed_at
        results = producer.wait(sent, timeout=90)
        answered_s = time.monotonic() - freed_at
        entries = [json.loads(fields[b"data"]) for _, fields in client.xrange(names.RESULTS_STREAM)]
        ops = Ops(Settings(broker_url=server.url, queue=QUEUE))
        try:
            state = ops.status(ping_timeout=0.5)
        finally:
            ops.close()
    finally:
        producer.close()
        for worker in (first, second):
            if worker is not None:
                worker.stop(timeout=30)
        server.kill()

    counts = Counter((entry["task_id"], entry["id"]) for entry in entries)
    logs = {"first": first.log(), "second": second.log()}
    print(
        f"\n[full] {len(sent)} tickets; Redis full after {ballast} ballast writes; producer: {refused.value}; "
        f"ticketq-produce exit {cli.returncode}: {cli.stderr.strip().splitlines()[-1]}; "
        f"/readyz {status}: {body.strip()!r}; "
        f"restarted worker waited, ready {ready_s:.1f}s and every ticket answered {answered_s:.1f}s after "
        f"maxmemory was raised ({time.monotonic() - full_at:.0f}s after Redis filled); status redis: {state['redis']}"
    )
    message = str(refused.value)
    assert message.startswith("Redis refused the write: out of memory (maxmemory") and "\n" not in message, message
    assert cli.returncode == 2 and "Redis refused the write: out of memory" in cli.stderr, cli.stdout + cli.stderr
    errors = [line for line in cli.stderr.splitlines() if line.startswith("error:")]  # the rest: progress bars
    assert len(errors) == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert status == 503 and "maxmemory-policy noeviction" in body, body
    assert [r["status"] for r in results] == ["ok"] * len(sent)
    assert set(counts.values()) == {1} and len(counts) == len(sent), "every ticket answered once"
    for name, log in logs.items():
        assert "Traceback" not in log and "Unrecoverable error" not in log, f"{name}:\n{log[-4000:]}"
        assert log.count(FULL) == 1, f"{name} says it once per episode:\n{log[-4000:]}"
    assert state["redis"]["maxmemory_policy"] == "noeviction"
