"""Chaos run: steady load through Sentinel-managed Redis while a seeded nemesis breaks things.

    sudo .venv/bin/python docs/bench/chaos.py [--minutes 20] [--workers 2] [--seed 0] [--load 0.8] \\
        [--classifier tiny|null] [--model DIR] [--kills N] [--each N] [--cli-share 0.25] \\
        [--worker-env TICKETQ_NAME=VALUE ...]

Jepsen's nemesis on our own servers, on 127.0.0.1 and a network namespace of its own. It starts a
primary and a replica (AOF, appendfsync always) and three sentinels (tests/servers.py), `--workers`
real `ticketq worker` processes on the tiny stand-in or the null classifier (tests/workers.py):
worker 0 inside a network namespace joined to the host by a veth pair (as
tests/integration/test_partition.py does), the last worker through a fault-injecting TCP proxy
(tests/support/proxy.py) that connects each new connection to the master the sentinels name. Then:

1. **Capacity**: `--capacity-s` seconds with the queue kept full; answers per second after a
   warm-up of a sixth of it.
2. **Load and nemesis** for `--minutes`: `--producers` threads send (1 - `--cli-share`) of `--load`
   x capacity tickets/s between them (the Python `Producer`, idempotent task ids, a refused send
   tried again under the same id), each waiting with `wait(resend_after=--resend-after)`; every
   `--chunk-s` a `ticketq-produce file --out --retry-for --resend-after` process sends the rest (a
   run that exits non-zero is run again with `--resume`, as its message says, up to 3 times).
   Meanwhile the schedule, drawn from `--seed` and printed up front: `--kills` kill -9 of a random
   worker, each restarted at once; and `--each` of every other kind: a Sentinel failover (kill -9
   of the primary, restarted as a replica of the promoted one); a full Redis (CONFIG SET maxmemory
   just above what is used, noeviction, for 10-20 s); worker 0's link down for 1.5-3 leases; a
   SIGSTOP of a worker for 2-4 leases; an AOF restart of the primary (kill -9, started again at
   once on its AOF); a SIGSTOP across that restart (SIGSTOP a worker, restart the primary,
   SIGCONT 10-20 s after the SIGSTOP); and the half-open connection twice over: the proxy drops
   the reply to one `BLMOVE` that moved a ticket (`lost-fetch`), or to one `claim` script
   (`lost-claim`), and that connection stays open, silent both ways. Events run one after
   another, each printed as it happens, with its takeover time where it has one.
3. **Drain** for up to `--drain-s`, then the tally, from the producers' answers, the
   `ticketq-produce` runs' --out rows and the results stream: sent, answered, lost (sent, with no
   answer to its producer or no stream entry), duplicated (a (task, slot) with more than one stream
   entry: docs/reliability.md's "published once per (task, slot)"), **worker exits** (a worker
   that ended without being killed by the nemesis: recorded with its exit status, and restarted),
   each worker's exit status after the final SIGTERM, the `ticketq-produce` exit statuses and
   --out rows, re-sends, refused sends, the largest queue depth.

The workers run with the worker's defaults (the live cost model included), whatever TICKETQ_*
this shell has: settings reach them through `--worker-env` (and `--lease-s`). Exit status 0 only
when nothing was lost or duplicated and no worker exited; 1 otherwise; 130 on Ctrl-C. Every
server, worker and producer process is killed on exit (Ctrl-C and SIGTERM too); a SIGKILL of this
script leaves them running. The partition needs root and iproute2 (`ip netns`); without them it is
left out of the schedule and worker 0 runs on the host. Worker logs, the Redis directories, the
`ticketq-produce` files (`produce/`) and the run's own log (`chaos.log`: the producers' warnings)
stay in `--dir`.

Costs: the run takes `--capacity-s` + `--minutes` + the drain (at most `--drain-s`), plus each
worker's start-up; it loads every core (workers, producers and Redis share the machine).
Findings: docs/reliability.md, "Chaos run".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The test harness is reused as it is: tests/ on sys.path for servers.py, workers.py and
# test_partition.py (the helpers stay where the tests keep them).
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support"), str(ROOT / "tests" / "integration")]

import redis  # noqa: E402
from proxy import RedisProxy, command_is  # noqa: E402
from servers import MASTER_NAME, SentinelServer, SentinelSet, require_redis_server  # noqa: E402
from test_partition import Namespace  # noqa: E402
from workers import RedisServer, Worker, wait_for, worker_env  # noqa: E402

from producer.api import Producer  # noqa: E402
from producer.messages import TicketResult  # noqa: E402
from producer.synthetic import generate_tickets  # noqa: E402
from ticketq import names  # noqa: E402
from ticketq.config import ClientSettings  # noqa: E402
from ticketq.names import DEAD_LETTER_STREAM, RESULTS_STREAM  # noqa: E402
from ticketq_bench.procs import WORKER_COMMAND  # noqa: E402
from worker.settings import Settings  # noqa: E402

QUEUE = "chaos"
READY_TIMEOUT_S = 240  # a worker's start-up on a loaded machine, tiny stand-in included
PROMOTION_TIMEOUT_S = 120  # Sentinel's promotion; a sentinel in TILT (a stalled timer) waits 30 s more
STREAM_MAXLEN = 10_000_000  # the tally reads every entry: no trimming during a run
TOP_UP = 200  # capacity phase: tickets sent whenever the queue holds fewer
SEND_CHUNK = 500  # tickets per submit_many at most (one Redis pipeline)
BATCH_S = 5.0  # a producer waits on what it sent in each such period as one batch
MAX_WAITS = 8  # waits running at once per producer
MEMORY_HEADROOM = 1 << 20  # maxmemory = used + this: the next megabyte of traffic fills it
PROGRESS_EVERY_S = 30
MAX_RESUMES = 3  # a ticketq-produce run that failed is run again with --resume this often at most,
RESUME_AFTER_S = 15.0  # after this pause, doubling: an operator resumes once the cause has passed
# what the workers log about a partition (docs/reliability.md, "A partition")
LAPSED, RENEWED, RECOVERED = "lapsed: not renewed for", "renewed after", "(lease expired)"
RESULT_KEY = "celery-task-meta-{task_id}"  # the Celery backend's result of a task
REPLY_TIMEOUT_S = 60  # a half-open event waits this long for a reply of its kind to drop
TAKEOVER_TIMEOUT_S = 180  # and this long for the ticket of the dropped reply to be answered
log = logging.getLogger("chaos")


# ----- servers, the namespace, the workers ---------------------------------------------------


class ChaosNamespace(Namespace):
    """tests/integration/test_partition.py's namespace, under names (tq-chaos-*, 10.232.x) no test uses."""

    def __init__(self) -> None:
        tag = os.getpid() % 250
        self.name, self.host_if, self.ns_if = f"tq-chaos-{tag}", f"tqch{tag}", f"tqcn{tag}"
        self.host_ip, self.ns_ip = f"10.232.{tag}.1", f"10.232.{tag}.2"


class HostSentinel(SentinelServer):
    """A sentinel that listens on, and knows the master at, `host` as well as 127.0.0.1."""

    def __init__(self, workdir: Path, master_port: int, port: int, host: str) -> None:
        super().__init__(workdir, master_port, port)
        self.master_host, self.listen = host, f"bind {binds(host)}\nprotected-mode no\n"


