"""A worker that no Redis fault kills or blinds, and no connection that strands a ticket.

Real `ticketq worker` processes (the null classifier: model cost does not matter here) on private
redis-servers, some behind a fault-injecting TCP proxy (tests/support/proxy.py) that drops one
reply and leaves that connection half-open:

- the reply to a fetch (BLMOVE) lost: the ticket it moved into the worker's fetching list is
  answered by that worker once kombu drops the stale connection, once;
- the reply to the claim script lost: the event loop is stuck on the read until the socket timeout,
  /readyz says 503 meanwhile, and the ticket is answered after the reconnect, once;
- SIGSTOP, Redis kill -9 and AOF restart, SIGCONT, five times in a row: the worker keeps serving;
- an unrecoverable error exits non-zero (a supervisor restarts failures only);
- a worker whose clock runs ahead restores no message in flight (the sweep reads Redis's clock).

Tests wait on events (results, log lines, /readyz), never on sleeps; figures are printed (`pytest -s`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import redis
from faults import DELAY_ENV
from kombu import Connection, Consumer, Queue
from proxy import RedisProxy, command_is
from redis.backoff import NoBackoff
from redis.retry import Retry
from test_memory import readyz
from workers import ROOT, RedisServer, StartedWorkers, Worker, free_port, wait_for, worker_env

from producer.api import Producer
from ticketq import names
from ticketq.names import ATTEMPTS_KEY, FETCHING_KEY
from worker.settings import Settings
from worker.transport import fetch as internals

pytestmark = pytest.mark.integration

# Lease 2 s: a lost consumer's messages come back within seconds; the bound a ticket must be
# answered in is the lease plus the worst batch plus kombu's stale-connection check (11 s).
LEASE_S, WORST_BATCH_S = 2.0, 5.0
ANSWER_BOUND_S = 11 + internals.COMMAND_TIMEOUT_S + 2 * LEASE_S + WORST_BATCH_S
SLACK_S = 30  # a loaded 2-core machine: scheduling, never the mechanism itself


@pytest.fixture
def workers(tmp_path) -> Iterator[Callable[..., Worker]]:
    workers = StartedWorkers(tmp_path)

    def start(url: str, queue: str, name: str, faulty: bool = False, **extra: str) -> Worker:
        env = worker_env(None, url, queue, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_LEASE_S=str(LEASE_S),
                         TICKETQ_WORST_BATCH_S=str(WORST_BATCH_S), **extra)  # fmt: skip
        return workers.start(env, name, faulty=faulty)

    yield start
    workers.stop()


@pytest.fixture
def proxy(redis_server) -> Iterator[RedisProxy]:
    proxy = RedisProxy(redis_server.port).start()
    yield proxy
    proxy.close()


def stream_counts(client: redis.Redis) -> Counter:
    return Counter(json.loads(fields[b"data"])["id"] for _, fields in client.xrange(names.RESULTS_STREAM))


def send(url: str, queue: str, texts: list[str]) -> set[str]:
    """The ticket ids of `texts`, sent one per message."""
    with Producer(Settings(broker_url=url, queue=queue)) as producer:
        return {ticket for sent in producer.submit_many(texts) for ticket in sent.ticket_ids}


def answered_once(client: redis.Redis, ids: set[str], timeout: float, what: str) -> float:
    started = time.monotonic()
    wait_for(lambda: ids <= set(stream_counts(client)), timeout, what, interval=0.1)
    counts = stream_counts(client)
    assert all(counts[ticket] == 1 for ticket in ids), {t: counts[t] for t in ids if counts[t] != 1}
    return time.monotonic() - started


def fetching_lists_empty(client: redis.Redis) -> bool:
    return not any(client.llen(key) for key in client.keys(FETCHING_KEY.format(consumer="*", queue="*")))


def test_a_lost_fetch_reply_strands_nothing(redis_server, proxy, workers):
    """The reply to the BLMOVE that moved a ticket into the worker's fetching list never comes:
    kombu drops the stale connection, and the channel delivers the list before it fetches again."""
    queue, client = f"half-open-fetch-{uuid.uuid4().hex[:6]}", redis_server.client()
    worker = workers(f"redis://127.0.0.1:{proxy.port}/0", queue, "fetch")
    proxy.drop_reply(command_is("BLMOVE"))
    sent = send(redis_server.url, queue, ["my invoice is wrong"])
    assert proxy.dropped.wait(30), "no fetch reply was dropped"
    took = answered_once(client, sent, ANSWER_BOUND_S + SLACK_S, "the ticket whose fetch reply was lost")
    print(f"\n[lost fetch reply] answered {took:.1f}s after the ticket was sent (bound {ANSWER_BOUND_S:g}s)")
    assert "never came" in worker.log(), worker.log()[-3000:]
    assert worker.proc.poll() is None
    more = send(redis_server.url, queue, [f"after the fault {n}" for n in range(20)])
    answered_once(client, more, 60, "tickets sent after the fault")
    assert fetching_lists_empty(client)


def test_a_lost_claim_reply_is_not_ready_then_answered_once(redis_server, proxy, workers):
    """The reply to the script that records fetched messages never comes: the event loop waits on it
    until the socket timeout, /readyz answers 503 meanwhile, and the ticket is answered after the
    worker reconnects (its old consumer recovered once the lease ran out)."""
    queue, client = f"half-open-claim-{uuid.uuid4().hex[:6]}", redis_server.client()
    worker = workers(f"redis://127.0.0.1:{proxy.port}/0", queue, "claim")
    proxy.drop_reply(command_is("EVAL", b"claim"))
    sent = send(redis_server.url, queue, ["the app crashes on start"])
    assert proxy.dropped.wait(30), "no claim reply was dropped"
    wait_for(lambda: readyz(worker)[0] == 503 and "fetching stalled" in readyz(worker)[1],
             internals.COMMAND_TIMEOUT_S + 5, "/readyz 503 'fetching stalled' while the loop is stuck",
             interval=0.1)  # fmt: skip
    took = answered_once(client, sent, ANSWER_BOUND_S + SLACK_S, "the ticket whose claim reply was lost")
    print(f"\n[lost claim reply] answered {took:.1f}s after /readyz said 503 (bound {ANSWER_BOUND_S:g}s)")
    wait_for(lambda: readyz(worker)[0] == 200, 30, "/readyz 200 again")
    assert worker.proc.poll() is None
    more = send(redis_server.url, queue, [f"after the fault {n}" for n in range(20)])
    answered_once(client, more, 60, "tickets sent after the fault")


def test_sigstop_across_a_redis_restart_five_times_the_worker_keeps_serving(redis_server, workers):
    """SIGSTOP mid-batch, Redis kill -9 and AOF restart, SIGCONT: the channel the worker held closes
    under its running job, whose acks then reach the closed channel. Five times in a row, the same
    process serves every ticket once."""
    queue, rounds, client = f"stop-restart-{uuid.uuid4().hex[:6]}", 5, redis_server.client()
    # Each batch takes 0.2 s: the SIGSTOP lands while one runs, with messages unacked.
    worker = workers(redis_server.url, queue, "stop-restart", faulty=True, **{DELAY_ENV: "0.2"})
    ids: set[str] = set()
    for n in range(rounds):
        ids |= send(redis_server.url, queue, [f"round {n} ticket {i}" for i in range(200)])
        wait_for(partial(client.keys, ATTEMPTS_KEY.format(task_id="*")), 60, "a batch in progress", interval=0.005)
        worker.proc.send_signal(signal.SIGSTOP)
        redis_server.kill()
        redis_server.start()  # same port and dir: the AOF is replayed
        worker.proc.send_signal(signal.SIGCONT)
        client = redis_server.client()
        answered_once(client, ids, 120, f"round {n}: every ticket so far")
        assert worker.proc.poll() is None, f"round {n}: the worker exited:\n{worker.log()[-4000:]}"
    log = worker.log()
    print(f"\n[sigstop + redis restart] {rounds} rounds, {len(ids)} tickets answered once, worker pid {worker.pid} "
          f"alive; 'Unrecoverable error' in its log: {log.count('Unrecoverable error')}")
    assert "Unrecoverable error" not in log, log[-4000:]


def test_an_unrecoverable_error_exits_non_zero(redis_server, tmp_path):
    """Celery logs "Unrecoverable error" and stops; the process must not exit 0 (`Restart=on-failure`)."""
    script = textwrap.dedent("""
        import sys
        from worker.transport import fetch

        def broken(self):
            raise RuntimeError("injected: the event loop's tick failed")

        fetch.Channel.flush_acks = broken
        from ticketq_cli.cli import main
        sys.argv = ["ticketq", "worker"]
        main()
    """)
    env = worker_env(None, redis_server.url, f"broken-{uuid.uuid4().hex[:6]}", TICKETQ_NULL_CLASSIFIER="1",
                     TICKETQ_METRICS_PORT=str(free_port()), PYTHONPATH=str(ROOT))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    output = done.stdout + done.stderr
    assert "Unrecoverable error" in output, output[-3000:]
    assert done.returncode != 0, output[-3000:]


def test_a_clock_far_ahead_restores_no_message_in_flight(redis_server, monkeypatch):
    """The visibility sweep compares the unacked record's times with Redis's clock: a worker whose
    clock runs 400 s ahead (visibility timeout 60 s) restores nothing another worker holds; once
    the timeout has passed by Redis's clock, the same sweep restores it."""
    queue, client = Queue(f"clock-{uuid.uuid4().hex[:6]}"), redis_server.client()
    options = {"visibility_timeout": 60}
    held: list = []
    with Connection(redis_server.url, transport=internals.Transport, transport_options=options) as conn:
        conn.Producer().publish({"id": "t1"}, routing_key=queue.name, declare=[queue], serializer="json")
        with Consumer(conn, [queue], callbacks=[lambda body, message: held.append(message)]):
            conn.drain_events(timeout=10)
        assert held and client.hlen("unacked") == 1
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 400)
        with Connection(redis_server.url, transport=internals.Transport, transport_options=options) as ahead:
            ahead.default_channel.qos.restore_visible(num=100, interval=1)
            assert client.hlen("unacked") == 1 and client.llen(queue.name) == 0, "restored by a clock 400 s ahead"
        monkeypatch.undo()
        client.zincrby("unacked_index", -61, held[0].delivery_tag)  # recorded 61 s ago, by Redis's clock
        with Connection(redis_server.url, transport=internals.Transport, transport_options=options) as sweeper:
            sweeper.default_channel.qos.restore_visible(num=100, interval=1)
        assert client.hlen("unacked") == 0 and client.llen(queue.name) == 1, "past its timeout: restored"


