"""Redis Sentinel, for real: a primary, a replica and three sentinels (tests/support/servers.py), a real
worker on the tiny stand-in, tickets flowing, then kill -9 of the primary.

The replica falls behind for the last few sends before the kill (stopped, its replication link
dropped: the lag a busy or partitioned replica has). Without replica acks those sends were
acknowledged by a primary that then died: unless the worker had already taken them (it answers
what it holds on the new master), only the producer's re-send brings them back. With
TICKETQ_REPLICA_ACKS=1 the producer is told they are not replicated, and no ticket whose send
returned is lost. Either way the worker follows the promoted replica, the producer too, and no
result is streamed twice.

Figures (sent, answered, lost, duplicated, time to resume) are printed: `pytest -s`. The first
tests need no Redis: how sentinel:// settings are read and what kombu and Celery are given.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import redis
from servers import MASTER_NAME, SentinelSet, require_redis_server, sentinel_set
from workers import RedisServer, running_worker, wait_for, worker_env

from producer.api import Producer
from producer.errors import BrokerUnavailable, NotReplicated
from producer.messages import TicketResult
from ticketq import connections, names
from ticketq.config import ClientSettings, SettingsError, mask_url
from ticketq.names import ALIVE_KEY, ATTEMPTS_KEY, CONSUMERS_KEY, FETCHING_KEY
from worker.settings import Settings

pytestmark = pytest.mark.integration

QUEUE = "failover"
TICKETS = 600
RATE = 100  # tickets per second: the worker keeps up, so the kill lands mid-stream
LAGGED_SENDS = 5  # sends while the replica is behind, just before the kill
REPLICA_TIMEOUT_S = 0.1


SENTINELS = "sentinel://:pw@10.0.0.1:26379/2;sentinel://10.0.0.2:26380;sentinel://10.0.0.3"


# --------------------------------------------------------------------------------------------
# settings and wiring (no Redis)


def test_sentinel_urls_are_read_as_kombu_and_celery_read_them():
    settings = ClientSettings(broker_url=SENTINELS, sentinel_master="mymaster", sentinel_password="spw")
    target = connections.parse_sentinel_url(settings.broker_url)
    assert target.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379))
    assert (target.db, target.password) == (2, "pw"), "db and password from the first URL"
    assert connections.transport_options(settings.backend_url, **settings.sentinel) == {
        "master_name": "mymaster",
        "sentinel_kwargs": {"socket_timeout": 10.0, "socket_connect_timeout": 3.0, "password": "spw"},
    }
    assert connections.transport_options("redis://h:6379/0", "mymaster") == {}
    assert mask_url(SENTINELS) == SENTINELS.replace(":pw@", ":**@")
    assert "spw" not in repr(settings) and "spw" not in str(settings.sentinel_password)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sentinel://h:1;sentinel://h:2", "TICKETQ_SENTINEL_MASTER"),  # no master name
        ("sentinel://h:x;sentinel://h:2", "the port is not a number"),
        ("sentinel://h:1;redis://h:2", "mixes schemes"),
        ("sentinel://h:1;sentinel://:2", "names no host"),
    ],
)
def test_a_bad_sentinel_setting_is_one_line(url, expected):
    with pytest.raises(SettingsError) as info:
        ClientSettings.from_env(broker_url=url)
    assert expected in str(info.value) and len(str(info.value).splitlines()) == 1, str(info.value)
    with pytest.raises(SettingsError, match=expected):  # the Python API checks what it is given the same way
        Producer(broker_url=url)


def test_producer_urls_are_validated():
    with pytest.raises(SettingsError) as info:
        Producer(broker_url="http://:pw@x")
    assert str(info.value).startswith("broker_url=http://:**@x: must be a Redis URL"), str(info.value)


def test_the_worker_gives_kombu_and_celery_the_master_and_keeps_its_transport_on_failover():
    from worker.app import create_app

    app = create_app(Settings(broker_url=SENTINELS, sentinel_master="mymaster"))
    assert app.conf.broker_transport == "worker.transport:SentinelTransport"
    assert app.conf.broker_transport_options["master_name"] == "mymaster"
    assert app.conf.result_backend_transport_options["master_name"] == "mymaster"
    connection = app.connection_for_write()
    for _ in range(3):  # kombu steps to the next URL after a failed connect: it must keep the atomic fetch
        connection.maybe_switch_next()
        assert connection.transport_cls == "worker.transport:SentinelTransport"
    assert connection.alt == SENTINELS.split(";")


# --------------------------------------------------------------------------------------------
# a failover for real


@dataclass
class Sends:
    """What the producer thread sent: confirmed (acknowledged, and replicated when asked), and
    unconfirmed (NotReplicated: queued, maybe not on a replica)."""

    confirmed: list[TicketResult] = field(default_factory=list)
    unconfirmed: list[TicketResult] = field(default_factory=list)
    refused: int = 0  # sends that raised BrokerUnavailable (no master yet); each was tried again
    returned: list[tuple[float, float]] = field(default_factory=list)  # (started, returned) of each send
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def all(self) -> list[TicketResult]:
        return self.confirmed + self.unconfirmed

    def count(self) -> int:
        with self.lock:
            return len(self.confirmed) + len(self.unconfirmed)


def produce(producer: Producer, sends: Sends, stop: threading.Event) -> None:
    start = time.monotonic()
    for n in range(TICKETS):
        if stop.is_set():
            return
        if (pause := start + n / RATE - time.monotonic()) > 0:
            time.sleep(pause)  # pacing the load, not waiting for an event
        while not stop.is_set():
            started = time.time()
            try:
                result = producer.submit(f"failover ticket {n}: my invoice is wrong", id=f"fo-{n}")
            except NotReplicated as exc:
                with sends.lock:
                    sends.unconfirmed.extend(exc.results)
                    sends.returned.append((started, time.time()))
                break
            except BrokerUnavailable:  # no master right now: tried again once one answers
                sends.refused += 1
                wait_for(lambda: reachable(producer), 30, "a master for the producer", interval=0.05)
                continue
            with sends.lock:
                sends.confirmed.append(result)
                sends.returned.append((started, time.time()))
            break


def reachable(producer: Producer) -> bool:
    try:
        producer.check_connection()
    except BrokerUnavailable:
        return False
    return True


def stream(client: redis.Redis) -> list[tuple[float, dict]]:
    """(seconds the entry was added, result) of every results-stream entry on the current master."""
    return [(int(raw_id.decode().split("-")[0]) / 1000, json.loads(fields[b"data"]))
            for raw_id, fields in client.xrange(names.RESULTS_STREAM)]  # fmt: skip


def in_flight(client: redis.Redis) -> dict[str, int]:
    """Messages queued, fetched, unacked, and requests inside a batch (attempts keys), on `client`'s server."""
    fetching = client.keys(FETCHING_KEY.format(consumer="*", queue="*"))
    return {"queued": client.llen(QUEUE), "fetched": sum(client.llen(key) for key in fetching),
            "unacked": client.hlen("unacked"), "in a batch": len(client.keys(ATTEMPTS_KEY.format(task_id="*")))}


