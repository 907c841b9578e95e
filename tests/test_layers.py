"""The layers, by folder: each imports only the layers below it.

    ticketq/            the contract: names, ticket rules, client settings, codec (no worker, no producer)
    producer/           the client side: imports the contract only
    worker/engine/      tensors: imports no Celery glue, no transport, no tooling
    worker/transport/   private names of Celery, kombu, celery-batches, redis-py: no engine, no tooling
    worker/*.py         the service core (Celery glue, service, store, metrics, settings)
    ticketq_bench/      the benchmark, its peers, the load test, the worker-process harness: no CLI
    ticketq_cli/        the `ticketq` command and the operator's tools: above everything, imported by nothing

Checked in a fresh interpreter per layer, so nothing imported by another test hides a violation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules(folder: str, *, recursive: bool = True) -> list[str]:
    base = ROOT / folder
    paths = base.rglob("*.py") if recursive else base.glob("*.py")
    names = []
    for path in sorted(paths):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


TOOLING = ("ticketq_cli", "ticketq_bench")
LAYERS = {
    "ticketq": (_modules("ticketq"), ("worker", "producer", *TOOLING)),
    "producer": (_modules("producer"), ("worker", *TOOLING)),
    "worker/engine": (_modules("worker/engine"), ("worker.transport", "worker.app", "worker.service",
                                                   "worker.store", "producer", "celery", "kombu", *TOOLING)),
    "worker/transport": (_modules("worker/transport"), ("worker.engine", "worker.app",
                                                         "worker.service", "producer", "torch", *TOOLING)),
    "worker (core)": (_modules("worker", recursive=False), ("producer", *TOOLING)),
    "ticketq_bench": ([m for m in _modules("ticketq_bench") if not m.endswith(".__main__")], ("ticketq_cli",)),
}  # fmt: skip


def _loaded_after_importing(modules: list[str]) -> set[str]:
    code = (
        f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return set(json.loads(out))


@pytest.mark.parametrize("layer", list(LAYERS))
def test_each_layer_imports_only_the_layers_below_it(layer):
    modules, forbidden = LAYERS[layer]
    assert modules, f"no modules found for {layer}"
    loaded = _loaded_after_importing(modules)
    offenders = sorted(name for name in loaded if any(name == f or name.startswith(f + ".") for f in forbidden))
    assert offenders == [], f"{layer} pulled in {offenders}"


def test_every_worker_module_sits_in_a_layer_folder():
    """The service core is worker/*.py; everything else lives in engine/ or transport/ (the tooling
    lives outside the worker package, in ticketq_cli/ and ticketq_bench/)."""
    folders = {path.name for path in (ROOT / "worker").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == {"engine", "transport"}, folders


def test_importing_worker_app_builds_nothing():
    """No settings read, no app built at import: `celery -A worker.app` builds it on first access."""
    code = "import worker.app as m; print('_default_app' in vars(m) and m._default_app is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "TICKETQ_BATCH_WINDOW": "not-a-number"}).stdout  # fmt: skip
    assert out.strip() == "True", "importing worker.app with invalid settings must not fail: nothing is read"