def binds(host: str) -> str:
    return "127.0.0.1" if host == "127.0.0.1" else f"127.0.0.1 {host}"


class ChaosServers(SentinelSet):
    """tests/servers.py's primary, replica and three sentinels, every address `host` (the host's
    end of the veth pair, or 127.0.0.1), so that a worker inside the namespace can follow the
    master too. A failed primary rejoins keeping that address."""

    def __init__(self, workdir: Path, host: str) -> None:
        super().__init__(workdir)
        self.host = host
        self.primary.args = self.listen_args()
        self.replica.args = ["--replicaof", host, str(self.primary.port), *self.listen_args()]
        self.sentinels = [HostSentinel(s.workdir, self.primary.port, s.port, host) for s in self.sentinels]

    def listen_args(self) -> list[str]:
        return ["--bind", binds(self.host), "--protected-mode", "no", "--replica-announce-ip", self.host,
                "--maxmemory-policy", "noeviction"]  # fmt: skip

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://{self.host}:{sentinel.port}" for sentinel in self.sentinels)

    def rejoin(self, port: int) -> RedisServer:
        host, master_port = self.master_address()
        server = self.server_on(port)
        server.args = ["--replicaof", host, str(master_port), *self.listen_args()]
        server.start()
        wait_for(lambda: server.client().info("replication").get("master_link_status") == "up", 60,
                 f"the node on port {port} replicating from the new master", interval=0.1)  # fmt: skip
        return server


class Fleet:
    """The workers: slot 0 inside the namespace when there is one, the last slot (when it is not
    slot 0 in the namespace) behind `proxy`, a fault-injecting TCP proxy to whichever node the
    sentinels name master; `restart(i)` after a kill. `watch` restarts a worker that exited
    without being killed, and records its exit: `exits` (the target: none)."""

    def __init__(self, args: argparse.Namespace, url: str, model: Path | None, ns: Namespace | None, rundir: Path,
                 proxy: RedisProxy | None = None):  # fmt: skip
        self.args, self.url, self.model, self.ns, self.rundir = args, url, model, ns, rundir
        self.workers: list[Worker] = []
        self.starts = Counter()
        self.proxy = proxy
        last = args.workers - 1
        self.proxied = last if proxy is not None and (last > 0 or ns is None) else None
        self.exits: list[tuple[int, int, int | None, float]] = []  # (slot, pid, exit status, t+) unasked for
        self.final: dict[int, int | None] = {}  # slot -> exit status after the run's SIGTERM
        self.expected: set[int] = set()  # slots being killed and restarted on purpose
        self.lock = threading.Lock()

    def env(self, slot: int) -> dict[str, str]:
        extra = {"TICKETQ_SENTINEL_MASTER": MASTER_NAME, "TICKETQ_STREAM_MAXLEN": str(STREAM_MAXLEN)}
        url = self.url
        if slot == self.proxied:
            url = f"redis://127.0.0.1:{self.proxy.port}/0"  # the proxy follows the master for it
            del extra["TICKETQ_SENTINEL_MASTER"]
        if self.args.lease_s is not None:
            extra["TICKETQ_LEASE_S"] = str(self.args.lease_s)
        if self.args.classifier == "null":
            extra["TICKETQ_NULL_CLASSIFIER"] = "1"
        if slot == 0 and self.ns is not None:
            extra["TICKETQ_METRICS_HOST"] = "0.0.0.0"  # scraped from the host over the veth pair
        extra.update(pair.split("=", 1) for pair in self.args.worker_env)
        return worker_env(self.model, url, QUEUE, **extra)

    def spawn(self, slot: int) -> Worker:
        self.starts[slot] += 1
        log_path = self.rundir / f"worker-{slot}.{self.starts[slot]}.log"
        inside = slot == 0 and self.ns is not None
        command = self.ns.inside(*WORKER_COMMAND) if inside else list(WORKER_COMMAND)
        worker = Worker(self.env(slot), log_path, command=command)
        if inside:
            worker.metrics_url = f"http://{self.ns.ns_ip}:{worker.metrics_port}/metrics"
        return worker

    def start_all(self) -> None:
        self.workers = [self.spawn(slot) for slot in range(self.args.workers)]
        for worker in self.workers:
            worker.wait_ready(READY_TIMEOUT_S)

    def restart(self, slot: int) -> Worker:
        self.workers[slot] = self.spawn(slot)
        self.workers[slot].wait_ready(READY_TIMEOUT_S)
        return self.workers[slot]

    def logs(self) -> list[str]:
        return [path.read_text(errors="replace") for path in sorted(self.rundir.glob("worker-*.log"))]

    def expect(self, slot: int, on: bool) -> None:
        """Mark `slot` as being killed (or restarted) on purpose, or no longer."""
        with self.lock:
            (self.expected.add if on else self.expected.discard)(slot)

    def watch(self, stop: threading.Event, clock: Callable[[], float]) -> None:
        """Every 0.5 s until `stop`: a worker that exited unasked is recorded and restarted."""
        while not stop.wait(0.5):
            for slot in range(len(self.workers)):
                with self.lock:
                    worker = self.workers[slot]
                    if slot in self.expected or worker.proc.poll() is None:
                        continue
                    self.expected.add(slot)
                self.exits.append((slot, worker.pid, worker.proc.returncode, clock()))
                say(clock(), f"WORKER EXIT: worker {slot} (pid {worker.pid}) exited with status "
                    f"{worker.proc.returncode} (log {worker.log_path.name}); restarting it")  # fmt: skip
                try:
                    self.restart(slot)
                except Exception as exc:  # it exited again while starting: the next round sees it
                    say(clock(), f"worker {slot} restart failed: {str(exc)[:200]}")
                finally:
                    self.expect(slot, False)

    def stop_all(self) -> None:
        """SIGTERM to every worker (Celery's warm shutdown), each exit status recorded."""
        with self.lock:
            self.expected.update(range(len(self.workers)))
        for slot, worker in enumerate(self.workers):
            worker.proc.send_signal(signal.SIGCONT)  # a stopped worker would not see the SIGTERM
            self.final[slot] = worker.stop(signal.SIGTERM, timeout=60)

    def kill_all(self) -> None:
        with self.lock:
            self.expected.update(range(len(self.workers)))
        for worker in self.workers:
            worker.proc.send_signal(signal.SIGCONT)
            worker.stop(signal.SIGKILL, timeout=10)


# ----- the schedule -------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    at_s: float  # seconds after the load started
    kind: str  # one of KINDS
    worker: int = 0
    hold_s: float = 0.0  # how long a partition or a full Redis lasts

    def describe(self) -> str:
        return {
            "kill": f"kill -9 worker {self.worker}, restart it",
            "failover": "kill -9 the primary (Sentinel failover), restart it as a replica",
            "partition": f"cut worker 0 off from Redis for {self.hold_s:.0f} s (link down), then heal",
            "memory": f"maxmemory just above used (noeviction) for {self.hold_s:.0f} s, then restore",
            "sigstop": f"SIGSTOP worker {self.worker} for {self.hold_s:.0f} s, then SIGCONT",
            "restart": "kill -9 the primary and restart it at once on its AOF (no failover if it is back in 2 s)",
            "stop-restart": f"SIGSTOP worker {self.worker}, kill -9 and AOF restart of the primary, SIGCONT "
            f"{self.hold_s:.0f} s after the SIGSTOP",
            "lost-fetch": "drop the reply to one BLMOVE that moved a ticket, on the proxied worker's connection "
            "(which stays half-open)",
            "lost-claim": "drop the reply to one claim script of the proxied worker (its connection stays half-open)",
        }[self.kind]


