"""The test tiers, by folder: what each may need.

    tests/unit/          no Redis, no redis-server, no worker process: `pytest -m "not integration"`
    tests/integration/   real Redis (the machine's or a private redis-server), worker processes, Prometheus
    tests/support/       the helpers both import by name (pyproject's pytest `pythonpath`)

Every integration module carries the `integration` marker at module level, so the marker and the
folder say the same thing. A unit module may name redis-py's exception classes (messages about
them are unit-testable), but imports nothing that starts a server or a worker and builds no client.
Read from the source (the AST), each rule checked on a module that breaks it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# What a unit module may take from tests/support/workers.py: nothing here starts or reaches a service.
WORKERS_FOR_UNIT = {"ROOT", "free_port", "wait_for", "skip_or_fail", "on_ci"}
SERVICE_HELPERS = {"servers", "faults"}  # private redis-servers and sentinels; the fault-injecting worker


def marks_integration(tree: ast.Module) -> bool:
    """A module-level `pytestmark` that is, or lists, `pytest.mark.integration`."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return any(ast.unparse(mark) == "pytest.mark.integration" for mark in marks)
    return False


def unit_problems(source: str) -> list[str]:
    """What in a unit module needs Redis, a redis-server or a worker process, one line each."""
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            problems += [f"imports {a.name}" for a in node.names if a.name in SERVICE_HELPERS | {"workers"}]
        elif isinstance(node, ast.ImportFrom) and node.module in SERVICE_HELPERS:
            problems.append(f"imports from {node.module}")
        elif isinstance(node, ast.ImportFrom) and node.module == "workers":
            problems += [f"takes workers.{a.name}" for a in node.names if a.name not in WORKERS_FOR_UNIT]
        elif isinstance(node, ast.ImportFrom) and node.module == "redis":
            problems += [f"takes redis.{a.name}" for a in node.names if not a.name.endswith("Error")]
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "redis":
            if not (node.attr.endswith("Error") or node.attr == "exceptions"):
                problems.append(f"uses redis.{node.attr}")
        elif isinstance(node, ast.FunctionDef) and "redis_server" in [a.arg for a in node.args.args]:
            problems.append(f"{node.name} takes the redis_server fixture")
        elif isinstance(node, ast.Attribute) and ast.unparse(node) == "pytest.mark.integration":
            problems.append("carries the integration marker")
    return problems


def test_every_test_module_is_in_a_tier():
    modules = {path.relative_to(TESTS).parent.as_posix() for path in TESTS.rglob("test_*.py")}
    assert modules == {"unit", "integration"}, modules


@pytest.mark.parametrize("path", sorted((TESTS / "integration").glob("test_*.py")), ids=lambda p: p.name)
def test_every_integration_module_is_marked(path):
    assert marks_integration(ast.parse(path.read_text(encoding="utf-8"))), f"{path.name}: no module-level pytestmark"


@pytest.mark.parametrize("path", sorted((TESTS / "unit").glob("*.py")), ids=lambda p: p.name)
def test_no_unit_module_needs_redis_or_a_worker(path):
    assert unit_problems(path.read_text(encoding="utf-8")) == [], path.name


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("from workers import RedisServer", "takes workers.RedisServer"),
        ("from workers import free_port, running_worker", "takes workers.running_worker"),
        ("import workers", "imports workers"),
        ("from servers import require_redis_server", "imports from servers"),
        ("from faults import COMMAND", "imports from faults"),
        ("import redis\nredis.Redis(port=6379).ping()", "uses redis.Redis"),
        ("import redis\nredis.from_url('redis://127.0.0.1:6379/0')", "uses redis.from_url"),
        ("from redis import Redis", "takes redis.Redis"),
        ("def test_x(redis_server):\n    pass", "test_x takes the redis_server fixture"),
        ("import pytest\n@pytest.mark.integration\ndef test_x():\n    pass", "carries the integration marker"),
    ],
)
def test_each_unit_rule_names_what_breaks_it(source, problem):
    assert unit_problems(source) == [problem]


def test_a_unit_module_may_name_redis_errors_and_free_ports():
    assert unit_problems("import redis\nfrom workers import free_port\nredis.ConnectionError('x')") == []


@pytest.mark.parametrize(
    ("source", "marked"),
    [
        ("import pytest\npytestmark = pytest.mark.integration", True),
        ("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.integration]", True),
        ("import pytest\npytestmark = pytest.mark.slow", False),
        ("import pytest\n@pytest.mark.integration\ndef test_x():\n    pass", False),  # per test is not enough
    ],
)
def test_the_integration_mark_is_read_at_module_level_only(source, marked):
    assert marks_integration(ast.parse(source)) is marked
