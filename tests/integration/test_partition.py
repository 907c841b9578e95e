"""A worker cut off from Redis by a network partition longer than its lease, then healed.

The worker runs in a network namespace of its own, joined to the host by a veth pair; the test
takes the host's end of the link down for longer than the lease (and than worst_batch_s) and
brings it up again. TCP holds the connections across it: when the link comes back, the cut-off
worker's blocked commands complete, late. Meanwhile a second worker, on the host, recovers its
messages as a dead consumer's and answers them. Then:

- every ticket is answered once (one stream entry each, all `ok`), nothing dead-lettered: the
  returning worker leaves what was taken over to the worker that took it, never fails it;
- its acks of messages it no longer owns are skipped (the lease script checks ownership), so they
  cannot remove the new owner's record;
- both workers log what happened: the lapse and the renewal on one side, the recovery on the other;
- `ticketq_tickets_total` counts each ticket once across the two workers.

Network namespaces need root (CAP_NET_ADMIN) and `ip`: skipped otherwise, with the reason; under
CI (CI=true, where the tests run as root) that fails instead.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections import Counter

import pytest
from faults import DELAY_ENV
from workers import RedisServer, Worker, free_port, skip_or_fail, wait_for, worker_command, worker_env

from producer.api import Producer
from ticketq import names
from ticketq.config import ClientSettings
from ticketq.names import OWNED_KEY

pytestmark = pytest.mark.integration

QUEUE = "partition"
LEASE_S = 3
WORST_BATCH_S = 5
PARTITION_S = 15  # > lease and > worst_batch_s: the second worker takes over, the first gives up publishing
TICKETS = 600


class Namespace:
    """A network namespace joined to the host by a veth pair (/30 from 10.231.x.0)."""

    def __init__(self) -> None:
        tag = os.getpid() % 250
        self.name, self.host_if, self.ns_if = f"tq-part-{tag}", f"tqh{tag}", f"tqn{tag}"
        self.host_ip, self.ns_ip = f"10.231.{tag}.1", f"10.231.{tag}.2"

    def create(self) -> Namespace:
        self.destroy()  # what an earlier, killed run left
        for command in (
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.name],
            ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            self.inside("ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if),
            self.inside("ip", "link", "set", self.ns_if, "up"),
            self.inside("ip", "link", "set", "lo", "up"),
        ):
            subprocess.run(command, check=True, capture_output=True)
        return self

    def inside(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]

    def link(self, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "up" if up else "down"], check=True)

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


def namespace_or_skip() -> Namespace:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        skip_or_fail("the partition test needs root and iproute2 (`ip`) for a network namespace")
    try:
        return Namespace().create()
    except subprocess.CalledProcessError as exc:
        skip_or_fail(f"could not create a network namespace: {exc.stderr.decode(errors='replace').strip()}")
        raise


def test_a_partitioned_worker_leaves_what_was_taken_over(tmp_path):
    ns = namespace_or_skip()
    server = RedisServer(tmp_path, aof=False, args=["--bind", f"127.0.0.1 {ns.host_ip}", "--protected-mode", "no"])
    server.start()
    client = server.client()
    common = {DELAY_ENV: "0.3", "TICKETQ_LEASE_S": str(LEASE_S), "TICKETQ_WORST_BATCH_S": str(WORST_BATCH_S)}
    far_url = f"redis://{ns.host_ip}:{server.port}/0"
    cut_port, near_port = free_port(), free_port()
    cut_env = {**worker_env(None, far_url, QUEUE, **common), "TICKETQ_METRICS_PORT": str(cut_port),
               "TICKETQ_METRICS_HOST": "0.0.0.0"}  # fmt: skip
    near_env = {**worker_env(None, server.url, QUEUE, **common), "TICKETQ_METRICS_PORT": str(near_port)}
    cut = near = None
    producer = Producer(ClientSettings(broker_url=server.url, queue=QUEUE))
    try:
        cut = Worker(cut_env, tmp_path / "cut.log", command=ns.inside(*worker_command(faulty=True)))
        cut.metrics_url = f"http://{ns.ns_ip}:{cut_port}/metrics"
        cut.wait_ready(timeout=120)
        sent = producer.submit_many([f"ticket {n}: my invoice is wrong" for n in range(TICKETS)])
        # Cut once it has answered some (so both workers count tickets) and holds more.
        wait_for(lambda: client.xlen(names.RESULTS_STREAM) >= 64 and _owned(client) >= 20, 60,
                 "the first worker answering, and holding messages")  # fmt: skip
        held = _owned(client)
        ns.link(up=False)
        cut_at = time.monotonic()
        near = Worker(near_env, tmp_path / "near.log", command=worker_command(faulty=True))
        near.wait_ready(timeout=120)
        near.wait_log("(lease expired)", PARTITION_S, "the second worker recovering the cut-off one's messages")
        taken_s = time.monotonic() - cut_at
        time.sleep(max(0.0, PARTITION_S - (time.monotonic() - cut_at)))  # the partition lasts this long
        ns.link(up=True)
        results = producer.wait(sent, timeout=120)
        cut.wait_log("renewed after", 60, "the cut-off worker renewing its lease")
        wait_for(lambda: _settled(client), 60, "every message acked, nothing in flight")
        totals = [_tickets_total(worker) for worker in (cut, near)]
        entries = [json.loads(fields[b"data"]) for _, fields in client.xrange(names.RESULTS_STREAM)]
        dead = client.xlen(names.DEAD_LETTER_STREAM)
    finally:
        producer.close()
        for worker in (cut, near):
            if worker is not None:
                worker.stop(timeout=30)
        server.kill()
        ns.destroy()

    counts = Counter(entry["task_id"] for entry in entries)
    logs = {"cut": cut.log(), "near": near.log()}
    print(f"\n[partition] {TICKETS} tickets; the first worker held {held} when cut off for {PARTITION_S}s "
          f"(lease {LEASE_S}s); taken over {taken_s:.1f}s after the cut; tickets counted {totals}; "
          f"dead letters {dead}; stream entries {len(entries)}")  # fmt: skip
    assert [r["status"] for r in results] == ["ok"] * TICKETS, Counter(r["status"] for r in results)
    assert len(counts) == TICKETS and set(counts.values()) == {1}, "every ticket answered once"
    assert dead == 0, "nothing failed: what was taken over is the taker's to answer"
    assert sum(totals) == TICKETS, f"each ticket counted once across the workers: {totals}"
    # Whether its open batch gave up publishing ("not failing ... another worker took over") or
    # finished after the heal (its results repeats, not counted) depends on where the cut lands.
    for said in ("lapsed: not renewed for", "renewed after", "no longer this consumer's"):
        assert said in logs["cut"], f"the cut-off worker saying {said!r}:\n{logs['cut'][-4000:]}"
    assert "(lease expired)" in logs["near"]
    for name, log in logs.items():
        assert "Traceback" not in log and "worker_error" not in log, f"{name}:\n{log[-4000:]}"


def _owned(client) -> int:
    return sum(client.scard(key) for key in client.scan_iter(OWNED_KEY.format(consumer="*")))


def _settled(client) -> bool:
    return client.llen(QUEUE) == 0 and client.hlen("unacked") == 0


def _tickets_total(worker: Worker) -> float:
    return sum(value for key, value in worker.metrics().items() if key.startswith("ticketq_tickets_total"))
