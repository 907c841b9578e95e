"""One worker, several schemas (`worker.engine.schemas.SchemaSet`), on the tiny stand-in (CPU, float32).

Tickets of different schemas in one run: each answer equals its schema's reference (the engine's
own field: `Engine.reference`; a schema's: `FieldsEngine.reference`), each schema's prefix is
computed once however many runs and forwards, a forward holds one schema's tickets, arrivals of
any schema join between forwards, and the cache of compiled schemas is bounded.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from producer.synthetic import generate_tickets
from ticketq.schema import TicketFields, load_schema
from ticketq_bench.procs import ROOT
from worker.engine.scheduler import PlannedRun, Ticketed, drain
from worker.engine.schemas import SchemaSet, UnknownSchema
from worker.results import Prediction

PROB_TOL = 1e-4  # batched vs reference, float32 (as tests/unit/test_engine.py)
SUPPORT = load_schema(ROOT / "examples" / "schema.toml")
TOPICS = load_schema(ROOT / "examples" / "schema-topics.toml")


@pytest.fixture
def schema_set(tiny_engine) -> SchemaSet:
    return SchemaSet(tiny_engine, [SUPPORT, TOPICS])


def texts(n: int, seed: int = 3) -> list[str]:
    return [ticket["text"] for ticket in generate_tickets(n, seed=seed)]


def assert_matches_reference(schema_set: SchemaSet, name: str, text: str, answer) -> None:
    runner = schema_set.runner(name)
    want = runner.reference(text)
    if isinstance(want, Prediction):
        assert isinstance(answer, Prediction) and answer.label == want.label
        assert max(abs(answer.probs[k] - want.probs[k]) for k in want.probs) < PROB_TOL
        return
    assert isinstance(answer, TicketFields) and answer.schema == name
    for field, expected in want.fields.items():
        got = answer.fields[field]
        assert got.labels == expected.labels, (name, field, text[:60])
        assert max(abs(got.probs[k] - expected.probs[k]) for k in expected.probs) < PROB_TOL
        assert got.review == expected.review


def test_mixed_schemas_in_one_run_equal_each_reference(schema_set, tiny_engine):
    names = ["support", "support-topics", "default"]
    items = [(names[i % 3], text) for i, text in enumerate(texts(18))]
    forwards = []
    answers, reports = schema_set.classify(items, on_batch=forwards.append)
    assert len(answers) == len(items) and len(forwards) == len(reports) >= 3  # one schema per forward at least
    for (name, text), answer in zip(items, answers, strict=True):
        assert_matches_reference(schema_set, name, text, answer)
    assert schema_set.default == "support" and set(schema_set.names) == {"support", "support-topics", "default"}
    assert schema_set.runner("default") is tiny_engine  # the engine's own field: today's path and answers


def test_each_prefix_is_computed_once_across_runs_and_forwards(schema_set):
    items = [("support" if i % 2 else "support-topics", text) for i, text in enumerate(texts(12))]
    schema_set.classify(items)
    schema_set.classify(list(reversed(items)))
    assert schema_set.prefixes_computed == 2
    reuses = {name: schema_set.runner(name).prefix_reuses for name in ("support", "support-topics")}
    assert all(count >= 2 for count in reuses.values()), reuses  # several forwards, one prefix each


def test_a_forward_holds_one_schema_and_the_oldest_waiting_goes_first(schema_set):
    """Which schema's tickets each forward computed, read from `on_answers`."""
    items = [("support-topics", t) for t in texts(3, seed=5)] + [("support", t) for t in texts(3, seed=6)]
    seen: list[set[str]] = []
    answers, _ = schema_set.classify(items, on_answers=lambda indices, got: seen.append({items[i][0] for i in indices}))
    assert all(len(names) == 1 for names in seen)
    assert seen[0] == {"support-topics"}  # its tickets came first
    assert {answer.schema for answer in answers} == {"support", "support-topics"}


def test_arrivals_of_another_schema_join_between_forwards(schema_set):
    first = [("support", t) for t in texts(4, seed=7)]
    later = [("support-topics", t) for t in texts(3, seed=8)] + [("default", t) for t in texts(2, seed=9)]
    batches = [later[:3], later[3:]]
    asked = []

    def more():
        asked.append(1)
        return batches.pop(0) if batches and len(asked) > 1 else []

    answers, _ = schema_set.classify(first, more=more)
    items = first + later
    assert len(answers) == len(items)
    for (name, text), answer in zip(items, answers, strict=True):
        assert_matches_reference(schema_set, name, text, answer)


def test_the_cache_of_compiled_schemas_is_bounded_least_recently_used_first(tiny_engine):
    schema_set = SchemaSet(tiny_engine, [SUPPORT, TOPICS], capacity=1)
    one = texts(2)
    schema_set.classify([("support", t) for t in one])
    schema_set.classify([("support", t) for t in one])
    assert schema_set.prefixes_computed == 1
    schema_set.classify([("support-topics", t) for t in one])  # drops support's
    schema_set.classify([("support", t) for t in one])
    assert schema_set.prefixes_computed == 3


def test_an_unknown_schema_names_the_ones_served(schema_set):
    assert "nope" not in schema_set
    with pytest.raises(UnknownSchema) as caught:
        schema_set.classify([("nope", "hello")])
    assert "support, support-topics, default" in str(caught.value)


def test_two_schemas_of_one_name_are_refused(tiny_engine):
    with pytest.raises(ValueError, match="two schemas are named 'support'"):
        SchemaSet(tiny_engine, [SUPPORT, SUPPORT.__class__(SUPPORT.name, TOPICS.fields)])


def test_planned_run_with_one_engine_is_the_engines_own_classify(tiny_engine):
    """`Engine.classify` is a one-engine PlannedRun: the same forwards as a run built by hand."""
    batch = texts(10, seed=11)
    want, want_reports = tiny_engine.classify(batch)
    run = PlannedRun()
    run.add([Ticketed(tiny_engine, encoded) for encoded in tiny_engine.encode(batch)])
    got, reports = drain(run)
    assert [p.label for p in got] == [p.label for p in want]
    assert [(r.rows, r.width) for r in reports] == [(r.rows, r.width) for r in want_reports]


def test_the_scheduler_and_the_planner_import_no_torch():
    """The scheduler is plain Python over the planner and the cost model: importing them loads no torch."""
    code = ("import sys; import worker.engine.scheduler, worker.engine.batching, worker.engine.cost; "
            "print('torch' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
