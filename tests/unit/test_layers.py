"""The import graph of every package of the repository: no cycle, and each layer imports only the
layers below it. Bottom first:

    ticketq/            the contract: names, ticket rules, client settings, codec, epoch, dead-letter fields
    producer/           the client side: the contract only
    gateway/            the HTTP front door and the results dispatcher: the client side and the contract
    worker/health/      the process's health records (progress, refusal episodes, data loss): the contract only
    worker/transport/   private names of Celery, kombu, celery-batches, redis-py: health and the contract only
    worker/redis/       the Redis store (keys, outbox, Celery's result format, requeue writes): transport, health
    worker/engine/      tensors: health, the contract, and the worker's settings and result records
    worker/*.py         the core records and services: metrics, settings, result records, shadow
    worker/service/     the pipeline (stages and hooks): the core, the store, the engine
    worker/app/         the Celery glue that builds a worker: everything above but the tools
    ticketq_bench/      the benchmark, its peers, the load test, the worker-process harness
    ticketq_cli/        the `ticketq` command and the operator's tools: above everything, imported by nothing

The graph is read from the source (the AST of every file), so an import inside a function counts
as much as one at the top, and importing `a.b.c` counts as importing the packages `a` and `a.b` too
(their `__init__` runs first). Imports under `if TYPE_CHECKING:` never run: the layer rules leave
them out, the cycle check counts them (a circle of types is a circle of knowledge all the same). The
third-party rules (no Celery in the engine, no torch in the transport) are checked in a fresh
interpreter per layer, so nothing imported by another test hides a violation.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ticketq", "producer", "gateway", "worker", "ticketq_bench", "ticketq_cli")

# Layer -> the layers (or single modules) it may import besides its own modules; bottom first.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "ticketq": (),
    "producer": ("ticketq",),
    "gateway": ("ticketq", "producer"),
    "worker.health": ("ticketq",),
    "worker.transport": ("ticketq", "worker.health"),
    "worker.redis": ("ticketq", "worker.health", "worker.transport"),
    "worker.engine": ("ticketq", "worker.health", "worker.settings", "worker.results"),
    "worker": ("ticketq", "worker.health", "worker.transport", "worker.redis", "worker.engine"),
    "worker.service": ("ticketq", "worker.health", "worker.redis", "worker.engine", "worker"),
    "worker.app": ("ticketq", "worker.health", "worker.transport", "worker.redis", "worker.engine", "worker",
                   "worker.service"),
    "ticketq_bench": ("ticketq", "producer", "worker.health", "worker.transport", "worker.redis", "worker.engine",
                      "worker", "worker.service", "worker.app"),
    "ticketq_cli": ("ticketq", "producer", "worker.health", "worker.transport", "worker.redis", "worker.engine",
                    "worker", "worker.service", "worker.app", "ticketq_bench", "gateway"),
}
# Third-party packages a layer must not load, checked at run time.
NOT_LOADED = {"worker.engine": ("celery", "kombu"), "worker.transport": ("torch",), "ticketq": ("torch", "celery")}


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> str:
    """The layer a module belongs to: the longest layer name it sits under."""
    return max((layer for layer in MAY_IMPORT if _within(module, layer)), key=len)


# ----- the import graph, from the source -------------------------------------------------------


def repo_modules(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py under the packages (a package by its `__init__.py`)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_checking: bool = False) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (in functions too); those under `if TYPE_CHECKING:` only
    with `type_checking`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        children = list(ast.iter_child_nodes(node))
        if _is_type_checking(node) and not type_checking:
            children = list(node.orelse)
        stack.extend(children)


def _named(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool) -> list[str]:
    """The dotted names an import statement asks for, relative ones resolved against `importer`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = importer.split(".") if is_package else importer.split(".")[:-1]
        anchor = package[: len(package) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def imports_of(importer: str, path: Path, modules: Mapping[str, Path], type_checking: bool = False) -> set[str]:
    """The repo modules `importer` makes Python run: each named module and the packages above it,
    less its own packages (initialised before it runs) and itself."""
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 1)}
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path)), type_checking):
        for name in _named(node, importer, path.name == "__init__.py"):
            parts = name.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {name for name in found if name in modules and name not in own and name != importer}


def import_graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES, type_checking: bool = False,
                 ) -> dict[str, set[str]]:  # fmt: skip
    modules = repo_modules(root, packages)
    return {name: imports_of(name, path, modules, type_checking) for name, path in modules.items()}


# ----- the checks ------------------------------------------------------------------------------


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One cycle (its first module repeated at the end) per group of modules that import each other."""
    return [_cycle_in(graph, group) for group in tangles(graph)]


def tangles(graph: Mapping[str, Iterable[str]]) -> list[set[str]]:
    """The strongly connected groups of modules (more than one, or one importing itself). Tarjan's
    algorithm, iterative: linear in modules plus imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(group) > 1 or node in graph.get(node, ()):
                        found.append(set(group))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph.get(target, ())))))
            elif target in stack:
                low[node] = min(low[node], index[target])
    return found


