"""The import direction of the redesign: the service's core never imports the tools above it.

`worker.cli`, `demo`, `offline`, `bench`, `loadtest`, `ops` and `peers` sit above the core and
the producer; the core (Celery glue, service, engine, transport, store, metrics) must not pull
them in, nor the producer package: a worker image could then drop them. Checked in a fresh
interpreter, so nothing imported by another test hides a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys

CORE = ["worker.app", "worker.service", "worker.engine", "worker.internals", "worker.store", "worker.metrics"]
TOOLS = ("worker.cli", "worker.demo", "worker.offline", "worker.bench", "worker.loadtest", "worker.ops",
         "worker.peers", "worker.procs", "producer")  # fmt: skip


def _loaded_after_importing(modules: list[str]) -> set[str]:
    code = (
        f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out))


def test_the_core_imports_no_tool_and_no_producer():
    loaded = _loaded_after_importing(CORE)
    offenders = sorted(name for name in loaded if name.startswith(TOOLS))
    assert offenders == [], f"core modules pulled in tools: {offenders}"


def test_importing_worker_app_builds_nothing():
    """No settings read, no app built at import: `celery -A worker.app` builds it on first access."""
    code = "import worker.app as m; print('_default_app' in vars(m) and m._default_app is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "/usr/bin:/bin", "TICKETQ_BATCH_WINDOW": "not-a-number"}).stdout  # fmt: skip
    assert out.strip() == "True", "importing worker.app with invalid settings must not fail: nothing is read"
