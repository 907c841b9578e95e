"""Real processes for integration tests: ticketq workers and private redis-servers.

The worker process, free ports, metrics scraping and polling are `ticketq_bench.procs`, the helper that
`ticketq demo`, the bench and the load test use too; this module adds what only tests need: a
test-shaped worker environment, private redis-servers, and skipping without Redis. Tests
synchronise on events (metrics served, results arrived, process exited), never on sleeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import redis

from ticketq_bench import procs
from ticketq_bench.procs import ROOT, free_port, wait_for
from ticketq_bench.procs import WorkerProcess as Worker

# What the tests import from here; ROOT, free_port, wait_for and Worker come from ticketq_bench.procs.
__all__ = [
    "ROOT", "RedisServer", "StartedWorkers", "Worker", "end_process", "free_port", "null_classifier_service", "on_ci",
    "redis_or_skip", "running_worker", "skip_or_fail", "wait_for", "worker_command", "worker_env",
]  # fmt: skip


def worker_env(model_dir: Path | None, broker_url: str, queue: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(
        TICKETQ_BROKER_URL=broker_url,
        TICKETQ_QUEUE=queue,
        TICKETQ_METRICS_PORT=str(free_port()),
        TICKETQ_DTYPE="float32",
        TICKETQ_DEVICE="cpu",
        TICKETQ_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if model_dir is not None:
        env["TICKETQ_MODEL"] = str(model_dir)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def running_worker(env: dict[str, str], log_path: Path, ready_timeout: float = 120) -> AbstractContextManager[Worker]:
    """`procs.running_worker` with a test's patience: the tiny stand-in is ready in seconds."""
    return procs.running_worker(env, log_path, ready_timeout)


def worker_command(faulty: bool = False) -> list[str]:
    """How a worker is run: `ticketq worker`, or with `faulty` the fault-injecting one (tests/support/faults.py)."""
    if not faulty:
        return list(procs.WORKER_COMMAND)
    from faults import COMMAND  # imports the worker package: only where a test asks for it

    return [sys.executable, *COMMAND]


class StartedWorkers:
    """The worker processes one test starts, each logging to `workdir/NAME.log`; a fixture calls
    `stop()` at its end, which stops (or reaps) every one."""

    def __init__(self, workdir: Path, ready_timeout: float = 120) -> None:
        self.workdir, self.ready_timeout = workdir, ready_timeout
        self.started: list[Worker] = []

    def start(self, env: dict[str, str], name: str, faulty: bool = False, ready: bool = True) -> Worker:
        """A worker from `env` (`worker_command(faulty)`), ready unless `ready` is False."""
        worker = Worker(env, self.workdir / f"{name}.log", command=worker_command(faulty))  # its own log: " ready."
        self.started.append(worker)
        if ready:
            worker.wait_ready(timeout=self.ready_timeout)
        return worker

    def stop(self) -> None:
        for worker in self.started:
            worker.stop(timeout=30)


class RedisServer:
    """A private redis-server on its own port (optionally with AOF and a password) that tests may kill."""

    def __init__(
        self, workdir: Path, port: int | None = None, password: str | None = None, aof: bool = True,
        fsync: str = "always", args: Sequence[str] = (),
    ) -> None:
        """`fsync="always"`: every write a client saw acknowledged is on disk, so a test that kills
        Redis knows exactly what survives (with everysec the last second or two may not). `args`:
        more configuration, as redis-server takes it (`--maxmemory`, `10mb`, `--replicaof`, ...)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.workdir, self.port, self.password, self.aof = workdir, port or free_port(), password, aof
        self.fsync, self.args = fsync, list(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)

    def start(self) -> RedisServer:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "yes" if self.aof else "no", "--appendfsync", self.fsync]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        args += self.args
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._pings, 10, f"redis-server on port {self.port}")
        return self

    def _pings(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        end_process(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        end_process(self.proc, timeout=10)


def end_process(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float | None = None) -> None:
    """Send `sig` to `proc` if it is still running, and reap it (waiting at most `timeout` seconds)."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(sig)
        proc.wait(timeout=timeout)


@contextmanager
def null_classifier_service(workdir: Path, prefix: str, **extra: str) -> Iterator[tuple[str, str]]:
    """A private redis-server and one null-classifier worker on a fresh queue (its environment plus
    `extra`): (broker url, queue)."""
    server = RedisServer(workdir, aof=False).start()
    queue = f"{prefix}-{uuid.uuid4().hex[:8]}"
    env = worker_env(None, server.url, queue, TICKETQ_NULL_CLASSIFIER="1", **extra)
    try:
        with running_worker(env, workdir / "worker.log"):
            yield server.url, queue
    finally:
        server.stop()


def on_ci() -> bool:
    """CI=true (set by .ci/run and by every CI system): a missing service is a broken setup, not a skip."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def redis_or_skip(url: str) -> redis.Redis:
    """A client on the machine's Redis; skips the test without one, but fails under CI (CI=true),
    where a missing Redis is a broken setup, not a reason to pass."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        skip_or_fail(f"no Redis at {url} ({exc}); start one with `redis-server --port 6379`")
    return client


def skip_or_fail(reason: str) -> None:
    """Skip the test for a missing service; under CI (CI=true) a missing service fails it instead."""
    if on_ci():
        pytest.fail(reason)
    pytest.skip(reason)


def celery_results_app(name: str, url: str):
    """A Celery app on `url` with Celery's Redis result backend, JSON only: the backend a test
    hands the service, as a worker's app has it. Close it after the test (`close_results_app`
    where the Redis is a private one the test stops)."""
    from celery import Celery

    app = Celery(name, broker=url, backend=url, set_as_current=False)
    app.conf.update(result_serializer="json", accept_content=["json"], result_accept_content=["json"],
                    result_expires=600, result_extended=False)  # fmt: skip
    return app


def close_results_app(app) -> None:
    """Close a Celery app whose AsyncResults read a Redis the test will stop, while it still answers.

    Celery's `AsyncResult.__del__` unsubscribes its task from the result pub/sub. One held in a
    reference cycle does so at whatever later garbage collection frees it: once the test's
    redis-server is gone, it retries the connection for seconds and ends in "Exception ignored in"
    (a warning in some later test, and its seconds). So: collect them now, then close the pub/sub
    for good, so that an unsubscribe after this is a no-op (as `producer.backend.BulkRedisBackend.
    stop_consumer` does for the producer's own backend)."""
    import gc

    gc.collect()
    consumer = getattr(app.backend, "result_consumer", None)
    if getattr(consumer, "_pubsub", None) is not None:
        consumer._pubsub.close()
        consumer._pubsub = None
    app.close()