def test_an_ack_on_a_closed_channel_is_left_to_the_redelivery(redis_server):
    """A reconnect closes the channel under the running job; the job's acks then reach it. kombu put
    the message back at close; the ack does nothing, and raises nothing."""
    queue, client = Queue(f"closed-ack-{uuid.uuid4().hex[:6]}"), redis_server.client()
    held: list = []
    with Connection(redis_server.url, transport=internals.Transport) as conn:
        conn.Producer().publish({"id": "t1"}, routing_key=queue.name, declare=[queue], serializer="json")
        with Consumer(conn, [queue], callbacks=[lambda body, message: held.append(message)]):
            conn.drain_events(timeout=10)
        held[0].channel.close()
        held[0].ack()
    assert client.llen(queue.name) == 1, "restored at close, to be redelivered"


def test_proxy_forwards_untouched(redis_server, proxy):
    """The proxy alone changes nothing: commands and replies pass, pipelines and scripts included."""
    client = redis.Redis(port=proxy.port, socket_timeout=5)
    assert client.ping()
    pipe = client.pipeline()
    pipe.set("proxy-k", "v").get("proxy-k").eval("return {1, 'two', {3}}", 0)
    assert pipe.execute() == [True, b"v", [1, b"two", [3]]]
    assert not proxy.dropped.is_set()


