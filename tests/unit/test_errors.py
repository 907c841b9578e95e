"""One error base: every exception class the project defines derives from `TicketqError`.

The modules are found by walking the package folders, so a new module or a new exception class
is checked without being listed here. Only the two that are not errors stand outside it (see
`ticketq.errors`).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from ticketq.errors import TicketqError
from ticketq.exits import EXIT_USAGE

ROOT = Path(__file__).resolve().parents[2]
NOT_ERRORS = {"producer.errors.SendInterrupted", "worker.errors.CannotStart"}  # a Ctrl-C and an exit


def _project_modules() -> list[str]:
    names = []
    for package in ("ticketq", "producer", "worker"):
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _exception_classes() -> dict[str, type]:
    found = {}
    for name in _project_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                found[f"{name}.{value.__qualname__}"] = value
    return found


def test_every_project_exception_derives_from_the_base():
    classes = _exception_classes()
    assert len(classes) > 20, sorted(classes)  # the walk found the modules: not vacuously true
    assert classes.keys() >= NOT_ERRORS
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, TicketqError))
    assert outside == sorted(NOT_ERRORS)


def test_the_two_outside_are_not_caught_as_exceptions():
    classes = _exception_classes()
    for name in NOT_ERRORS:
        assert not issubclass(classes[name], Exception), name


@pytest.mark.parametrize(("module", "name", "builtin"), [
    ("ticketq.contract", "TicketRejected", ValueError),
    ("ticketq.config", "SettingsError", ValueError),
    ("ticketq.connections", "RedisUnavailable", ConnectionError),
    ("worker.engine.schemas", "UnknownSchema", KeyError),
])  # fmt: skip
def test_errors_keep_the_builtin_base_callers_catch(module, name, builtin):
    assert issubclass(getattr(importlib.import_module(module), name), builtin)


def test_repr_is_the_class_and_the_message():
    from producer.ticketrows import TicketFileError

    error = TicketFileError("t.csv:1: CSV header must name a 'text' column")
    assert repr(error) == "TicketFileError(\"t.csv:1: CSV header must name a 'text' column\")"
    assert str(error) == "t.csv:1: CSV header must name a 'text' column"


def test_the_worker_refuses_to_start_with_the_usage_status():
    from worker.app import CannotStart

    assert CannotStart("fix it").code == EXIT_USAGE
