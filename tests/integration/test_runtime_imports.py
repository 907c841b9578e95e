"""The worker's runtime imports no tooling: neither the operator CLI (`ticketq_cli`) nor the benchmark
(`ticketq_bench`). A fresh interpreter runs the worker's start-up without Celery's event loop: the
app built, the broker transport, consumer and AMQP classes Celery resolves from it, Celery's worker
and thread pool modules, and `Runtime.start` (version guards, Redis, metrics, the engine on the
tiny stand-in, the service), then lists what it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from workers import ROOT, worker_env

pytestmark = pytest.mark.integration

TOOLING = ("ticketq_cli", "ticketq_bench")

START_UP_THEN_LIST_MODULES = """
import json, os, sys
import celery.apps.worker, celery.concurrency.thread, celery.worker.consumer  # what worker_main loads
from kombu.utils.imports import symbol_by_name
from worker.app import create_app, run_worker  # noqa: F401  (run_worker: the `ticketq worker` entry)
from worker.settings import load_settings

app = create_app(load_settings())
for name in (app.conf.broker_transport, app.conf.worker_consumer, app.amqp_cls):
    symbol_by_name(name)
app.connection_for_read().transport  # the transport instance, as the consumer builds it
app.ticketq_runtime.start()
sys.stdout.write(json.dumps(sorted(sys.modules)) + "\\n")
sys.stdout.flush()
os._exit(0)  # the service's background threads need no orderly stop here
"""


def _imported(modules: list[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


@pytest.mark.integration
def test_the_worker_start_up_imports_no_tooling(redis_server, tiny_model_dir):
    env = worker_env(tiny_model_dir, redis_server.url, f"imports-{uuid.uuid4().hex[:8]}", TICKETQ_MATMUL="torch",
                     TICKETQ_AUTOTUNE="false")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", START_UP_THEN_LIST_MODULES], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    assert "worker.engine.model" in modules and "worker.service.core" in modules  # it did start the runtime
    assert "worker.transport.fetch" in modules and "celery_batches" in modules
    assert _imported(modules, TOOLING) == []


def test_the_check_sees_a_tooling_import():
    """The same listing catches a runtime module that pulls the tooling in."""
    code = "import json, sys, worker.app, ticketq_bench.procs; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _imported(json.loads(done.stdout), TOOLING) == ["ticketq_bench", "ticketq_bench.procs"]