KINDS = ("kill", "failover", "memory", "partition", "sigstop", "restart", "stop-restart", "lost-fetch", "lost-claim")


def hold_for(rng: random.Random, kind: str, lease_s: float) -> float:
    if kind == "partition":
        return rng.uniform(1.5, 3.0) * lease_s
    if kind == "sigstop":
        return rng.uniform(2.0, 4.0) * lease_s
    if kind in ("memory", "stop-restart"):
        return rng.uniform(10, 20)
    return 0.0


def schedule(rng: random.Random, run_s: float, counts: dict[str, int], workers: int, lease_s: float) -> list[Event]:
    """`counts[kind]` events of each kind, in a seeded order, each at a seeded time within its own
    share of 5-85% of the run; SIGSTOPs and kills of a seeded worker."""
    kinds = [kind for kind in KINDS for _ in range(counts.get(kind, 0))]
    rng.shuffle(kinds)
    start, width = 0.05 * run_s, 0.80 * run_s / max(1, len(kinds))
    events = []
    for index, kind in enumerate(kinds):
        at = start + index * width + rng.uniform(0, 0.5 * width)
        events.append(Event(round(at, 1), kind, rng.randrange(workers), round(hold_for(rng, kind, lease_s), 1)))
    return events


# ----- producers ----------------------------------------------------------------------------


@dataclass
class Ledger:
    """What the producers sent and what they were answered, shared by their threads."""

    sent: dict[str, str] = field(default_factory=dict)  # ticket id -> task id of its confirmed send
    answers: dict[str, dict] = field(default_factory=dict)  # ticket id -> its first answer
    answered_again: int = 0  # answers a producer got for a ticket it had an answer for
    refused: Counter = field(default_factory=Counter)  # why submit_many calls failed (each tried again)
    refused_tickets: int = 0  # the tickets in those calls
    wait_errors: Counter = field(default_factory=Counter)
    resent: int = 0  # messages wait(resend_after) sent again
    unsent: int = 0  # tickets whose send never went through before the load stopped
    lock: threading.Lock = field(default_factory=threading.Lock)

    def outstanding(self) -> int:
        with self.lock:
            return len(self.sent) - len(self.answers)


def reason(exc: BaseException) -> str:
    text = str(exc)
    for known in ("out of memory", "not reachable", "not enough replicas"):
        if known in text:
            return known
    return f"{type(exc).__name__}: {text[:80]}"


class Load:
    """One producer: a sender thread offering `rate` tickets/s (open loop: a send that is late or
    refused does not slow the schedule, the next sends catch up), and a dispatcher that hands the
    tickets sent in each BATCH_S to a waiter thread of their own: `wait(batch, resend_after=...)`
    until every one is answered or the run's deadline, as an application waits on what it sent.
    At most MAX_WAITS waits run at once per producer; while they do, new tickets gather into one
    larger batch. Cost: each wait polls one MGET of up to 400 result keys every 5-100 ms."""

    def __init__(self, number: int, settings: ClientSettings, rate: float, texts: list[str], ledger: Ledger,
                 args: argparse.Namespace, deadline: float) -> None:  # fmt: skip
        self.number, self.rate, self.texts, self.ledger, self.args = number, rate, texts, ledger, args
        self.sender, self.waiter = Producer(settings), Producer(settings)
        self._count_resends(self.waiter)
        self.fresh: list[TicketResult] = []
        self.stop, self.sent_all = threading.Event(), threading.Event()
        self.deadline = deadline  # no wait goes past it: the load's end plus the drain
        self.threads = [threading.Thread(target=target, daemon=True, name=f"chaos-{name}-{number}")
                        for name, target in (("send", self.send_loop), ("wait", self.wait_loop))]  # fmt: skip

    def _count_resends(self, producer: Producer) -> None:
        """Every message the waiter publishes is a re-send (the sender sends the first copies):
        counted where `wait` publishes it, whatever its log says."""
        sender = producer._sender  # the waiter's re-sends go through its producer's sender
        publish = sender.publish

        def counted(*args, **kwargs):
            result = publish(*args, **kwargs)
            with self.ledger.lock:
                self.ledger.resent += 1
            return result

        sender.publish = counted

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def send_loop(self) -> None:
        try:
            start, count = time.monotonic(), 0
            while not self.stop.is_set():
                due = min(SEND_CHUNK, int(self.rate * (time.monotonic() - start)) - count)
                if due <= 0:
                    self.stop.wait(0.05)
                    continue
                ids = [f"chaos-{self.args.seed}-{self.number}-{count + i}" for i in range(due)]
                texts = [self.texts[(count + i) % len(self.texts)] for i in range(due)]
                results = self.send([{"id": i, "text": t} for i, t in zip(ids, texts, strict=True)])
                if results is None:
                    with self.ledger.lock:
                        self.ledger.unsent += due
                    break
                with self.ledger.lock:
                    self.ledger.sent.update((r.ticket_ids[0], r.id) for r in results)
                    self.fresh.extend(results)
                count += due
        finally:
            self.sent_all.set()

    def send(self, tickets: list[dict]) -> list[TicketResult] | None:
        """Until Redis takes them (the same task ids each try: one answer whatever came of a failed
        try), pausing 0.1 s doubling to 2 s; None once the load stops first."""
        pause = 0.1
        while not self.stop.is_set():
            try:
                return self.sender.submit_many(tickets, idempotent=True)
            except Exception as exc:  # every failure of a send is counted and tried again
                with self.ledger.lock:
                    self.ledger.refused[reason(exc)] += 1
                    self.ledger.refused_tickets += len(tickets)
                self.stop.wait(pause)
                pause = min(2 * pause, 2.0)
        return None

    def record(self, rows: list[dict]) -> None:
        with self.ledger.lock:
            for row in rows:
                if row["id"] in self.ledger.answers:
                    self.ledger.answered_again += 1
                self.ledger.answers.setdefault(row["id"], row)

    def wait_loop(self) -> None:
        waits: list[threading.Thread] = []
        while time.monotonic() < self.deadline:
            waits = [thread for thread in waits if thread.is_alive()]
            finished = self.sent_all.is_set()  # read first: a batch taken after it holds every last send
            with self.ledger.lock:
                batch, self.fresh = (self.fresh, []) if len(waits) < MAX_WAITS else ([], self.fresh)
                left = bool(self.fresh)  # every wait busy: these wait for a free one, even after the last send
            if batch:
                waits.append(threading.Thread(target=self.wait_batch, args=(batch,), daemon=True,
                                              name=f"chaos-wait-{self.number}-{len(batch)}"))  # fmt: skip
                waits[-1].start()
            elif finished and not left:
                break
            time.sleep(BATCH_S)
        for thread in waits:
            thread.join(timeout=max(0.0, self.deadline - time.monotonic()) + 30)

    def wait_batch(self, batch: list[TicketResult]) -> None:
        """Waits on `batch` until answered; a wait that raised is counted and started again."""
        pending = batch
        while pending and time.monotonic() < self.deadline:
            try:
                self.waiter.wait(pending, timeout=self.deadline - time.monotonic(),
                                 resend_after=self.args.resend_after, on_result=self.record)  # fmt: skip
            except Exception as exc:  # counted; asked again
                with self.ledger.lock:
                    self.ledger.wait_errors[reason(exc)] += 1
                time.sleep(1.0)
            with self.ledger.lock:
                pending = [result for result in pending if result.ticket_ids[0] not in self.ledger.answers]

    def close(self) -> None:
        for producer in (self.sender, self.waiter):
            producer.close()


