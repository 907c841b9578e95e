"""ticketq-deliver: results of a real null-classifier worker, read from the results stream by the
real dispatcher process (`python -m gateway deliver`) and POSTed to a real HTTP receiver here,
which checks each signature and deduplicates by delivery id. The dispatcher is kill -9'd mid-stream,
the receiver fails for a while, or for good."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import redis
from test_gateway import running_gateway
from workers import ROOT, RedisServer, end_process, free_port, null_classifier_service, skip_or_fail, wait_for

from gateway.deliver import backoff_s, sign
from gateway.keys import DELIVER_DEAD_STREAM, DELIVER_GAPS_STREAM
from gateway.settings import GatewaySettings
from producer.api import Producer
from ticketq import codec
from ticketq.config import ClientSettings
from ticketq.names import RESULTS_STREAM

pytestmark = pytest.mark.integration

SECRET = "deliver-secret"


def test_signature_and_backoff_rules():
    body = b'{"a": 1}'
    expected = "sha256=" + hmac.new(b"k", b"17." + body, hashlib.sha256).hexdigest()
    assert sign(b"k", "17", body) == expected
    rng = random.Random(0)
    pauses = [backoff_s(attempt, 0.5, 4.0, rng) for attempt in range(1, 7)]
    for attempt, pause in enumerate(pauses, start=1):
        full = min(4.0, 0.5 * 2 ** (attempt - 1))
        assert full / 2 <= pause <= full


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the listen backlog: 5 by default, below the dispatcher's concurrency
    daemon_threads = True


class Receiver:
    """An HTTP receiver: verifies each POST's signature, records its delivery id, answers 500 for
    the first `fail_first` POSTs (all of them when `fail_first` is None), or every POST in the
    `down_s` seconds from the first one (an outage the dispatcher meets however late it starts),
    200 after. A POST signed with another key than `secret` is answered 500 and not recorded; one cut
    short (its sender killed mid-request) is dropped unanswered, as a server would. With
    `hold_after`, every POST after that many recorded waits until `release()`: the dispatcher is
    mid-stream for as long as a test needs, however slowly a loaded machine gets there."""

    def __init__(self, fail_first: int | None = 0, delay_s: float = 0.0, down_s: float = 0.0,
                 secret: str = SECRET, hold_after: int | None = None) -> None:  # fmt: skip
        self.fail_first, self.delay_s, self.secret = fail_first, delay_s, secret
        self.hold_after, self.released = hold_after, threading.Event()
        self.down_s, self.up_at = down_s, None  # the outage starts at the first POST
        self.posts = 0
        self.seen: Counter = Counter()
        self.bodies: dict[str, dict] = {}  # delivery id -> the body delivered
        self.bad_signatures = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = self.rfile.read(length)
                if len(body) < length:  # the client died mid-request (kill -9): nothing delivered, no signature
                    self.close_connection = True
                    return
                receiver.handle(self, body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _Server(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes) -> None:
        time.sleep(self.delay_s)
        if self.hold_after is not None and sum(self.seen.values()) >= self.hold_after:
            self.released.wait(60)
        stamp = request.headers["X-Ticketq-Timestamp"]
        ok = hmac.compare_digest(sign(self.secret.encode(), stamp, body), request.headers["X-Ticketq-Signature"])
        delivery = request.headers["X-Ticketq-Delivery"]
        with self.lock:
            self.posts += 1
            if self.up_at is None:
                self.up_at = time.monotonic() + self.down_s
            failing = self.fail_first is None or self.posts <= self.fail_first or time.monotonic() < self.up_at
            if not ok:
                self.bad_signatures += 1
            elif not failing:
                self.bodies[delivery] = json.loads(body)
                self.seen[delivery] += 1
        request.send_response(500 if failing or not ok else 200)
        request.send_header("Content-Length", "0")
        request.end_headers()

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def receiving(**kwargs: object):
    receiver = Receiver(**kwargs)
    try:
        yield receiver
    finally:
        receiver.close()


class Dispatcher:
    """`python -m gateway deliver` with its own consumer group, fast retries."""

    def __init__(self, workdir: Path, broker_url: str, queue: str, receiver_url: str, group: str, **extra: str) -> None:
        self.metrics_port = free_port()
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        self.env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TICKETQ_BROKER_URL=broker_url, TICKETQ_QUEUE=queue,
                        TICKETQ_DELIVER_URL=receiver_url, TICKETQ_DELIVER_SECRET=SECRET, TICKETQ_DELIVER_GROUP=group,
                        TICKETQ_DELIVER_BACKOFF_S="0.05", TICKETQ_DELIVER_BACKOFF_MAX_S="0.2",
                        TICKETQ_DELIVER_CLAIM_IDLE_S="1", TICKETQ_DELIVER_TIMEOUT_S="0.7")  # fmt: skip
        self.env["TICKETQ_DELIVER_METRICS_PORT"] = str(self.metrics_port)
        self.env.update(extra)
        self.log = workdir / f"deliver-{group}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Dispatcher:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "deliver"], cwd=ROOT, env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        return self

    def kill(self) -> None:
        end_process(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        end_process(self.proc, timeout=30)

    def command(self, *args: str) -> subprocess.CompletedProcess:
        """`python -m gateway deliver ARGS` (a repair command) with this dispatcher's settings."""
        return subprocess.run([sys.executable, "-m", "gateway", "deliver", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    def metric(self, name: str) -> float:
        for line in httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0


@contextmanager
def dispatching(*args: object, **kwargs: str):
    dispatcher = Dispatcher(*args, **kwargs).start()
    try:
        yield dispatcher
    finally:
        dispatcher.stop()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A private Redis whose results stream holds the answers of 300 tickets from a real worker, and
    of one ticket POSTed with metadata to a real gateway; (broker url, every entry id, workdir)."""
    workdir = tmp_path_factory.mktemp("deliver")
    with null_classifier_service(workdir, "deliver") as (url, queue):
        with Producer(ClientSettings(broker_url=url, queue=queue)) as producer:
            sent = producer.submit_many([{"id": f"r{n}", "text": f"ticket {n}"} for n in range(300)], pack=10)
            rows = producer.wait(sent, timeout=120)
        assert all(row["status"] == "ok" for row in rows)
        with running_gateway(workdir, url, queue) as gateway:
            ticket = {"id": "via-gateway", "text": "refund please", "metadata": {"helpdesk": "T-9"}}
            assert gateway.client.post("/v1/tickets", json=ticket).status_code == 202
            assert gateway.client.get("/v1/tickets/via-gateway", params={"wait": 20}).status_code == 200
        entries = [entry_id.decode() for entry_id, _ in redis.Redis.from_url(url).xrange(RESULTS_STREAM)]
        assert len(entries) == 301
        yield url, entries, workdir, queue


def _group() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


def test_kill_9_mid_stream_loses_nothing(results):
    """Killed with results in flight and restarted (the same consumer name, the host's: it re-reads
    its own pending entries): every result delivered at least once; deduplicated, each exactly once."""
    url, entries, workdir, queue = results
    group = _group()
    with receiving(delay_s=0.01, hold_after=60) as receiver:
        first = Dispatcher(workdir, url, queue, receiver.url, group, TICKETQ_DELIVER_CONCURRENCY="2").start()
        wait_for(lambda: sum(receiver.seen.values()) >= 60, 60, "the first deliveries")
        first.kill()  # its next POSTs wait in the receiver: killed mid-stream, whatever the machine's load
        assert len(receiver.seen) < len(entries), "killed too late to be mid-stream"
        receiver.release()
        with dispatching(workdir, url, queue, receiver.url, group, TICKETQ_DELIVER_CONCURRENCY="2"):
            wait_for(lambda: set(receiver.seen) >= set(entries), 60, "every result delivered")
        assert set(receiver.seen) == set(entries) and receiver.bad_signatures == 0
    bodies = {body["result"]["id"]: body for body in receiver.bodies.values()}
    assert all(body["delivery_id"] in entries for body in bodies.values())
    assert bodies["via-gateway"]["metadata"] == {"helpdesk": "T-9"}  # kept by the gateway, delivered with it
    assert bodies["r0"]["metadata"] is None and bodies["r0"]["result"]["status"] == "ok"
    pending = redis.Redis.from_url(url).xpending(RESULTS_STREAM, group)["pending"]
    assert pending == 0


def test_a_post_cut_short_by_its_senders_death_is_neither_delivered_nor_a_bad_signature():
    """What the receiver sees when a dispatcher is killed mid-POST (the test above): a body shorter
    than its Content-Length, then EOF. It was counted as a bad signature, failing that test by chance."""
    with receiving() as receiver:
        with socket.create_connection(("127.0.0.1", receiver.server.server_port), timeout=5) as conn:
            conn.sendall(b"POST /hook HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nX-Ticketq-Timestamp: 1\r\n"
                         b"X-Ticketq-Signature: v1=0\r\nX-Ticketq-Delivery: d\r\n\r\n" + b"{" * 40)  # fmt: skip
            conn.shutdown(socket.SHUT_WR)
            assert conn.recv(1024) == b""  # closed unanswered
        assert receiver.bad_signatures == 0 and not receiver.seen


def test_a_receiver_failing_for_a_while_gets_the_backlog(results):
    url, entries, workdir, queue = results
    group, env = _group(), {"TICKETQ_DELIVER_MAX_ATTEMPTS": "30"}
    with receiving(fail_first=100) as receiver, dispatching(workdir, url, queue, receiver.url, group,
                                                            **env) as dispatcher:
        wait_for(lambda: set(receiver.seen) >= set(entries), 60, "the backlog delivered")
        assert receiver.posts >= len(entries) + 100
        assert dispatcher.metric("ticketq_deliver_dead_letters_total") == 0
        assert dispatcher.metric('ticketq_deliver_attempts_total{outcome="http_500"}') >= 100


def test_a_receiver_failing_for_good_ends_in_the_dead_letter_stream(results):
    url, entries, workdir, queue = results
    group = _group()
    client = redis.Redis.from_url(url)
    before = client.xlen(DELIVER_DEAD_STREAM)
    twice = {"TICKETQ_DELIVER_MAX_ATTEMPTS": "2"}
    with receiving(fail_first=None) as receiver, dispatching(workdir, url, queue, receiver.url, group,
                                                             **twice) as dispatcher:
        wait_for(lambda: client.xlen(DELIVER_DEAD_STREAM) - before >= len(entries), 60, "every result dead-lettered")
        wait_for(lambda: dispatcher.metric("ticketq_deliver_dead_letters_total") >= len(entries), 10, "the metric")
        attempts = sum(dispatcher.metric(f'ticketq_deliver_attempts_total{{outcome="{outcome}"}}')
                       for outcome in ("http_500", "error"))  # fmt: skip
        assert attempts == 2 * len(entries) and receiver.posts <= attempts and not receiver.seen
    dead = client.xrange(DELIVER_DEAD_STREAM)[before:]
    assert sorted(fields[b"entry_id"].decode() for _, fields in dead) == sorted(entries)
    assert all(b"answered 500" in fields[b"error"] for _, fields in dead)
    assert client.xpending(RESULTS_STREAM, group)["pending"] == 0
    listed = dispatcher.command("dead")
    assert listed.returncode == 0 and len(listed.stdout.splitlines()) == client.xlen(DELIVER_DEAD_STREAM)
    assert all(line.split("\t")[1] in entries for line in listed.stdout.splitlines()[-len(entries):])
    with receiving() as receiver:
        dispatcher.env["TICKETQ_DELIVER_URL"] = receiver.url
        again = dispatcher.command("dead", "--redeliver")
        assert again.returncode == 0, again.stdout + again.stderr
        assert set(receiver.seen) >= set(entries)  # under their first delivery ids
    assert client.xlen(DELIVER_DEAD_STREAM) == 0


def test_a_restart_under_the_default_name_takes_its_own_pending_entries(results):
    """No TICKETQ_DELIVER_CONSUMER and no re-claim (an hour's idle): what the killed dispatcher held
    pending is delivered by its restart alone, and the group keeps one consumer name."""
    url, entries, workdir, queue = results
    group, env = _group(), {"TICKETQ_DELIVER_CLAIM_IDLE_S": "3600", "TICKETQ_DELIVER_CONCURRENCY": "4"}
    client = redis.Redis.from_url(url)
    with receiving(delay_s=0.02, hold_after=40) as receiver:
        first = Dispatcher(workdir, url, queue, receiver.url, group, **env).start()
        wait_for(lambda: sum(receiver.seen.values()) >= 40, 60, "the first deliveries")
        first.kill()  # its next POSTs wait in the receiver: entries in flight, whatever the machine's load
        assert client.xpending(RESULTS_STREAM, group)["pending"] > 0, "killed with nothing in flight"
        receiver.release()
        with dispatching(workdir, url, queue, receiver.url, group, **env):
            wait_for(lambda: set(receiver.seen) >= set(entries), 60, "every result delivered")
    assert [c["name"].decode() for c in client.xinfo_consumers(RESULTS_STREAM, group)] == [socket.gethostname()]
    assert client.xpending(RESULTS_STREAM, group)["pending"] == 0


def test_a_receiver_down_for_ten_minutes_with_the_default_schedule_scaled_down(results):
    """The default schedule (TICKETQ_DELIVER_MAX_ATTEMPTS and the doubling) with every pause and the
    outage 300 times shorter: ten minutes become 2 s, and nothing is dead-lettered."""
    url, entries, workdir, queue = results
    scale = 300
    defaults = GatewaySettings.model_fields
    env = {"TICKETQ_DELIVER_BACKOFF_S": str(defaults["deliver_backoff_s"].default / scale),
           "TICKETQ_DELIVER_BACKOFF_MAX_S": str(defaults["deliver_backoff_max_s"].default / scale),
           "TICKETQ_DELIVER_MAX_ATTEMPTS": str(defaults["deliver_max_attempts"].default)}  # fmt: skip
    with receiving(down_s=600 / scale) as receiver, dispatching(workdir, url, queue, receiver.url, _group(),
                                                                **env) as dispatcher:  # fmt: skip
        wait_for(lambda: set(receiver.seen) >= set(entries), 60, "everything delivered after the outage")
        assert dispatcher.metric('ticketq_deliver_attempts_total{outcome="http_500"}') > 0  # it was down
        assert dispatcher.metric("ticketq_deliver_dead_letters_total") == 0


def test_results_trimmed_before_delivery_are_counted_logged_once_and_redelivered(tmp_path):
    """The dispatcher stopped while 10x TICKETQ_STREAM_MAXLEN results are produced: on restart it
    delivers what the stream still holds, counts and logs (once) what was trimmed, and
    `redeliver-trimmed` POSTs those from the Celery backend: every ticket's result arrives."""
    maxlen, tickets = 100, [{"id": f"t{n}", "text": f"ticket {n}"} for n in range(1000)]
    with null_classifier_service(tmp_path, "trim", TICKETQ_STREAM_MAXLEN=str(maxlen)) as (url, queue):
        client, group = redis.Redis.from_url(url), _group()
        client.xgroup_create(RESULTS_STREAM, group, id="0", mkstream=True)  # a dispatcher ran, then stopped
        with Producer(ClientSettings(broker_url=url, queue=queue)) as producer:
            rows = producer.wait(producer.submit_many(tickets, pack=10), timeout=120)
        assert all(row["status"] == "ok" for row in rows)
        kept = [entry_id.decode() for entry_id, _ in client.xrange(RESULTS_STREAM)]
        assert len(kept) < len(tickets) // 2, "nothing was trimmed"
        with receiving() as receiver:
            with dispatching(tmp_path, url, queue, receiver.url, group) as dispatcher:
                wait_for(lambda: set(receiver.seen) >= set(kept), 60, "what the stream holds delivered")
                wait_for(lambda: dispatcher.metric("ticketq_deliver_trimmed_results_total") > 0, 10, "the count")
                assert dispatcher.metric("ticketq_deliver_trimmed_results_total") == len(tickets) - len(kept)
                wait_for(lambda: dispatcher.metric("ticketq_deliver_lag_results") == 0, 10, "no lag left")
            assert dispatcher.log.read_text().count("were trimmed from") == 1
            repaired = dispatcher.command("redeliver-trimmed")
            assert repaired.returncode == 0, repaired.stdout + repaired.stderr
            arrived = {body["result"]["id"] for body in receiver.bodies.values()}
        assert arrived == {ticket["id"] for ticket in tickets}  # 0 lost
        assert client.xlen(DELIVER_GAPS_STREAM) == 0  # the range repaired is forgotten
        assert dispatcher.command("redeliver-trimmed").stdout.startswith("0 delivered")


def test_the_dispatcher_alert_rules_fire_and_stay_quiet():
    """deploy/prometheus/deliver-alerts.yml: delivery lag, trimmed results and dead letters page,
    each with its text, and a healthy dispatcher does not (promtool's rule unit tests)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        skip_or_fail("no promtool (Debian package `prometheus`)")
    rules = ROOT / "deploy" / "prometheus"
    checked = subprocess.run([promtool, "check", "rules", str(rules / "deliver-alerts.yml")], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", str(rules / "deliver-alerts.test.yml")], capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_consumers_of_stopped_dispatchers_are_forgotten(results):
    """A name a stopped dispatcher left in the group (an old `host:pid`), holding nothing and idle
    past TICKETQ_DELIVER_CLAIM_IDLE_S, is deleted; the running dispatcher's own name stays."""
    url, _, workdir, queue = results
    client, group = redis.Redis.from_url(url), _group()
    client.xgroup_create(RESULTS_STREAM, group, id="$")
    client.xgroup_createconsumer(RESULTS_STREAM, group, "old-host:4242")

    def names() -> list[str]:
        return [consumer["name"].decode() for consumer in client.xinfo_consumers(RESULTS_STREAM, group)]

    with receiving() as receiver, dispatching(workdir, url, queue, receiver.url, group):
        wait_for(lambda: names() == [socket.gethostname()], 60, "the stopped consumer forgotten")


def test_pending_entries_trimmed_before_their_ack_are_counted(tmp_path):
    """A dispatcher read five results and stopped before acking them; the stream was trimmed past
    them. Restarted under the same name, it finds them without fields: counted as trimmed, recorded
    for `redeliver-trimmed`, and acked, so they are not read as empty forever; new results flow on."""
    server = RedisServer(tmp_path, aof=False).start()
    try:
        client, group = redis.Redis.from_url(server.url), _group()
        client.xgroup_create(RESULTS_STREAM, group, id="0", mkstream=True)
        for n in range(5):
            client.xadd(RESULTS_STREAM, {"data": codec.dumps({"id": f"p{n}", "status": "ok"})})
        assert len(client.xreadgroup(group, socket.gethostname(), {RESULTS_STREAM: ">"}, count=5)[0][1]) == 5
        client.xtrim(RESULTS_STREAM, maxlen=0)
        new = client.xadd(RESULTS_STREAM, {"data": codec.dumps({"id": "after", "status": "ok"})}).decode()
        with receiving() as receiver, dispatching(tmp_path, server.url, "q", receiver.url, group) as dispatcher:
            wait_for(lambda: new in receiver.seen, 60, "the new result delivered")
            wait_for(lambda: dispatcher.metric("ticketq_deliver_trimmed_results_total") == 5, 10, "the count")
        assert client.xpending(RESULTS_STREAM, group)["pending"] == 0
        assert client.xlen(DELIVER_GAPS_STREAM) == 5
    finally:
        server.stop()
