"""A fast precision re-checked in float32 (TICKETQ_RECHECK), on the tiny stand-in: every label
equals float32's, each answer says which precision gave it, the bound is measured once per machine
and widened by what the live checks see. The tiny stand-in's int8 error is large (its two random
layers give near-ties everywhere), so a good share of its tickets is re-checked: the case to test."""

from __future__ import annotations

import json
import logging
import math

import pytest

from producer.synthetic import generate_tickets
from ticketq.fieldanswers import FieldResult
from ticketq.schema import TicketFields, load_schema
from worker.engine import Engine
from worker.engine.precision import decision_error
from worker.engine.replicas import load_engine
from worker.engine.scheduler import Exact, Unsettled
from worker.settings import Settings

SCHEMA = """
name = "triage"
[fields.category]
instruction = "Which team should handle the ticket?"
labels = ["billing", "technical", "account"]
threshold = 0.2
[fields.tags]
instruction = "Which of these does the ticket mention?"
labels = ["refund", "outage", "login"]
multi = true
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ticketq" / "precision"


def checked(tiny_settings, dtype: str = "int8", **changes) -> Engine:
    return load_engine(tiny_settings.model_copy(update={"dtype": dtype, "recheck": "always", **changes}))


@pytest.fixture
def texts() -> list[str]:
    return [t["text"] for t in generate_tickets(160, seed=23)] * 1


def test_int8_rechecked_gives_float32s_label_on_every_ticket(cache, tiny_settings, tiny_engine, texts):
    engine = checked(tiny_settings)
    assert engine.info.dtype == "int8" and engine.info.recheck and engine.policy.checked
    answers, reports = engine.classify(texts)
    exact, _ = tiny_engine.classify(texts)
    assert [a.label for a in answers] == [e.label for e in exact]
    rechecked = [a for a in answers if a.rechecked]
    assert rechecked and all(a.precision == "float32" for a in rechecked)  # the tiny model has near-ties
    assert all(a.precision == "int8" for a in answers if not a.rechecked)
    assert any(r.recheck for r in reports) and not all(r.recheck for r in reports)
    # raw int8 on the same tickets does differ somewhere: the re-check is what makes them equal
    engine.policy, policy = Exact(engine), engine.policy
    raw, _ = engine.classify(texts)
    assert [a.label for a in raw] != [e.label for e in exact]
    engine.policy = policy


def test_the_reference_of_a_checked_engine_is_float32s(cache, tiny_settings, tiny_engine, texts):
    engine = checked(tiny_settings, dtype="bfloat16")
    assert engine.model is not engine.policy.exact.model  # a float32 twin beside the bfloat16 copy
    for text in texts[:4]:
        assert engine.policy.reference(text) == tiny_engine.reference(text)
        assert engine.reference(text).precision == "bfloat16"  # the engine itself computes in its own precision
    answers, _ = engine.classify(texts)
    assert [a.label for a in answers] == [e.label for e in tiny_engine.classify(texts)[0]]


def test_the_bound_is_measured_once_per_machine_then_read(cache, tiny_settings, caplog):
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        first = checked(tiny_settings)
    assert "calibrated against float32" in caplog.text
    (path,) = cache.glob("int8-*.json")
    saved = json.loads(path.read_text())
    assert saved["measured"] == first.policy.bound.measured > 0
    caplog.clear()
    written = path.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        second = checked(tiny_settings)
    assert "calibrated" not in caplog.text and second.policy.bound.measured == first.policy.bound.measured
    assert path.stat().st_mtime_ns == written  # read, not written again at every start


def test_a_larger_error_seen_live_widens_the_bound_at_once(cache, tiny_settings, texts):
    engine = checked(tiny_settings)
    bound = engine.policy.bound
    before = bound.bound
    fast = engine.classify(texts[:1])[0][0]
    engine.policy, policy = Exact(engine), engine.policy  # the raw int8 answer, as a served one would be
    served = engine.classify(texts[:1])[0][0]
    engine.policy = policy
    wider = {name: p for name, p in served.probs.items()}
    labels = sorted(wider)
    wider[labels[0]], wider[labels[1]] = wider[labels[1]], wider[labels[0]]  # a reference far from it
    reference = type(served)(served.label, wider, served.margin, False, served.tokens)
    error = decision_error(served, reference)
    assert fast is not None and error > bound.measured
    engine.observe_shadow(served, reference)
    assert bound.measured == error and bound.bound > before
    assert engine.error_bounds() == {"default": ("int8", bound.bound)}


def test_every_field_of_a_schema_is_checked(cache, tmp_path, tiny_settings, tiny_engine, texts):
    path = tmp_path / "triage.toml"
    path.write_text(SCHEMA)
    schema = load_schema(path)
    engine = checked(tiny_settings)
    runner, exact = engine.fields(schema), tiny_engine.fields(schema)
    assert runner.policy.checked and "triage" in engine.error_bounds()
    answers, _ = runner.classify(texts)
    expected, _ = exact.classify(texts)
    for got, want in zip(answers, expected, strict=True):  # the labels and the review flags are float32's
        assert {n: (f.labels, f.review) for n, f in got.fields.items()} == {
            n: (f.labels, f.review) for n, f in want.fields.items()}
    assert any(a.rechecked for a in answers) and {a.precision for a in answers} <= {"int8", "float32"}


def test_a_shadow_check_measures_a_schema_answer_on_what_decides_it(cache, tmp_path, tiny_settings):
    """category has no review threshold here, so only its label decides: a reference whose two
    trailing labels' log-probabilities moved 3 apart each way (billing's lead over each by 3) widens
    the schema's bound to 3, where every two labels' difference (6) would count with a threshold."""
    path = tmp_path / "triage.toml"
    path.write_text(SCHEMA.replace("threshold = 0.2\n", ""))
    schema = load_schema(path)
    engine = checked(tiny_settings)
    engine.fields(schema)
    bound = engine.checks["triage"].bound
    assert bound.measured < 3.0  # the calibration's: below what the shadow check brings
    category, tags = schema.fields

    def answer(probs: dict[str, float], precision: str) -> TicketFields:
        total = sum(probs.values())
        results = {"category": FieldResult.single(category, {k: p / total for k, p in probs.items()}),
                   "tags": FieldResult.several(tags, {"refund": 0.9, "outage": 0.1, "login": 0.5})}  # fmt: skip
        return TicketFields("triage", results, 10, 10, None, precision=precision)

    served = answer({"billing": 0.98, "technical": 0.01, "account": 0.01}, "int8")
    reference = answer({"billing": 0.98, "technical": 0.01 * math.exp(-3), "account": 0.01 * math.exp(3)}, "float32")
    engine.observe_shadow(served, reference)
    assert bound.measured == pytest.approx(3.0, abs=1e-6)


def test_a_checked_worker_measures_its_schemas_bounds_before_its_first_job(cache, tmp_path, tiny_settings, caplog):
    from worker.service.routing import Routing

    path = tmp_path / "triage.toml"
    path.write_text(SCHEMA)
    settings = tiny_settings.model_copy(update={"dtype": "int8", "recheck": "always", "schemas": str(path)})
    engine = load_engine(settings)
    with caplog.at_level(logging.INFO, logger="worker.engine"):
        routing = Routing.of(engine, settings)
    assert routing.schemas.prefixes_computed == 1 and "triage" in engine.error_bounds()
    assert len(list(cache.glob("int8-*.json"))) == 2  # the engine's own field's bound and the schema's
    # The schema's calibration says when it starts and where it is, not only when it ends.
    messages = [record.getMessage() for record in caplog.records]
    steps = [next(i for i, m in enumerate(messages) if text in m) for text in (
        "int8 for schema triage: calibrating against float32", "int8 for schema triage: ", "calibrated against")]
    assert steps == sorted(steps), messages
    assert any("tickets answered in" in m and "now the float32 reference" in m for m in messages), messages


def test_off_the_fast_precision_answers_as_it_comes(cache, tiny_settings, texts):
    engine = load_engine(tiny_settings.model_copy(update={"dtype": "int8", "recheck": "never"}))
    assert not engine.policy.checked and not engine.info.recheck
    assert not any(isinstance(a, Unsettled) or a.rechecked for a in engine.classify(texts)[0])
    assert not list(cache.glob("*.json"))  # nothing measured


def test_float32_is_never_rechecked(cache, tiny_settings):
    assert not load_engine(tiny_settings.model_copy(update={"recheck": "always"})).policy.checked


def test_settings_default_to_rechecked_where_it_pays_and_deduplicated():
    assert Settings.model_fields["recheck"].default == "auto" and Settings.model_fields["dedup"].default is True
    assert [Settings(recheck=word).recheck for word in ("true", "0", "off", "always")] == [
        "auto", "never", "never", "always"]


@pytest.mark.parametrize(("speed", "share", "served"), [(3.0, 0.2, "int8"), (1.36, 0.52, "float32"),
                                                        (1.05, 0.0, "float32")])
def test_auto_serves_the_fast_precision_only_where_its_calibration_says_it_pays(cache, tiny_settings, monkeypatch,
                                                                               speed, share, served):  # fmt: skip
    """A fast precision 1.36x float32's with half its tickets re-checked runs at 0.81x: float32 is served."""
    from worker.engine import policy
    from worker.engine.precision import Calibration

    monkeypatch.setattr(policy, "calibrate", lambda *args, **kwargs: Calibration(0.1, 32, speed, share))
    engine = load_engine(tiny_settings.model_copy(update={"dtype": "int8", "recheck": "auto"}))
    assert engine.precision == served and engine.policy.checked == (served == "int8")


def test_a_live_share_that_makes_the_check_cost_more_than_it_saves_turns_it_off(cache, tiny_settings, texts,
                                                                                monkeypatch, caplog):  # fmt: skip
    from worker.engine import policy

    monkeypatch.setattr(policy, "LIVE_WINDOW", 40)
    engine = checked(tiny_settings)
    engine.policy.judged = True  # as TICKETQ_RECHECK=auto serves it (the tiny model's calibration would not)
    engine.policy.bound.speed = 1.2  # break-even at 1/6 of the answers re-checked; the tiny model has more
    with caplog.at_level(logging.WARNING, logger="worker.engine.policy"):
        answers, _ = engine.classify(texts)
    assert not engine.policy.pays and "answering in float32 from now on" in caplog.text
    later, _ = engine.classify(texts[:20])
    assert {a.precision for a in later} == {"float32"} and not any(a.rechecked for a in later)
    assert [a.label for a in answers[:20]] == [a.label for a in later]
    kept = checked(tiny_settings)  # TICKETQ_RECHECK=always: kept whatever the share
    kept.policy.bound.speed = 1.2
    assert any(a.rechecked for a in kept.classify(texts)[0]) and kept.policy.pays
