"""The producer under interruption and outage: a Redis restart while it waits, results behind a
head that never comes, Ctrl-C while it waits or sends, and a file sent again.

Each test starts its own redis-server (tests/support/workers.py RedisServer) and real null-classifier
workers (TICKETQ_NULL_CLASSIFIER=1), runs `ticketq-produce` as a subprocess where the test
signals or outlives it, and synchronises on events (queue lengths, output lines, process exits),
never on sleeps. Figures are printed: `pytest -s`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from commands import sigint_as_in_a_terminal
from workers import ROOT, RedisServer, StartedWorkers, Worker, free_port, wait_for, worker_env

from producer.api import Producer
from producer.messages import idempotent_task_id
from producer.sending import PUBLISH_BATCH
from ticketq import names
from ticketq.config import ClientSettings

pytestmark = pytest.mark.integration

QUEUE = "outages"


@pytest.fixture
def workers(tmp_path) -> Iterator[Callable[[RedisServer], Worker]]:
    """`start(server)` -> a ready null-classifier worker on QUEUE; every one is stopped at the end."""
    workers = StartedWorkers(tmp_path)

    def start(server: RedisServer) -> Worker:
        env = worker_env(None, server.url, QUEUE, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_METRICS_PORT=str(free_port()))
        return workers.start(env, f"worker-{len(workers.started)}")

    yield start
    workers.stop()


class Produce:
    """`ticketq-produce ARGS` in its own process, stdout and stderr to files the test can watch; SIGINT
    is Ctrl-C."""

    def __init__(self, tmp_path: Path, server: RedisServer, *args: str, env: dict[str, str] | None = None) -> None:
        """`server`: anything with a broker `url` (a `SentinelSet` too); `env`: more settings."""
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}, **(env or {})}
        env.update(PYTHONUNBUFFERED="1", COLUMNS="200", TICKETQ_BROKER_URL=server.url, TICKETQ_QUEUE=QUEUE)
        self.stdout_path, self.stderr_path = tmp_path / "produce.out", tmp_path / "produce.err"
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "producer.cli", *args, "--no-progress"],
                                         env=env, cwd=ROOT, stdout=out, stderr=err,
                                         preexec_fn=sigint_as_in_a_terminal)  # fmt: skip

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_output(self, text: str, timeout: float) -> None:
        wait_for(lambda: text in self.stdout + self.stderr or self.proc.poll() is not None, timeout, repr(text))
        assert text in self.stdout + self.stderr, f"exited {self.proc.returncode} first:\n{self.stdout}\n{self.stderr}"

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"ticketq-produce did not finish:\n{self.stdout}\n{self.stderr}") from None


def ticket_file(path: Path, n: int, prefix: str = "T") -> Path:
    lines = [json.dumps({"id": f"{prefix}-{i}", "text": f"ticket {i}: the app crashes on upload"}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def statuses(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in rows(path):
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    return counts


def test_wait_rides_out_a_redis_restart(tmp_path, redis_server, workers):
    """kill -9 of Redis while `--wait --resend-after` waits: the producer asks again until Redis
    is back, and ends with every ticket answered and the results file written."""
    tickets, out = ticket_file(tmp_path / "t.jsonl", 600), tmp_path / "r.jsonl"
    client = redis_server.client()
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--resend-after", "5",
                      "--timeout", "90")  # fmt: skip
    produce.wait_output("enqueued 600 tickets", 60)
    assert client.llen(QUEUE) == 600  # no worker yet: the producer is waiting on all of them
    redis_server.kill()
    killed = time.monotonic()
    produce.wait_output("lost Redis while waiting", 30)
    redis_server.start()  # same port and dir: the AOF is replayed
    restarted = time.monotonic()
    workers(redis_server)
    status = produce.finish(90)
    recovered_s = time.monotonic() - restarted
    client = redis_server.client()
    print(f"\n[redis restart] down {restarted - killed:.1f} s; every result in the file {recovered_s:.1f} s after "
          f"the restart (worker start-up included); stream entries {client.xlen(names.RESULTS_STREAM)}")  # fmt: skip
    assert status == 0, produce.stderr
    assert statuses(out) == {"ok": 600}
    assert client.xlen(names.RESULTS_STREAM) == 600
    assert "Redis is back" in produce.stderr


def test_wait_sees_every_result_behind_200_that_never_come(tmp_path, redis_server, workers):
    """The first 200 messages go to a queue nobody consumes: `wait` still reads every later result."""
    workers(redis_server)
    nowhere = Producer(ClientSettings(broker_url=redis_server.url, queue="nobody-consumes-this"))
    producer = Producer(ClientSettings(broker_url=redis_server.url, queue=QUEUE))
    seen: list[dict] = []

    class AllSeen(Exception):
        pass

    def on_result(tickets: list[dict]) -> None:
        seen.extend(tickets)
        if len(seen) == 1000:
            raise AllSeen  # what is left never comes: stop on the event, not on the timeout

    try:
        lost = nowhere.submit_many([{"id": f"lost-{i}", "text": "never answered"} for i in range(200)])
        answered = producer.submit_many([{"id": f"ok-{i}", "text": "answered"} for i in range(1000)])
        started = time.monotonic()
        with pytest.raises(AllSeen):
            producer.wait([*lost, *answered], timeout=60, on_result=on_result)
        took = time.monotonic() - started
    finally:
        nowhere.close()
        producer.close()
    print(f"\n[head missing] 1000 results behind 200 that never come, all read in {took:.2f} s")
    assert sorted(row["id"] for row in seen) == sorted(f"ok-{i}" for i in range(1000))
    assert all(row["status"] == "ok" for row in seen)


def test_sigint_while_waiting_writes_pending_rows_and_a_rerun_sends_nothing_twice(tmp_path, redis_server, workers):
    """The first 300 tickets were answered by an earlier run; a run of all 600 sends the other 300
    only (the ticket id is the idempotency key), Ctrl-C while it waits writes 300 ok and 300
    pending rows with one line, exit 130; `--resume` waits for the 300 without sending them again."""
    client = redis_server.client()
    first, out = ticket_file(tmp_path / "first.jsonl", 300), tmp_path / "r.jsonl"
    worker = workers(redis_server)
    done = Produce(tmp_path, redis_server, "file", str(first), "--wait")
    assert done.finish(60) == 0, done.stderr
    assert client.xlen(names.RESULTS_STREAM) == 300
    worker.stop(timeout=30)

    everything = ticket_file(tmp_path / "all.jsonl", 600)
    produce = Produce(tmp_path, redis_server, "file", str(everything), "--out", str(out))
    produce.wait_output("enqueued 300 tickets in 300 messages", 60)
    assert "300 sent before, not sent again" in produce.stdout
    assert client.llen(QUEUE) == 300
    produce.proc.send_signal(signal.SIGINT)  # the enqueue line is printed where a Ctrl-C already gives the rows
    assert produce.finish(30) == 130, produce.stderr
    assert statuses(out) == {"ok": 300, "pending": 300}
    pending = [row for row in rows(out) if row["status"] == "pending"]
    assert {row["task_id"] for row in pending} == {idempotent_task_id(QUEUE, [f"T-{i}"], False)
                                                   for i in range(300, 600)}  # fmt: skip
    line = f"interrupted: 300 tickets answered, 300 pending (sent, no result yet); every row is in {out}"
    assert line in produce.stderr

    resume = Produce(tmp_path, redis_server, "file", str(everything), "--out", str(out), "--resume")
    resume.wait_output("enqueued 0 tickets in 0 messages", 60)
    assert client.llen(QUEUE) == 300, "the pending tickets were sent again"
    workers(redis_server)
    assert resume.finish(60) == 0, resume.stderr
    assert statuses(out) == {"ok": 600}
    assert client.xlen(names.RESULTS_STREAM) == 600


def test_rerunning_a_file_adds_no_stream_entries(tmp_path, redis_server, workers):
    """The same file, run twice (single and packed messages): the second run sends nothing and
    reads the first run's answers; the results stream holds one entry per ticket."""
    client = redis_server.client()
    workers(redis_server)
    for pack, n in (("1", 600), ("7", 100)):
        tickets, out = ticket_file(tmp_path / f"p{pack}.jsonl", n, prefix=f"P{pack}"), tmp_path / f"p{pack}.out"
        before = client.xlen(names.RESULTS_STREAM)
        run = Produce(tmp_path, redis_server, "file", str(tickets), "--pack", pack, "--out", str(out))
        assert run.finish(60) == 0, run.stderr
        first = client.xlen(names.RESULTS_STREAM)
        again = Produce(tmp_path, redis_server, "file", str(tickets), "--pack", pack, "--out", str(out), "--force")
        assert again.finish(60) == 0, again.stderr
        print(f"\n[re-run] --pack {pack}: stream entries {before} -> {first} (first run) -> "
              f"{client.xlen(names.RESULTS_STREAM)} (same file again)")  # fmt: skip
        assert first - before == n
        assert client.xlen(names.RESULTS_STREAM) == first
        assert "enqueued 0 tickets in 0 messages" in again.stdout and f"{n} sent before" in again.stdout
        assert statuses(out) == {"ok": n}