def _cycle_in(graph: Mapping[str, Iterable[str]], group: set[str]) -> list[str]:
    """A shortest cycle through the group's first module, within the group (breadth first)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target == start:
                    return [*paths[node], start]
                if target in group and target not in paths:
                    paths[target] = [*paths[node], target]
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def _allowed(layer: str, target: str) -> bool:
    """`target`'s layer is listed for `layer`, or `target` is a module listed by name (not a layer:
    "worker" lets a layer import the core's modules, not every folder under worker/)."""
    listed = MAY_IMPORT[layer]
    return layer_of(target) in listed or any(_within(target, name) for name in listed if name not in MAY_IMPORT)


def violations(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Every import that leaves its layer for one the layer may not import, as 'a -> b'."""
    bad = []
    for importer, targets in sorted(graph.items()):
        layer = layer_of(importer)
        for target in sorted(targets):
            if layer_of(target) != layer and not _allowed(layer, target):
                bad.append(f"{importer} -> {target}")
    return bad


def test_no_import_cycle_module_level_lazy_or_for_types():
    graph = import_graph(type_checking=True)
    found = [(" -> ".join(_cycle_in(graph, group)), sorted(group)) for group in tangles(graph)]
    assert found == [], "import cycles:\n" + "\n".join(f"{cycle}   (tangled: {group})" for cycle, group in found)


def test_each_layer_imports_only_the_layers_below_it():
    assert violations(import_graph()) == []


def test_the_rules_point_down():
    """A layer may import only layers listed before it: no rule allows an upward import. The one
    exception is named: the engine reads the worker's settings and result records."""
    order = list(MAY_IMPORT)
    upward = [(layer, name) for layer, allowed in MAY_IMPORT.items() for name in allowed
              if order.index(layer_of(name)) >= order.index(layer)]  # fmt: skip
    assert upward == [("worker.engine", "worker.settings"), ("worker.engine", "worker.results")]
    assert MAY_IMPORT["worker.transport"] == ("ticketq", "worker.health"), "transport imports no store, no core"


@pytest.mark.parametrize("layer", list(MAY_IMPORT))
def test_each_rule_fails_when_broken(layer):
    """An import from this layer into each layer its rule does not list is named; into a listed one it is not."""
    for other in MAY_IMPORT:
        if other != layer:
            expected = [] if other in MAY_IMPORT[layer] else [f"{layer}.a -> {other}.b"]
            assert violations({f"{layer}.a": {f"{other}.b"}}) == expected, other
    for name in MAY_IMPORT[layer]:
        assert violations({f"{layer}.a": {name}}) == []
    assert violations({"worker.transport.fetch": {"worker.redis.outbox"}}) == [
        "worker.transport.fetch -> worker.redis.outbox"]  # fmt: skip


def test_the_cycle_check_fails_on_a_cycle_and_names_it():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"a"}}) == [["a", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_lazy_imports_and_package_inits(tmp_path):
    """A cycle closed by an import inside a function and a package's `__init__` (the shape of a
    store importing `pkg.transport.lua`, whose package imports a fetch that imports the store)."""
    files = {
        "pkg/__init__.py": "",
        "pkg/store.py": "from pkg.transport.lua import script\n",
        "pkg/transport/__init__.py": "from pkg.transport.fetch import Transport\n",
        "pkg/transport/lua.py": "def script(): ...\n",
        "pkg/transport/fetch.py": "def fetch():\n    from pkg import store\n",
        "pkg/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import store\n",
        "pkg/relative.py": "from .transport import lua\nfrom . import typed\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.typed"] == set(), "a TYPE_CHECKING import never runs"
    assert graph["pkg.relative"] == {"pkg.transport", "pkg.transport.lua", "pkg.typed"}
    assert graph["pkg.transport.fetch"] == {"pkg.store"}, "lazy, and `pkg` itself is already importing"
    assert cycles(graph) == [["pkg.store", "pkg.transport", "pkg.transport.fetch", "pkg.store"]]
    typed = import_graph(tmp_path, ["pkg"], type_checking=True)
    assert typed["pkg.typed"] == {"pkg.store"}, "the cycle check sees a TYPE_CHECKING import"


@pytest.mark.parametrize("layer", list(NOT_LOADED))
def test_no_layer_loads_the_libraries_it_must_not(layer):
    modules = [name for name in repo_modules() if layer_of(name) == layer]
    assert modules, f"no modules found for {layer}"
    code = (
        f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    loaded = json.loads(out)
    offenders = sorted(name for name in loaded if any(_within(name, f) for f in NOT_LOADED[layer]))
    assert offenders == [], f"{layer} pulled in {offenders}"


def test_every_worker_module_sits_in_a_layer_folder():
    """The service core is worker/*.py; everything else lives in a layer's folder."""
    folders = {path.name for path in (ROOT / "worker").iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert {f"worker.{folder}" for folder in folders} <= set(MAY_IMPORT), folders


def test_importing_worker_app_builds_nothing():
    """No settings read, no app built at import: `celery -A worker.app` builds it on first access."""
    code = "import worker.app as m; print('_default_app' in vars(m) and m._default_app is None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "TICKETQ_BATCH_WINDOW": "not-a-number"}).stdout  # fmt: skip
    assert out.strip() == "True", "importing worker.app with invalid settings must not fail: nothing is read"