def drained(client: redis.Redis, worker, timeout: float) -> None:
    """Until every message on `client`'s server is acknowledged (so its results are out); the error
    says what is left, and the worker's log.

    Not "no attempts keys": a message redelivered into the job still running its first delivery
    (the lease recovered it while that job waited for the new master) leaves its attempts key
    behind until it expires, although it is answered once.
    """
    settled = lambda: not any(n for what, n in in_flight(client).items() if what != "in a batch")  # noqa: E731
    try:
        wait_for(settled, timeout, "every message acknowledged", interval=0.2)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}: {in_flight(client)}; worker log:\n{worker.log()[-6000:]}") from None


@pytest.mark.parametrize("replica_acks", [0, 1], ids=["no-replica-acks", "replica-acks-1"])
def test_failover_loses_nothing_acknowledged_and_the_worker_follows(tmp_path, tiny_model_dir, replica_acks):
    with sentinel_set(tmp_path / "redis") as servers:
        run_failover(servers, tmp_path, tiny_model_dir, replica_acks)


def run_failover(servers: SentinelSet, tmp_path, tiny_model_dir, replica_acks: int) -> None:
    acks = {"TICKETQ_REPLICA_ACKS": str(replica_acks), "TICKETQ_REPLICA_TIMEOUT_S": str(REPLICA_TIMEOUT_S)}
    # Lease 2 s: the channel lost in the failover has its messages back within seconds; the
    # visibility timeout (an hour) never comes into it.
    env = worker_env(tiny_model_dir, servers.url, QUEUE, TICKETQ_SENTINEL_MASTER=MASTER_NAME, TICKETQ_LEASE_S="2",
                     TICKETQ_VISIBILITY_TIMEOUT_S="3600", **acks)  # fmt: skip
    settings = ClientSettings(broker_url=servers.url, sentinel_master=MASTER_NAME, queue=QUEUE,
                              replica_acks=replica_acks, replica_timeout_s=REPLICA_TIMEOUT_S)  # fmt: skip
    with running_worker(env, tmp_path / "worker.log") as worker:
        producer = Producer(settings)
        sends, stop = Sends(), threading.Event()
        sender = threading.Thread(target=produce, args=(producer, sends, stop))
        sender.start()
        try:
            old = servers.master_client()
            wait_for(lambda: old.xlen(names.RESULTS_STREAM) >= 150, 60, "150 results before the kill")
            servers.cut_replication()
            lagged_from = sends.count()
            wait_for(lambda: sends.count() >= lagged_from + LAGGED_SENDS, 30, "sends while the replica lags")
            old_port = servers.kill_primary()
            killed_at = time.time()
            servers.resume()
            new_master = servers.wait_promoted(old_port)
            promoted_at = time.time()
            servers.rejoin(old_port)  # back as a replica of the new master: replica acks can be met again
            client = redis.Redis(host=new_master[0], port=new_master[1])
            sender.join(timeout=120)
            assert not sender.is_alive(), "the producer must follow the new master"
            drained(client, worker, 60)

            answered_first = {(result["task_id"], result["id"]) for _, result in stream(client)}
            confirmed = {(result.id, result.ticket_ids[0]) for result in sends.confirmed}
            everything = {(result.id, result.ticket_ids[0]) for result in sends.all}
            lost_confirmed = len(confirmed - answered_first)
            lost_before_resend = len(everything - answered_first)
            results = producer.wait(sends.all, timeout=60, resend_after=2)
        finally:
            stop.set()
            sender.join(timeout=30)
            producer.close()
        entries = stream(client)
        counts = Counter((r["task_id"], r["id"]) for _, r in entries)
        per_ticket = Counter(r["id"] for _, r in entries)
        answered = {r["id"] for r in results if r["status"] == "ok"}
        lost = len({result.ticket_ids[0] for result in sends.all} - answered)
        duplicated = sum(n - 1 for n in counts.values())
        resumed_at = min((added for added, _ in entries if added >= promoted_at), default=float("inf"))
        sending_at = min((done for started, done in sends.returned if started > killed_at), default=float("inf"))
        leases = [name.decode() for name in client.hkeys(CONSUMERS_KEY)
                  if client.exists(ALIVE_KEY.format(consumer=name.decode()))]  # fmt: skip
        log = worker.log()
        print(
            f"\n[failover, TICKETQ_REPLICA_ACKS={replica_acks}] sent {len(sends.all)} "
            f"({len(sends.confirmed)} confirmed, {len(sends.unconfirmed)} not replicated, {sends.refused} sends "
            f"refused while no master answered, tried again); promoted {promoted_at - killed_at:.1f}s after the "
            f"kill; worker answering {resumed_at - promoted_at:.1f}s after promotion, producer sending "
            f"{sending_at - promoted_at:.1f}s after it; lost before re-send "
            f"{lost_before_resend} ({lost_confirmed} of them confirmed), lost after re-send {lost}; answered "
            f"{len(answered)}; duplicated in the stream {duplicated} (tickets answered under two task ids, "
            f"ambiguous sends tried again: {sum(n > 1 for n in per_ticket.values())})"
        )  # fmt: skip
        assert worker.proc.poll() is None, "the worker must follow the failover, not exit"
        assert "Unrecoverable error" not in log, log[-3000:]
        assert "Traceback" not in log, f"a failover is an outage: a line each, no traceback\n{log[-3000:]}"
        assert lost == 0
        assert duplicated == 0
        assert resumed_at - promoted_at < 10, "the worker answers again within 10 s of the promotion"
        assert leases, "the reconnected consumer holds a lease on the new master: still the atomic fetch"
        if replica_acks:
            assert lost_confirmed == 0, "a send confirmed by a replica survives the failover"
            assert sends.unconfirmed, "the sends while the replica lagged were reported as not replicated"


