"""Real processes for integration tests: ticketq workers and private redis-servers.

Tests synchronise on events (metrics served, results arrived, process exited), never on sleeps.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from worker.demo import scrape as scrape_url

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll `predicate` until truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, float]:
    """Parse /metrics with prometheus_client's parser: 'name{k=v,...}' -> value."""
    return scrape_url(f"http://{host}:{port}/metrics")


class Worker:
    """A `ticketq worker` subprocess with its own metrics port and log file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.metrics_port = int(env["TICKETQ_METRICS_PORT"])
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--loglevel", "INFO"],
            env=env, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_port)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        """Ready = metrics served with model info (model loaded, prefix primed) and the consumer up."""

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                return any(k.startswith("ticketq_model_info") for k in self.metrics()) and " ready." in self.log()
            except OSError:
                return False

        wait_for(ready, timeout, f"worker ready (log {self.log_path})", interval=0.2)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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


@contextmanager
def running_worker(env: dict[str, str], log_path: Path, ready_timeout: float = 120) -> Iterator[Worker]:
    worker = Worker(env, log_path)
    try:
        worker.wait_ready(ready_timeout)
        yield worker
    finally:
        worker.stop()


class RedisServer:
    """A private redis-server on its own port (optionally with AOF and a password) that tests may kill."""

    def __init__(
        self, workdir: Path, port: int | None = None, password: str | None = None, aof: bool = True,
        fsync: str = "always",
    ) -> None:
        """`fsync="always"`: every write a client saw acknowledged is on disk, so a test that kills
        Redis knows exactly what survives (with everysec the last second or two may not)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.workdir, self.port, self.password, self.aof = workdir, port or free_port(), password, aof
        self.fsync = fsync
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
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._pings, 10, f"redis-server on port {self.port}")
        return self

    def _pings(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@contextmanager
def null_classifier_service(workdir: Path, prefix: str) -> Iterator[tuple[str, str]]:
    """A private redis-server and one null-classifier worker on a fresh queue: (broker url, queue)."""
    server = RedisServer(workdir, aof=False).start()
    queue = f"{prefix}-{uuid.uuid4().hex[:8]}"
    env = worker_env(None, server.url, queue, TICKETQ_NULL_CLASSIFIER="1")
    try:
        with running_worker(env, workdir / "worker.log"):
            yield server.url, queue
    finally:
        server.stop()


def redis_or_skip(url: str) -> redis.Redis:
    """A client on the machine's Redis; skips the test without one, but fails under CI (CI=true),
    where a missing Redis is a broken setup, not a reason to pass."""
    client = redis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        reason = f"no Redis at {url} ({exc}); start one with `redis-server --port 6379`"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(reason)
        pytest.skip(reason)
    return client