def test_proxy_drops_one_reply_and_goes_half_open(redis_server, proxy):
    """The first matching reply is dropped and that connection answers nothing more; others work."""
    proxy.drop_reply(command_is("GET"))
    victim = redis.Redis(port=proxy.port, socket_timeout=1, retry=Retry(NoBackoff(), 0))  # no retry on a new connection
    victim.set("proxy-k", "v")
    with pytest.raises(redis.TimeoutError):
        victim.get("proxy-k")
    assert proxy.dropped.is_set()
    assert redis.Redis(port=proxy.port, socket_timeout=5).get("proxy-k") == b"v", "a new connection is forwarded"


def test_proxy_closes_the_client_when_redis_goes_and_follows_its_upstream(redis_server, tmp_path):
    """Redis killed under a proxied connection: the client sees the connection closed, as it would
    without the proxy (not a silent one that times out); each new connection goes where `upstream`
    says at that moment (docs/bench/chaos.py: the master the sentinels name)."""
    other = RedisServer(tmp_path / "other", aof=False)
    (tmp_path / "other").mkdir()
    target = [redis_server.port]
    proxy = RedisProxy(0, upstream=lambda: ("127.0.0.1", target[0])).start()
    try:
        client = redis.Redis(port=proxy.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
        assert client.set("where", "first")
        redis_server.kill()
        with pytest.raises(redis.ConnectionError):
            client.ping()
        redis_server.start()
        other.start().client().set("where", "other")
        target[0] = other.port
        assert redis.Redis(port=proxy.port, socket_timeout=5).get("where") == b"other"
    finally:
        proxy.close()
        other.kill()


def test_status_counts_what_waits_in_fetching_lists(redis_server):
    """`ticketq status` counts the ticket queue's messages in consumers' fetching lists (moved by a
    fetch, not yet recorded), apart from the unacked ones, and only that queue's."""
    from ticketq_cli.ops import Ops

    queue, client = f"census-{uuid.uuid4().hex[:6]}", redis_server.client()
    client.lpush(FETCHING_KEY.format(consumer="host:1:aaaa", queue=queue), b"m1", b"m2")
    client.lpush(FETCHING_KEY.format(consumer="host:2:bbbb", queue=queue), b"m3")
    client.lpush(FETCHING_KEY.format(consumer="host:2:bbbb", queue="another"), b"m4")
    ops = Ops(Settings(broker_url=redis_server.url, queue=queue))
    try:
        assert ops.fetching() == 3
    finally:
        ops.close()
