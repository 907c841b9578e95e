"""The start-up guard names every private name of another library that ticketq relies on.

Each guarded name is taken away from a copy of its owner in turn, and the check must name it:
a rename in a new Celery, kombu or celery-batches release stops the worker at start-up, loudly,
instead of switching a fix off in silence. No Redis, no torch.
"""

from __future__ import annotations

import linecache

import pytest
from celery import Celery

from worker.redis import celery_results
from worker.transport import guards


def _without(owner, name):
    """A copy of `owner` (a class, even for a module) with every attribute the guard asks about but `name`."""
    copy = type("copy", (), {n: getattr(owner, n) for n in guards.REQUIRED[owner] if n != name})
    copy.__module__, copy.__qualname__ = "copy", getattr(owner, "__qualname__", owner.__name__)
    return copy


REQUIRED = [(owner, name) for owner, names in guards.REQUIRED.items() for name in names]
ASSIGNED = [(key, name) for key, names in guards.ASSIGNED.items() for name in names]


def test_every_guarded_name_exists_in_the_installed_libraries():
    assert guards.missing_names() == []
    guards.check_versions()


@pytest.mark.parametrize(("owner", "name"), REQUIRED, ids=[f"{guards._name(o)}.{n}" for o, n in REQUIRED])
def test_a_missing_class_or_module_attribute_is_named(owner, name):
    required = {**guards.REQUIRED, owner: ()}
    required[_without(owner, name)] = guards.REQUIRED[owner]
    missing = guards.missing_names(required, guards.ASSIGNED)
    assert missing == [f"copy.{getattr(owner, '__qualname__', owner.__name__)}.{name}"]


@pytest.mark.parametrize(("key", "name"), ASSIGNED, ids=[f"{guards._name(k[0])}.{n}" for k, n in ASSIGNED])
def test_a_missing_instance_attribute_is_named(key, name):
    owner, function = key
    others = [n for n in guards.ASSIGNED[key] if n != name]
    body = "".join(f"    self.{n} = None\n" for n in others) or "    pass\n"
    source, filename, namespace = f"def {function}(self):\n{body}", f"<guards-copy-{name}>", {}
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for inspect.getsource
    exec(compile(source, filename, "exec"), namespace)  # the same function, without that assignment
    copy = type(owner.__name__, (), {function: namespace[function], "__module__": "copy"})
    copy.__qualname__ = owner.__qualname__
    assigned = {k: v for k, v in guards.ASSIGNED.items() if k != key} | {(copy, function): guards.ASSIGNED[key]}
    assert guards.missing_names(guards.REQUIRED, assigned) == [f"copy.{owner.__qualname__}.{name}"]


def test_a_renamed_heart_step_stops_the_start(monkeypatch):
    from celery.worker.consumer import Consumer

    monkeypatch.setattr(Consumer.Blueprint, "default_steps",
                        [s for s in Consumer.Blueprint.default_steps if s != guards_heart()])  # fmt: skip
    with pytest.raises(guards.IncompatibleLibrary, match="Heart"):
        guards.check_versions()


def guards_heart() -> str:
    return guards.HEART_STEP


def test_the_result_meta_the_outbox_writes_is_celerys(monkeypatch):
    app = Celery("probe", backend="redis://127.0.0.1:1/0", set_as_current=False)
    celery_results.check_result_meta(app.backend)  # builds the meta only: nothing is sent
    real = celery_results.success_meta

    def without_children(*args):
        return {key: value for key, value in real(*args).items() if key != "children"}

    monkeypatch.setattr(celery_results, "success_meta", without_children)
    with pytest.raises(guards.IncompatibleLibrary, match="children"):
        celery_results.check_result_meta(app.backend)