class Chunks(threading.Thread):
    """The command-line producer as an application runs it: every `--chunk-s` seconds a
    `ticketq-produce file CHUNK --out ROWS --retry-for --resend-after` process for that period's
    share (`--cli-share`) of the offered rate, through the sentinels. A run that exits non-zero
    (a Redis that refused the send: full, say) is run again with `--resume`, as its own message
    says to, RESUME_AFTER_S later (doubling), up to MAX_RESUMES times. Every run's exit status and
    each chunk's --out rows are tallied: 0 and an answered row for every ticket are the target."""

    def __init__(self, settings_url: str, rate: float, texts: list[str], ledger: Ledger, args: argparse.Namespace,
                 deadline: float, rundir: Path) -> None:  # fmt: skip
        super().__init__(daemon=True, name="chaos-chunks")
        self.url, self.rate, self.texts, self.ledger, self.args = settings_url, rate, texts, ledger, args
        self.deadline, self.dir = deadline, rundir / "produce"
        self.dir.mkdir(exist_ok=True)
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.running: dict[int, subprocess.Popen] = {}  # chunk -> its current run
        self.codes: dict[int, list[int | None]] = {}  # chunk -> the exit status of each of its runs
        self.ids: dict[int, list[str]] = {}  # chunk -> its ticket ids
        self.resumes: dict[int, float] = {}  # chunk -> when its failed run is resumed

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
        return {**env, "TICKETQ_BROKER_URL": self.url, "TICKETQ_SENTINEL_MASTER": MASTER_NAME,
                "TICKETQ_QUEUE": QUEUE, "PYTHONPATH": str(ROOT)}  # fmt: skip

    def run(self) -> None:
        size, number = max(1, round(self.rate * self.args.chunk_s)), 0
        next_chunk = time.monotonic()
        while not self.stop.wait(1.0 if number else 0):
            if time.monotonic() >= next_chunk:
                self.write(number, size)
                self.launch(number, resume=False)
                number, next_chunk = number + 1, next_chunk + self.args.chunk_s
            self.reap()
            self.resume()

    def write(self, number: int, size: int) -> None:
        ids = [f"chaos-{self.args.seed}-cli-{number}-{i}" for i in range(size)]
        rows = (
            json.dumps({"id": t, "text": self.texts[(number * size + i) % len(self.texts)]}) for i, t in enumerate(ids)
        )
        (self.dir / f"chunk-{number}.jsonl").write_text("".join(f"{row}\n" for row in rows))
        self.ids[number], self.codes[number] = ids, []

    def launch(self, number: int, resume: bool) -> None:
        timeout = max(60.0, self.deadline - time.monotonic())
        command = [sys.executable, "-m", "producer.cli", "file", str(self.dir / f"chunk-{number}.jsonl"),
                   "--out", str(self.out(number)), "--retry-for", f"{self.args.retry_for:g}",
                   "--resend-after", f"{self.args.resend_after:g}", "--timeout", f"{timeout:.0f}", "--no-progress",
                   *(["--resume"] if resume else [])]  # fmt: skip
        with (self.dir / f"chunk-{number}.log").open("ab") as log:
            proc = subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT)
        with self.lock:
            self.running[number] = proc

    def out(self, number: int) -> Path:
        return self.dir / f"chunk-{number}.out.jsonl"

    def reap(self) -> None:
        """Records each ended run; one that failed is resumed while it may be and time is left."""
        with self.lock:
            ended = [(number, proc) for number, proc in self.running.items() if proc.poll() is not None]
            for number, proc in ended:
                del self.running[number]
                self.codes[number].append(proc.returncode)
        for number, proc in ended:
            if proc.returncode != 0 and len(self.codes[number]) <= MAX_RESUMES:
                self.resumes[number] = time.monotonic() + RESUME_AFTER_S * 2 ** (len(self.codes[number]) - 1)

    def resume(self) -> None:
        for number, due in list(self.resumes.items()):
            if time.monotonic() >= due:
                del self.resumes[number]
                if time.monotonic() < self.deadline:
                    self.launch(number, resume=True)

    def finish(self) -> None:
        """Until every chunk's last run has ended (the deadline and a minute more, then SIGTERM)."""
        self.stop.set()
        self.join()
        while (self.running or self.resumes) and time.monotonic() < self.deadline + 60:
            self.reap()
            self.resume()
            time.sleep(1.0)
        self.kill(signal.SIGTERM)
        time.sleep(5)
        self.reap()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with self.lock:
            for proc in self.running.values():
                if proc.poll() is None:
                    proc.send_signal(sig)

    def rows(self, number: int) -> list[dict]:
        try:
            return [json.loads(line) for line in self.out(number).read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            return []

    def tally(self) -> tuple[set[str], list[str]]:
        """The CLI tickets with no answered row, and the lines saying so."""
        codes, firsts, rows_total, statuses, unanswered, notes = Counter(), Counter(), 0, Counter(), set(), []
        for number, ids in sorted(self.ids.items()):
            runs = self.codes[number]
            codes.update(runs)
            firsts[runs[0] if runs else "running"] += 1
            rows = self.rows(number)
            rows_total += len(rows)
            statuses.update(row.get("status") for row in rows)
            unanswered |= set(ids) - {row.get("id") for row in rows if row.get("status") == "ok"}
            if len(rows) != len(ids) or runs != [0]:
                notes.append(f"chunk {number}: exit statuses {runs}, {len(rows)} rows for {len(ids)} tickets")
        tickets = sum(len(ids) for ids in self.ids.values())
        lines = [
            f"command-line producers: {len(self.ids)} chunks, {sum(codes.values())} runs; first runs' exit statuses "
            f"{dict(firsts)}, every run's {dict(codes)}; {tickets} tickets, --out rows {rows_total} {dict(statuses)}; "
            f"tickets without an answered row {len(unanswered)}"
        ]
        return unanswered, lines + [f"  {note}" for note in notes[:12]]

    def tickets(self) -> set[str]:
        return {ticket for ids in self.ids.values() for ticket in ids}


# ----- watching ------------------------------------------------------------------------------


class Monitor(threading.Thread):
    """Samples the queue, the unacked record and the outstanding tickets every 0.5 s; prints a
    progress line every PROGRESS_EVERY_S."""

    def __init__(self, settings: ClientSettings, ledger: Ledger, clock: Callable[[], float]) -> None:
        super().__init__(daemon=True, name="chaos-monitor")
        self.producer, self.ledger, self.clock = Producer(settings), ledger, clock
        self.max_depth = self.max_messages = self.max_outstanding = 0
        self.stop = threading.Event()

    def sample(self) -> tuple[int, int] | None:
        try:
            depth = self.producer.queue_depth()
            return depth, depth + self.producer.redis.hlen("unacked")
        except Exception:  # Redis away (a failover, a full Redis): no sample
            return None

    def run(self) -> None:
        next_line = PROGRESS_EVERY_S
        while not self.stop.wait(0.5):
            sample, outstanding = self.sample(), self.ledger.outstanding()
            self.max_outstanding = max(self.max_outstanding, outstanding)
            if sample:
                self.max_depth, self.max_messages = max(self.max_depth, sample[0]), max(self.max_messages, sample[1])
            if self.clock() >= next_line:
                next_line += PROGRESS_EVERY_S
                say(self.clock(), f"progress: {self.state(sample)}")

    def state(self, sample: tuple[int, int] | None = None) -> str:
        sample = sample or self.sample()
        with self.ledger.lock:
            sent, answered, resent = len(self.ledger.sent), len(self.ledger.answers), self.ledger.resent
            refused = self.ledger.refused_tickets
        depth = f"queue {sample[0]}, in Redis {sample[1]}" if sample else "Redis not answering"
        return (f"sent {sent}, answered {answered}, outstanding {sent - answered}, {depth}, re-sent {resent}, "
                f"refused sends {refused}, load average {os.getloadavg()[0]:.1f}")  # fmt: skip


def flatten(value: object) -> list[bytes]:
    """Every bytes in a nested RESP value."""
    if isinstance(value, bytes):
        return [value]
    if isinstance(value, list):
        return [part for item in value for part in flatten(item)]
    return []


def task_ids_in(parts: list[bytes]) -> list[str]:
    """The task ids of the kombu messages among `parts` (a fetched message, or a `claim` record:
    [message, exchange, routing key]), found as the `id` of any JSON object's `headers`."""

    def found(value: object) -> list[str]:
        if isinstance(value, dict):
            headers = value.get("headers")
            own = [str(headers["id"])] if isinstance(headers, dict) and headers.get("id") else []
            return own + [task for item in value.values() for task in found(item)]
        if isinstance(value, list):
            return [task for item in value for task in found(item)]
        return []

    tasks = []
    for part in parts:
        try:
            tasks += found(json.loads(part))
        except ValueError:
            continue
    return tasks


def say(at_s: float | None, text: str) -> None:
    stamp = f"t+{at_s:7.1f}s" if at_s is not None else " " * 10
    print(f"{time.strftime('%H:%M:%S')} {stamp}  {text}", flush=True)


# ----- the nemesis ---------------------------------------------------------------------------


class Nemesis(threading.Thread):
    """Plays the schedule, one event after another (a late one starts when the one before ends)."""

    def __init__(self, events: list[Event], servers: ChaosServers, fleet: Fleet, ns: Namespace | None,
                 ledger: Ledger, monitor: Monitor, clock: Callable[[], float]) -> None:  # fmt: skip
        super().__init__(daemon=True, name="chaos-nemesis")
        self.events, self.servers, self.fleet, self.ns = events, servers, fleet, ns
        self.ledger, self.monitor, self.clock = ledger, monitor, clock
        self.stop = threading.Event()
        self.failures: list[str] = []

    def run(self) -> None:
        for event in self.events:
            if self.stop.wait(max(0.0, event.at_s - self.clock())):
                return
            began = self.clock()
            say(began, f"{event.kind}: {event.describe()} [{self.monitor.state()}]")
            try:
                outcome = getattr(self, event.kind.replace("-", "_"))(event)
            except Exception as exc:  # reported; the run goes on and the tally tells
                outcome = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
                self.failures.append(f"{event.kind} at t+{began:.0f}s: {outcome}")
            say(self.clock(), f"{event.kind} done in {self.clock() - began:.1f} s: {outcome}")

    def kill(self, event: Event) -> str:
        self.fleet.expect(event.worker, True)
        try:
            victim = self.fleet.workers[event.worker]
            victim.proc.kill()
            victim.proc.wait()
            killed = time.monotonic()
            worker = self.fleet.restart(event.worker)
            ready_s = time.monotonic() - killed
        finally:
            self.fleet.expect(event.worker, False)
        return f"worker {event.worker} (pid {victim.pid}) killed; pid {worker.pid} ready {ready_s:.1f} s after"

    def failover(self, event: Event) -> str:
        old_port = self.servers.kill_primary()
        killed = time.monotonic()
        _, port = self.servers.wait_promoted(old_port, timeout=PROMOTION_TIMEOUT_S)
        promoted = time.monotonic()
        self.servers.rejoin(old_port)
        return (f"primary :{old_port} killed; :{port} promoted {promoted - killed:.1f} s later; the old primary "
                f"replicating from it {time.monotonic() - promoted:.1f} s after that")  # fmt: skip

    def partition(self, event: Event) -> str:
        cut = self.fleet.workers[0]
        said = {text: cut.log().count(text) for text in (LAPSED, RENEWED)}
        recovered = [w.log().count(RECOVERED) for w in self.fleet.workers]
        self.ns.link(up=False)
        try:
            self.stop.wait(event.hold_s)  # the partition lasts this long (Ctrl-C heals it at once)
        finally:
            self.ns.link(up=True)
        healed = time.monotonic()
        try:
            wait_for(lambda: self.lease_held(cut.pid), 60, "the cut-off worker holding a lease again", interval=0.2)
            back = f"worker 0 holds a lease again {time.monotonic() - healed:.1f} s after the heal"
        except TimeoutError:
            cut.stacks()  # Celery's SIGUSR1 handler writes every thread's stack into its log
            back = f"worker 0 holds NO lease 60 s after the heal (its threads' stacks are in {cut.log_path.name})"
            self.failures.append(f"partition: {back}")
        logged = {text.strip(): cut.log().count(text) - n for text, n in said.items()}
        taken = [w.log().count(RECOVERED) - n for w, n in zip(self.fleet.workers, recovered, strict=True)]
        return f"healed after {event.hold_s:.0f} s; {back}; worker 0 logged {logged}; recoveries per worker {taken}"

    def recoveries(self) -> list[int]:
        return [worker.log().count(RECOVERED) for worker in self.fleet.workers]

    def sigstop(self, event: Event) -> str:
        """SIGSTOP for `hold_s`; the takeover: when another worker first logs a recovery."""
        victim, before = self.fleet.workers[event.worker], self.recoveries()
        victim.proc.send_signal(signal.SIGSTOP)
        stopped, taken = time.monotonic(), None
        try:
            while not self.stop.wait(0.5) and time.monotonic() - stopped < event.hold_s:
                now = self.recoveries()
                if taken is None and any(n > b for i, (n, b) in enumerate(zip(now, before, strict=True))
                                         if i != event.worker):  # fmt: skip
                    taken = time.monotonic() - stopped
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        took = f"its messages taken over {taken:.1f} s after the SIGSTOP" if taken is not None \
            else "no takeover logged (nothing in flight, or later than the hold)"  # fmt: skip
        return f"worker {event.worker} (pid {victim.pid}) stopped {event.hold_s:.0f} s; {took}"

    def restart_primary(self) -> str:
        """kill -9 of the master and its restart on the same port and AOF, as a master."""
        _, port = self.servers.master_address()
        server = self.servers.server_on(port)
        server.kill()
        killed = time.monotonic()
        server.args = self.servers.listen_args()  # it was the master: it comes back as one
        try:
            server.start()
        except TimeoutError:  # a long AOF load: the ping answers LOADING meanwhile
            wait_for(server._pings, 120, f"redis-server on port {port} loading its AOF", interval=0.1)
        back = time.monotonic() - killed
        wait_for(lambda: self.master_port() is not None, PROMOTION_TIMEOUT_S, "a master named", interval=0.1)
        master = self.master_port()
        after = "still the master" if master == port else f"failed over to :{master}"
        return f"primary :{port} kill -9, answering again {back:.1f} s later from its AOF ({after})"

    def master_port(self) -> int | None:
        try:
            _, port = self.servers.master_address()
            client = redis.Redis(host=self.servers.host, port=port, socket_timeout=2)
            return port if client.info("replication").get("role") == "master" else None
        except (redis.RedisError, RuntimeError, OSError):
            return None

    def restart(self, event: Event) -> str:
        return self.restart_primary()

    def stop_restart(self, event: Event) -> str:
        """SIGSTOP a worker, restart the primary under it, SIGCONT; the worker must not exit."""
        victim = self.fleet.workers[event.worker]
        victim.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            self.stop.wait(2.0)
            restarted = self.restart_primary()
            self.stop.wait(max(0.0, event.hold_s - (time.monotonic() - stopped)))
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        self.stop.wait(10.0)
        state = "running" if victim.proc.poll() is None else f"EXITED with {victim.proc.returncode}"
        return (f"worker {event.worker} (pid {victim.pid}) stopped {time.monotonic() - stopped - 10:.0f} s; "
                f"{restarted}; the worker {state} 10 s after the SIGCONT")  # fmt: skip

    def lost_fetch(self, event: Event) -> str:
        return self.lost_reply(command_is("BLMOVE"), "BLMOVE")

    def lost_claim(self, event: Event) -> str:
        return self.lost_reply(command_is("EVAL", b"claim"), "claim script")

    def lost_reply(self, rule: Callable[[list[bytes]], bool], what: str) -> str:
        """The proxy drops the next non-nil reply of this kind; the takeover: until every task of
        the messages that reply (or its command) carried has a result."""
        proxy, slot = self.fleet.proxy, self.fleet.proxied
        proxy.drop_reply(rule)
        if not proxy.dropped.wait(REPLY_TIMEOUT_S):
            proxy.drop_reply(None)
            return f"no {what} reply to drop within {REPLY_TIMEOUT_S} s"
        dropped = time.monotonic()
        tasks = set(task_ids_in(flatten([proxy.dropped_command, proxy.dropped_reply])))
        said = self.fleet.workers[slot].log().count("never came")
        try:
            wait_for(lambda: self.answered(tasks), TAKEOVER_TIMEOUT_S, "the dropped reply's tickets", interval=0.2)
            took = f"its {len(tasks)} task(s) answered {time.monotonic() - dropped:.1f} s after the drop"
        except TimeoutError:
            took = f"its {len(tasks)} task(s) NOT answered {TAKEOVER_TIMEOUT_S} s after the drop"
            self.failures.append(f"{what} dropped: {took}")
        logged = self.fleet.workers[slot].log().count("never came") - said
        return f"{what} reply dropped on worker {slot}'s connection; {took}; 'never came' logged {logged}"

    def answered(self, tasks: set[str]) -> bool:
        try:
            client = self.servers.master_client()
            return client.exists(*(RESULT_KEY.format(task_id=task) for task in tasks)) == len(tasks) if tasks else True
        except (redis.RedisError, RuntimeError):
            return False

    def lease_held(self, pid: int) -> bool:
        """A consumer of process `pid` has a live lease on the current master."""
        client = self.servers.master_client()
        try:
            consumers = client.hgetall(names.CONSUMERS_KEY)
            mine = [name.decode() for name, info in consumers.items() if json.loads(info).get("pid") == pid]
            return any(client.exists(names.ALIVE_KEY.format(consumer=name)) for name in mine)
        except redis.RedisError:
            return False
        finally:
            client.close()

    def memory(self, event: Event) -> str:
        client = self.servers.master_client()
        limit = client.config_get("maxmemory")["maxmemory"]
        used = int(client.info("memory")["used_memory"])
        refused_before = self.ledger.refused["out of memory"]
        full_before = sum(text.count("Redis is full") for text in self.fleet.logs())
        client.config_set("maxmemory", used + MEMORY_HEADROOM)
        try:
            self.stop.wait(event.hold_s)
        finally:
            self.servers.master_client().config_set("maxmemory", limit)
        refused = self.ledger.refused["out of memory"] - refused_before
        full = sum(text.count("Redis is full") for text in self.fleet.logs()) - full_before
        return (f"maxmemory {(used + MEMORY_HEADROOM) / 2**20:.1f} MB for {event.hold_s:.0f} s, back to {limit}; "
                f"sends refused meanwhile {refused} tickets; 'Redis is full' in worker logs {full}")  # fmt: skip


# ----- the run -------------------------------------------------------------------------------


def measure_capacity(producer: Producer, texts: list[str], seconds: float, seed: int) -> float:
    """Answers per second with the queue never empty, after a warm-up of a sixth of `seconds`."""
    sent: list[TicketResult] = []
    start = time.monotonic()
    mark: tuple[float, int] | None = None
    while time.monotonic() - start < seconds:
        if producer.queue_depth() < TOP_UP:
            batch = [{"id": f"cap-{seed}-{len(sent) + i}", "text": texts[(len(sent) + i) % len(texts)]}
                     for i in range(TOP_UP)]  # fmt: skip
            sent += producer.submit_many(batch, idempotent=True)
        if mark is None and time.monotonic() - start >= seconds / 6:
            mark = (time.monotonic(), producer.redis.xlen(RESULTS_STREAM))
        time.sleep(0.2)
    now, answered = time.monotonic(), producer.redis.xlen(RESULTS_STREAM)
    producer.wait(sent, timeout=600)  # the queue empties before the load begins
    return (answered - mark[1]) / (now - mark[0])


def tally(settings: ClientSettings, ledger: Ledger, monitor: Monitor, fleet: Fleet,
          resend_after: float, chunks: Chunks | None = None) -> tuple[bool, list[str]]:  # fmt: skip
    """The verdict (nothing lost, nothing duplicated, no worker exit) and its lines."""
    reader = Producer(settings)
    try:
        entries, epochs = stream_entries(reader.redis)
        dead, depth = reader.redis.xlen(DEAD_LETTER_STREAM), reader.queue_depth()
        unacked = reader.redis.hlen("unacked")
    finally:
        reader.close()
    per_slot = Counter((entry.get("task_id"), entry.get("id")) for entry in entries)
    in_stream = {entry.get("id") for entry in entries}
    tasks_per_ticket = Counter(ticket for _, ticket in per_slot)
    with ledger.lock:
        sent, answers = dict(ledger.sent), dict(ledger.answers)
        refused, wait_errors = dict(ledger.refused), dict(ledger.wait_errors)
        resent, unsent, again = ledger.resent, ledger.unsent, ledger.answered_again
        refused_tickets = ledger.refused_tickets
    cli_unanswered, cli_lines = chunks.tally() if chunks else (set(), [])
    cli_tickets = chunks.tickets() if chunks else set()
    unanswered = {ticket for ticket in sent if ticket not in answers} | cli_unanswered
    missing = {ticket for ticket in (*sent, *cli_tickets) if ticket not in in_stream}
    lost = unanswered | missing
    duplicated = {key: n for key, n in per_slot.items() if n > 1}
    statuses = Counter(row.get("status") for ticket, row in answers.items() if ticket in sent)
    failed = Counter(str(row.get("reason") or row.get("error", "?"))[:60] for row in answers.values()
                     if row.get("status") != "ok")  # fmt: skip
    tracebacks = sum(text.count("Traceback (most recent call last)") for text in fleet.logs())
    shown = f": {', '.join(sorted(lost)[:10])}" if lost else ""
    total = len(sent) + len(cli_tickets)
    exits = [f"worker {slot} pid {pid} exit {code} at t+{at:.0f}s" for slot, pid, code, at in fleet.exits]
    lines = [
        f"sent {total} ({len(cli_tickets)} by the command-line producers), answered {total - len(unanswered)}, "
        f"lost {len(lost)}, duplicated {len(duplicated)}, worker exits {len(fleet.exits)}",
        f"worker exits during the run (not killed by the nemesis): {len(fleet.exits)} {exits or ''}; exit statuses "
        f"after the final SIGTERM {fleet.final}; worker starts per slot {dict(fleet.starts)}",
        *cli_lines,
        f"threads' answers by status {dict(statuses)}",
        f"lost: {len(lost)} sent tickets ({len(unanswered)} with no answer to their producer, {len(missing)} "
        f"without an entry in the results stream){shown}",
        f"duplicated: {len(duplicated)} (task, slot) with more than one stream entry "
        f"({sum(duplicated.values()) - len(duplicated)} extra entries); tickets in the stream under two task ids "
        f"{sum(n > 1 for n in tasks_per_ticket.values())}; on_result calls repeating an answered ticket {again}",
        f"re-sent by wait(resend_after={resend_after:g}): {resent} messages; submit_many calls refused and tried "
        f"again: {sum(refused.values())} {refused or ''}, {refused_tickets} tickets in them; wait errors "
        f"{wait_errors or 0}; never sent (the load stopped first): {unsent}",
        f"max queue depth {monitor.max_depth}; max messages in Redis (queue + unacked) {monitor.max_messages}; "
        f"max outstanding {monitor.max_outstanding}; at the end: queue {depth}, unacked {unacked}",
        f"failed answers by reason: {dict(failed) or 0}; dead letters {dead}; results-stream entries "
        f"{len(entries)} (per epoch { ({(k or b'-').decode(): n for k, n in epochs.items()}) }); tracebacks in the "
        f"worker logs {tracebacks}",
    ]
    return not lost and not duplicated and not fleet.exits, lines


def stream_entries(client: redis.Redis) -> tuple[list[dict], Counter]:
    """Every results-stream entry as written (no reader's filter), and how many carry each epoch."""
    entries, epochs, last = [], Counter(), "0"
    while reply := client.xread({RESULTS_STREAM: last}, count=5000):
        for raw_id, fields in reply[0][1]:
            last = raw_id
            epochs[fields.get(b"epoch")] += 1
            entries.append(json.loads(fields[b"data"]))
    return entries, epochs


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20, help="length of the load and nemesis (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="ticketq workers (default 2)")
    parser.add_argument("--producers", type=int, default=2, help="producer threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's and the tickets' seed (default 0)")
    parser.add_argument("--load", type=float, default=0.8, help="share of the measured capacity (default 0.8)")
    parser.add_argument("--classifier", choices=("tiny", "null"), default="tiny", help="default: tiny")
    parser.add_argument("--model", help="the tiny stand-in's directory (default: TICKETQ_TEST_TINY_MODEL, "
                        "else one is built in --dir)")  # fmt: skip
    parser.add_argument("--kills", type=int, help="worker kills (default: one every 2 minutes, at least 2)")
    parser.add_argument("--each", type=int, help="events of every other fault kind: failover, memory, partition, "
                        "sigstop, restart, stop-restart, lost-fetch, lost-claim (default: one per 7 minutes, "
                        "at least 1)")  # fmt: skip
    parser.add_argument("--cli-share", type=float, default=0.25, help="share of the load sent by ticketq-produce "
                        "processes, one per --chunk-s (default 0.25)")  # fmt: skip
    parser.add_argument("--chunk-s", type=float, default=30.0, help="seconds of load per ticketq-produce (default 30)")
    parser.add_argument("--retry-for", type=float, default=120.0, help="the ticketq-produce --retry-for (default 120)")
    parser.add_argument("--lease-s", type=float, help="TICKETQ_LEASE_S for the workers (default: the worker's)")
    parser.add_argument("--resend-after", type=float, default=30.0, help="the producers' resend_after (default 30)")
    parser.add_argument("--capacity-s", type=float, default=30.0, help="capacity measurement (default 30)")
    parser.add_argument("--drain-s", type=float, default=300.0, help="longest wait for answers at the end")
    parser.add_argument("--dir", type=Path, help="logs and Redis files (default: a new temporary directory)")
    parser.add_argument("--worker-env", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting for every worker (TICKETQ_LIVE_COST=off); repeatable")  # fmt: skip
    args = parser.parse_args()
    if min(args.workers, args.producers) < 1 or min(args.load, args.minutes, args.resend_after) <= 0:
        parser.error("--workers and --producers must be >= 1; --load, --minutes and --resend-after > 0")
    if any("=" not in pair for pair in args.worker_env):
        parser.error("--worker-env takes NAME=VALUE")
    if args.kills is None:
        args.kills = max(2, round(args.minutes / 2))
    if args.each is None:
        args.each = max(1, round(args.minutes / 7))
    if not 0 <= args.cli_share < 1:
        parser.error("--cli-share must be in [0, 1)")
    args.lease = args.lease_s or Settings.model_fields["lease_s"].default
    return args


def model_dir(args: argparse.Namespace, rundir: Path) -> Path | None:
    if args.classifier == "null":
        return None
    given = args.model or os.environ.get("TICKETQ_TEST_TINY_MODEL")
    if given and Path(given, "config.json").is_file():
        return Path(given)
    from ticketq_cli.standin import build

    say(None, f"building the tiny stand-in in {rundir / 'tiny-standin'}")
    return build("tiny", rundir / "tiny-standin", seed=0)


def namespace() -> Namespace | None:
    """A fresh network namespace, or None without root or `ip` (or where one cannot be made)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    try:
        return ChaosNamespace().create()
    except subprocess.CalledProcessError as exc:
        say(None, f"no network namespace ({exc.stderr.decode(errors='replace').strip()}): no partition")
        return None


class Chaos:
    """One run: everything it started, so that `stop()` can end all of it whatever happened."""

    def __init__(self, args: argparse.Namespace, rundir: Path) -> None:
        self.args, self.rundir = args, rundir
        self.ns = namespace()
        self.servers = ChaosServers(rundir / "redis", self.ns.host_ip if self.ns else "127.0.0.1")
        for server in (self.servers.primary, self.servers.replica):
            server.aof = True  # appendfsync always: a restart loses no acknowledged write
        self.proxy = RedisProxy(0, upstream=self.servers.master_address).start()
        proxied = args.workers > 1 or self.ns is None
        counts = {kind: args.each for kind in KINDS} | {"kill": args.kills}
        counts["partition"] *= self.ns is not None
        counts["lost-fetch"] *= proxied
        counts["lost-claim"] *= proxied
        self.events = schedule(random.Random(args.seed), args.minutes * 60, counts, args.workers, args.lease)
        self.settings = ClientSettings(broker_url=self.servers.url, sentinel_master=MASTER_NAME, queue=QUEUE)
        self.ledger = Ledger()
        self.fleet: Fleet | None = None
        self.loads: list[Load] = []
        self.chunks: Chunks | None = None
        self.watching = threading.Event()  # set: the fleet's watcher stops
        self.producers: list[Producer] = []
        self.threads: list[Monitor | Nemesis] = []
        self.started = time.monotonic()

    def clock(self) -> float:
        return time.monotonic() - self.started

    def announce(self) -> None:
        args = self.args
        say(None, f"chaos run: {args.minutes:g} min, {args.workers} workers ({args.classifier}), {args.producers} "
            f"producers at {args.load:.0%} of capacity, seed {args.seed}, lease {args.lease:g} s, resend_after "
            f"{args.resend_after:g} s; files in {self.rundir}")  # fmt: skip
        if self.ns is None:
            say(None, "no partition: it needs root and iproute2 (`ip netns`)")
        say(None, f"worker {args.workers - 1 if args.workers > 1 or self.ns is None else '-'} through the "
            f"fault-injecting proxy on :{self.proxy.port}; ticketq-produce every {args.chunk_s:g} s for "
            f"{args.cli_share:.0%} of the load (--retry-for {args.retry_for:g})")  # fmt: skip
        say(None, "schedule (seconds after the load starts):")
        for event in self.events:
            say(None, f"  t+{event.at_s:6.1f}s  {event.kind}: {event.describe()}")

    def start(self) -> float:
        """Redis, the workers, the capacity: the offered rate."""
        args = self.args
        say(None, "starting Redis: a primary, a replica, three sentinels")
        self.servers.start()
        self.fleet = Fleet(args, self.servers.url, model_dir(args, self.rundir), self.ns, self.rundir, self.proxy)
        say(None, f"starting {args.workers} worker(s){' (worker 0 in ' + self.ns.name + ')' if self.ns else ''}")
        self.fleet.start_all()
        self.texts = [ticket["text"] for ticket in generate_tickets(2000, seed=args.seed)]
        probe = Producer(self.settings)
        self.producers.append(probe)
        probe.wait(probe.submit_many(self.texts[:20]), timeout=600)  # warm-up: kernels, connections
        capacity = measure_capacity(probe, self.texts, args.capacity_s, args.seed)
        say(None, f"capacity {capacity:.1f} tickets/s over {args.capacity_s:g} s; offering "
            f"{args.load * capacity:.1f}/s")  # fmt: skip
        return args.load * capacity

    def run(self) -> int:
        args, rate = self.args, self.start()
        self.started = time.monotonic()
        monitor = Monitor(self.settings, self.ledger, self.clock)
        nemesis = Nemesis(self.events, self.servers, self.fleet, self.ns, self.ledger, monitor, self.clock)
        self.threads = [monitor, nemesis]
        self.producers.append(monitor.producer)
        deadline = self.started + args.minutes * 60 + args.drain_s
        threads_rate = rate * (1 - args.cli_share)
        self.loads = [Load(n, self.settings, threads_rate / args.producers, self.texts, self.ledger, args, deadline)
                      for n in range(args.producers)]  # fmt: skip
        if args.cli_share > 0:
            self.chunks = Chunks(self.servers.url, rate * args.cli_share, self.texts, self.ledger, args, deadline,
                                 self.rundir)  # fmt: skip
        watcher = threading.Thread(target=self.fleet.watch, args=(self.watching, self.clock), daemon=True,
                                   name="chaos-watch")  # fmt: skip
        for thread in (monitor, nemesis, watcher, *([self.chunks] if self.chunks else [])):
            thread.start()
        for load in self.loads:
            load.start()
        time.sleep(max(0.0, args.minutes * 60 - self.clock()))
        for load in self.loads:
            load.stop.set()
        if self.chunks:
            self.chunks.stop.set()
        say(self.clock(), f"load stopped [{monitor.state()}]")
        nemesis.join()  # a late event is played to its end: each has bounded waits
        self.drain(monitor)
        self.watching.set()
        watcher.join()
        self.fleet.stop_all()
        ok, lines = tally(self.settings, self.ledger, monitor, self.fleet, args.resend_after, self.chunks)
        print("\ntally:", *lines, *(f"nemesis {failure}" for failure in nemesis.failures), sep="\n  ", flush=True)
        print(f"\n{'PASS' if ok else 'FAIL'}: {'0 lost, 0 duplicated, 0 worker exits' if ok else lines[0]}", flush=True)
        return 0 if ok else 1

    def drain(self, monitor: Monitor) -> None:
        """Until every producer has its answers, or the deadline (the load's end plus --drain-s; a
        nemesis event that ran late takes its time from the drain)."""
        for load in self.loads:
            for thread in load.threads:
                thread.join(timeout=max(0.0, load.deadline - time.monotonic()) + 60)
        if self.chunks:
            self.chunks.finish()
        monitor.stop.set()
        say(self.clock(), f"drained [{monitor.state()}]")

    def stop(self) -> None:
        self.watching.set()
        for thing in (*self.threads, *self.loads, *([self.chunks] if self.chunks else [])):
            thing.stop.set()
        if self.chunks:
            self.chunks.kill()
        if self.ns is not None:
            self.ns.link(up=True)
        if self.fleet is not None:
            self.fleet.kill_all()
        self.servers.stop()
        self.proxy.close()
        if self.ns is not None:
            self.ns.destroy()
        for closable in (*self.producers, *self.loads):
            try:
                closable.close()
            except Exception:  # its Redis is gone: nothing left to release
                log.debug("closing a producer", exc_info=True)


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    require_redis_server()
    rundir = args.dir or Path(tempfile.mkdtemp(prefix="ticketq-chaos-"))
    rundir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(filename=rundir / "chaos.log", level=logging.WARNING,
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")  # fmt: skip
    signal.signal(signal.SIGTERM, interrupt)
    chaos = Chaos(args, rundir)
    try:
        chaos.announce()
        return chaos.run()
    except KeyboardInterrupt:
        say(None, "interrupted: stopping everything")
        return 130
    finally:
        chaos.stop()
        say(None, f"everything stopped; logs in {rundir}")


if __name__ == "__main__":
    sys.exit(main())
