"""Starting, waiting for and stopping a `ticketq worker` subprocess; free ports; scraping metrics.

The one place that runs a worker as a child process, for `ticketq demo`, the bench's queue mode,
the load test and the integration tests alike:

    with running_worker(env, Path("worker.log")) as worker:   # env sets TICKETQ_METRICS_PORT
        ...                                                    # worker.metrics(), worker.log()

Ready means what a client needs: the worker serves metrics with its model info (model loaded,
prefix primed) and Celery has logged its consumer " ready.". Waits poll those events, never sleep
a fixed time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
WORKER_COMMAND = (sys.executable, "-m", "ticketq_cli.cli", "worker", "--loglevel", "INFO")
READY_LINE = " ready."  # Celery's worker logs "<hostname> ready." once its consumer is up
T = TypeVar("T")


def free_port(preferred: int = 0) -> int:
    """`preferred` if it is free on 127.0.0.1, else any free port (0: any)."""
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
                return sock.getsockname()[1]
            except OSError:
                continue
    raise RuntimeError("no free port")


def scrape(url: str) -> dict[str, float]:
    """`/metrics` parsed with prometheus_client's own parser: 'name{k=v,...}' -> value."""
    return parse_metrics(urllib.request.urlopen(url, timeout=5).read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{k=v,...}': value}, labels sorted, values unquoted."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def model_info(metrics: dict[str, float]) -> dict[str, str]:
    """The labels of a worker's `ticketq_model_info` series in `parse_metrics` output (what it runs:
    model, dtype, device, matmul), {} when there is none."""
    key = next((key for key in metrics if key.startswith("ticketq_model_info{")), "")
    labels = key.removeprefix("ticketq_model_info{").removesuffix("}")
    return dict(pair.split("=", 1) for pair in labels.split(",") if "=" in pair)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until truthy and return its value; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class WorkerProcess:
    """A `ticketq worker` subprocess started from `env` (which must set TICKETQ_METRICS_PORT), logging to `log_path`."""

    def __init__(self, env: dict[str, str], log_path: Path, command: Sequence[str] = WORKER_COMMAND) -> None:
        self.metrics_port = int(env["TICKETQ_METRICS_PORT"])
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        # This tree's `worker` package whatever the child's directory; relative paths in `env`
        # (a model directory) still resolve from the caller's directory, as they would for it.
        path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        with log_path.open("wb") as log:  # a fresh log: READY_LINE must be this process's; the child keeps its fd
            self.proc = subprocess.Popen(
                list(command), env={**env, "PYTHONPATH": path}, stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def metrics(self) -> dict[str, float]:
        return scrape(self.metrics_url)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float, what: str) -> None:
        """Until `text` is in the log; on timeout the error carries every thread's stack and the log's tail."""
        try:
            wait_for(lambda: text in self.log(), timeout, what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}; the worker's threads and log:\n{self.stacks()}") from None

    def stacks(self, tail: int = 12000) -> str:
        """Celery's SIGUSR1 handler prints every thread's stack to the log: the log's tail after it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        return self.log()[-tail:]

    def wait_ready(self, timeout: float = 600) -> None:
        """Until metrics carry the model info and Celery logged READY_LINE; RuntimeError if the worker exits."""
        wait_for(self._ready, timeout, f"worker ready (log {self.log_path})", interval=0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
        try:
            return any(k.startswith("ticketq_model_info") for k in self.metrics()) and READY_LINE in self.log()
        except OSError:  # metrics not served yet
            return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Send `sig` (SIGTERM: Celery requeues anything unacked at once), kill if it hangs; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextmanager
def running_worker(env: dict[str, str], log_path: Path, ready_timeout: float = 600) -> Iterator[WorkerProcess]:
    """A ready worker for the `with` block, stopped after it (also when it never got ready)."""
    worker = WorkerProcess(env, log_path)
    try:
        worker.wait_ready(ready_timeout)
        yield worker
    finally:
        worker.stop()