def test_sigint_while_sending_names_what_was_sent_and_resume_sends_the_rest(tmp_path, redis_server, workers):
    """Ctrl-C in the middle of a large enqueue: --out names every ticket Redis took (pending, with
    its task id) and every one it did not (unsent); --resume sends the rest only."""
    n = 12_000
    client = redis_server.client()
    tickets, out = ticket_file(tmp_path / "big.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out))
    # Past the first pipeline: some messages surely sent, most not yet.
    wait_for(lambda: client.llen(QUEUE) > PUBLISH_BATCH or produce.proc.poll() is not None, 60,
             "the first pipelines queued", interval=0.002)  # fmt: skip
    produce.proc.send_signal(signal.SIGINT)
    assert produce.finish(30) == 130, produce.stderr
    queued = client.llen(QUEUE)
    written = rows(out)
    sure = [row for row in written if row["status"] == "pending" and row.get("sent") != "maybe"]
    maybe = [row for row in written if row.get("sent") == "maybe"]
    unsent = [row for row in written if row["status"] == "unsent"]
    print(f"\n[enqueue interrupted] {len(sure)} sent, {len(maybe)} maybe, {len(unsent)} unsent; queue {queued}")
    assert len(sure) + len(maybe) + len(unsent) == len(written) == n
    assert len(sure) >= PUBLISH_BATCH and len(unsent) > 0
    assert len(sure) <= queued <= len(sure) + len(maybe)
    assert "interrupted while sending" in produce.stderr and f"{len(unsent)} not sent" in produce.stderr

    resume = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--resume")
    resume.wait_output("enqueued", 60)
    requeued = client.llen(QUEUE) - queued
    assert queued + requeued <= n + len(maybe), "a ticket sent before was sent again"
    assert client.llen(QUEUE) >= n
    workers(redis_server)
    assert resume.finish(90) == 0, resume.stderr
    assert statuses(out) == {"ok": n}
    assert client.xlen(names.RESULTS_STREAM) == n


def test_timeout_writes_pending_rows_and_resume_needs_out(tmp_path, redis_server):
    """No worker: --timeout ends the wait with a `pending` row (and task id) per ticket, and one line."""
    tickets, out = ticket_file(tmp_path / "t.jsonl", 5), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--timeout", "0.5")
    assert produce.finish(60) == 3, produce.stderr
    assert statuses(out) == {"pending": 5} and all(row["task_id"] for row in rows(out))
    assert "timed out after 0.5 s: 0 tickets answered, 5 pending (sent, no result yet)" in produce.stderr
    alone = Produce(tmp_path, redis_server, "file", str(tickets), "--resume")
    assert alone.finish(60) == 2 and "--resume needs --out" in alone.stderr


def sent_rows(path: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """The rows of a send that stopped: sent for sure (pending), maybe sent, unsent."""
    written = rows(path)
    sure = [row for row in written if row["status"] == "pending" and row.get("sent") != "maybe"]
    maybe = [row for row in written if row.get("sent") == "maybe"]
    return sure, maybe, [row for row in written if row["status"] == "unsent"]


def stop_mid_send(produce: Produce, client, at_least: int) -> None:
    """Hold the producer (SIGSTOP) once Redis has `at_least` of its messages, so the next step
    (a kill) lands while it is sending whatever the machine's speed; SIGCONT is the caller's."""
    wait_for(lambda: client.llen(QUEUE) >= at_least or produce.proc.poll() is not None, 60,
             f"{at_least} messages queued", interval=0.002)  # fmt: skip
    produce.proc.send_signal(signal.SIGSTOP)
    assert produce.proc.poll() is None and client.llen(QUEUE) < 6_000, "still sending when held"


def test_sending_rides_out_a_redis_restart_and_every_ticket_is_answered_once(tmp_path, redis_server, workers):
    """kill -9 of Redis while `ticketq-produce file` is sending: the producer asks again (not exit
    2 at once), sends the interrupted pipeline again once Redis is back, and ends with exit 0 and
    every row answered; the duplicates of that pipeline are published once."""
    n = 6_000
    client = redis_server.client()
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--timeout", "120")
    stop_mid_send(produce, client, PUBLISH_BATCH)
    redis_server.kill()
    produce.proc.send_signal(signal.SIGCONT)
    produce.wait_output("lost Redis while sending", 30)
    redis_server.start()  # AOF, fsync always: what Redis acknowledged survives
    workers(redis_server)
    status = produce.finish(120)
    entries = redis_server.client().xlen(names.RESULTS_STREAM)
    print(f"\n[restart while sending] exit {status}; {statuses(out)}; stream entries {entries}")
    assert status == 0, produce.stdout + produce.stderr
    assert statuses(out) == {"ok": n}
    assert entries == n
    assert "Redis is back" in produce.stderr and "error:" not in produce.stderr


def test_an_outage_past_retry_for_writes_a_row_for_every_ticket(tmp_path, redis_server):
    """Redis killed mid-send and not restarted, --retry-for 1: the producer stops after that long
    with one error line and a row for every ticket (sent, maybe sent, unsent); exit 3, nothing
    was answered."""
    n = 6_000
    client = redis_server.client()
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out), "--retry-for", "1")
    stop_mid_send(produce, client, PUBLISH_BATCH)
    queued = client.llen(QUEUE)
    redis_server.kill()
    produce.proc.send_signal(signal.SIGCONT)
    status = produce.finish(60)
    sure, maybe, unsent = sent_rows(out)
    print(f"\n[outage past --retry-for] exit {status}; {len(sure)} sent, {len(maybe)} maybe, {len(unsent)} unsent "
          f"(queued when killed: {queued})")  # fmt: skip
    assert status == 3, produce.stdout + produce.stderr
    assert len(sure) + len(maybe) + len(unsent) == len(rows(out)) == n
    assert len(sure) >= queued - PUBLISH_BATCH and len(unsent) > 0
    errors = [line for line in produce.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: Redis is not reachable"), produce.stderr
    assert len(maybe) == PUBLISH_BATCH, "the pipeline Redis was lost in: maybe sent"
    assert "Redis stopped the send" in produce.stderr and f"{len(unsent)} not sent" in produce.stderr


def test_a_full_redis_mid_send_writes_a_row_for_every_ticket_and_resume_answers_each_once(tmp_path, workers):
    """Redis reaches maxmemory (noeviction) part way through a send: one error line, a row for every
    ticket (pending, maybe, unsent) instead of a count; once memory is raised, --resume sends the
    maybe and unsent ones and every ticket is answered once."""
    n = 5_000
    workdir = tmp_path / "full"
    workdir.mkdir()
    server = RedisServer(workdir, aof=False, args=["--maxmemory-policy", "noeviction"]).start()
    try:
        client = server.client()
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (3 << 20))
        text = "my invoice is wrong " * 50  # ~1 KB: Redis fills after some thousands of messages
        path = tmp_path / "t.jsonl"
        path.write_text("".join(json.dumps({"id": f"F-{i}", "text": f"{i} {text}"}) + "\n" for i in range(n)))
        out = tmp_path / "r.jsonl"
        produce = Produce(tmp_path, server, "file", str(path), "--out", str(out))
        status = produce.finish(60)
        sure, maybe, unsent = sent_rows(out)
        queued = client.llen(QUEUE)
        print(f"\n[full while sending] exit {status}; {len(sure)} sent, {len(maybe)} maybe, {len(unsent)} unsent; "
              f"queued {queued}")  # fmt: skip
        assert status == (3 if sure else 2), produce.stdout + produce.stderr
        assert len(sure) + len(maybe) + len(unsent) == len(rows(out)) == n and unsent
        assert len(sure) <= queued <= len(sure) + len(maybe)
        errors = [line for line in produce.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "out of memory" in errors[0], produce.stderr
        assert "Redis stopped the send" in produce.stderr

        client.config_set("maxmemory", 0)
        workers(server)
        resume = Produce(tmp_path, server, "file", str(path), "--out", str(out), "--resume")
        assert resume.finish(120) == 0, resume.stdout + resume.stderr
        assert statuses(out) == {"ok": n}
        assert client.xlen(names.RESULTS_STREAM) == n
    finally:
        server.kill()


def test_sigint_while_waiting_for_replicas_writes_a_row_for_every_ticket(tmp_path, redis_server):
    """TICKETQ_REPLICA_ACKS=1 on a Redis without a replica: every ticket is sent, then the producer
    waits in WAIT for a replica. Ctrl-C there writes every ticket as pending (Redis took them all;
    only their replication was unconfirmed) and exits 130, as during the send."""
    n = 50
    client = redis_server.client()
    tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
    produce = Produce(tmp_path, redis_server, "file", str(tickets), "--out", str(out),
                      env={"TICKETQ_REPLICA_ACKS": "1", "TICKETQ_REPLICA_TIMEOUT_S": "120"})  # fmt: skip
    wait_for(lambda: client.llen(QUEUE) >= n or produce.proc.poll() is not None, 60, "every ticket queued")
    wait_for(lambda: any(c.get("cmd") == "wait" for c in client.client_list()) or produce.proc.poll() is not None,
             30, "the producer waiting for a replica")  # fmt: skip
    produce.proc.send_signal(signal.SIGINT)
    assert produce.finish(30) == 130, produce.stderr
    assert statuses(out) == {"pending": n}
    assert "interrupted" in produce.stderr