def test_a_master_demoted_under_a_plain_url_does_not_stop_the_worker(tmp_path):
    """redis:// straight at a master that becomes a replica (what a failover does to an old master
    that comes back): its blocked fetch is cut (UNBLOCKED), its writes answer READONLY. The worker
    keeps trying instead of exiting, and resumes when the node is a master again."""
    require_redis_server()
    node, other = (RedisServer(tmp_path / name, aof=False) for name in ("node", "other"))
    for server in (node, other):
        server.workdir.mkdir()
        server.start()
    env = worker_env(None, node.url, QUEUE, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_LEASE_S="2")
    producer = Producer(ClientSettings(broker_url=node.url, queue=QUEUE))
    try:
        with running_worker(env, tmp_path / "worker.log") as worker:
            before = producer.wait(producer.submit_many([f"before {n}" for n in range(20)]), timeout=30)
            node.client().replicaof("127.0.0.1", other.port)
            wait_for(lambda: "read-only replica" in worker.log() or "READONLY" in worker.log(), 30,
                     "the worker meeting the demoted node")  # fmt: skip
            demoted_log = worker.log()
            assert worker.proc.poll() is None, demoted_log[-3000:]
            node.client().replicaof("NO", "ONE")
            promoted = time.monotonic()
            after = producer.wait(producer.submit_many([f"after {n}" for n in range(20)]), timeout=60)
            resumed_s = time.monotonic() - promoted
            assert worker.proc.poll() is None, worker.log()[-3000:]
    finally:
        producer.close()
        for server in (node, other):
            server.kill()
    print(f"\n[demoted] the worker rode out its master turning replica; answering {resumed_s:.1f}s after it was "
          "a master again")  # fmt: skip
    assert {r["status"] for r in before + after} == {"ok"}
    assert "Unrecoverable error" not in demoted_log


def test_a_producer_caught_mid_send_by_a_failover_rides_it_out_and_accounts_for_every_ticket(tmp_path):
    """kill -9 of the primary while `ticketq-produce file` is sending (held by SIGSTOP at that
    point, so the kill lands mid-send on any machine): the producer asks again through the
    promotion instead of exit 2, sends the interrupted pipeline again, re-sends what the old
    primary took but never replicated, and exits 0 with every row answered, each once."""
    from test_producer_outages import PUBLISH_BATCH as BATCH
    from test_producer_outages import QUEUE as PRODUCE_QUEUE
    from test_producer_outages import Produce, statuses, ticket_file

    n = 6_000
    with sentinel_set(tmp_path / "redis") as servers:
        env = worker_env(None, servers.url, PRODUCE_QUEUE, TICKETQ_NULL_CLASSIFIER="1", TICKETQ_LEASE_S="2",
                         TICKETQ_SENTINEL_MASTER=MASTER_NAME, TICKETQ_VISIBILITY_TIMEOUT_S="3600")  # fmt: skip
        with running_worker(env, tmp_path / "worker.log") as worker:
            tickets, out = ticket_file(tmp_path / "t.jsonl", n), tmp_path / "r.jsonl"
            produce = Produce(tmp_path, servers, "file", str(tickets), "--out", str(out), "--resend-after", "2",
                              "--timeout", "180", env={"TICKETQ_SENTINEL_MASTER": MASTER_NAME})  # fmt: skip
            old = servers.master_client()
            taken = lambda: old.llen(PRODUCE_QUEUE) + old.hlen("unacked") + old.xlen(names.RESULTS_STREAM)  # noqa: E731
            wait_for(lambda: taken() >= 2 * BATCH or produce.proc.poll() is not None, 60, "two pipelines sent",
                     interval=0.002)  # fmt: skip
            produce.proc.send_signal(signal.SIGSTOP)
            held = taken()
            assert produce.proc.poll() is None and held < n, "still sending when the primary is killed"
            old_port = servers.kill_primary()
            killed_at = time.monotonic()
            produce.proc.send_signal(signal.SIGCONT)
            new_master = servers.wait_promoted(old_port)
            promoted_s = time.monotonic() - killed_at
            servers.rejoin(old_port)
            status = produce.finish(240)
            took_s = time.monotonic() - killed_at
            client = redis.Redis(host=new_master[0], port=new_master[1])
            counts = Counter((r["task_id"], r["id"]) for _, r in stream(client))
            log = worker.log()
    resent = [line for line in produce.stderr.splitlines() if "re-sent" in line]
    print(f"\n[failover mid-send] {held} of {n} messages taken before the kill; promoted {promoted_s:.1f} s after it; "
          f"producer exit {status} {took_s:.1f} s after it; {statuses(out)}; stream entries on the new master "
          f"{sum(counts.values())} for {len(counts)} tickets; {resent}")  # fmt: skip
    assert status == 0, produce.stdout[-3000:] + produce.stderr[-3000:]
    assert "lost Redis while sending" in produce.stderr and "Redis is back" in produce.stderr
    assert statuses(out) == {"ok": n}
    assert len(counts) == n and set(counts.values()) == {1}, "every ticket answered once"
    assert "Unrecoverable error" not in log


def test_the_gateway_pushes_through_sentinel_to_the_master(tmp_path):
    """The gateway's POST goes through its own asyncio client (`ticketq.aioredis`), on the master the
    sentinels name: the tickets and their records land there, the replica confirms them
    (TICKETQ_REPLICA_ACKS=1, WAIT on that client), and a GET reads them back."""
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    require_redis_server()
    with sentinel_set(tmp_path / "redis") as servers:
        settings = GatewaySettings(broker_url=servers.url, sentinel_master=MASTER_NAME, queue="gw-sentinel",
                                   gateway_anonymous=True, replica_acks=1)  # fmt: skip
        with TestClient(create_app(settings)) as client:
            answer = client.post("/v1/tickets", json=[{"id": f"s{n}", "text": "my invoice is wrong"} for n in range(3)])
            assert answer.status_code == 202, answer.text
            assert client.get("/v1/tickets/s1").json()["status"] == "pending"
        assert servers.primary.client().llen("gw-sentinel") == 1  # one packed message
