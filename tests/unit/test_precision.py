"""Float32's labels from a fast precision, without torch: decision gaps and errors
(`worker.engine.precision`), the error bound, and how the scheduler handles unsettled answers and
duplicate tickets (`worker.engine.scheduler`). The engines here are plain Python fakes; the real
engine's re-check is tested in test_recheck.py."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import pytest

from ticketq.schema import Field, FieldResult, TicketFields
from worker.engine.batching import plan_optimal
from worker.engine.cost import CostModel
from worker.engine.precision import (
    FLOOR,
    SAFETY,
    TAIL_CHANCE,
    Calibration,
    ErrorBound,
    calibrate,
    decision_error,
    decision_gap,
    envelope,
    fit_tail,
    load_calibration,
    tail_bound,
)
from worker.engine.prompt import EncodedTicket
from worker.engine.scheduler import DEFER_FORWARDS, PlannedRun, Ticketed, Unsettled, drain
from worker.results import Prediction, RunTally


def prediction(logprobs: dict[str, float], precision: str = "int8") -> Prediction:
    probs = {name: math.exp(lp) for name, lp in logprobs.items()}
    ranked = sorted(probs, key=probs.__getitem__, reverse=True)
    return Prediction(ranked[0], probs, probs[ranked[0]] - probs[ranked[1]], False, 3, precision=precision)


def normalised(scores: dict[str, float]) -> dict[str, float]:
    """Log-probs from scores (logits): a log-softmax."""
    top = max(scores.values())
    total = math.log(sum(math.exp(s - top) for s in scores.values())) + top
    return {name: s - total for name, s in scores.items()}


def test_a_gap_is_the_top_labels_log_probability_over_the_runner_ups():
    answer = prediction(normalised({"billing": 2.0, "technical": 1.5, "account": -3.0}))
    assert decision_gap(answer) == pytest.approx(0.5, abs=1e-9)


def test_the_error_is_the_largest_change_of_the_top_labels_lead_over_another():
    exact = prediction(normalised({"billing": 2.0, "technical": 1.5, "account": -3.0}), "float32")
    shifted = prediction(normalised({"billing": 2.3, "technical": 1.8, "account": -2.7}))  # every logit +0.3
    assert decision_error(shifted, exact) == pytest.approx(0.0, abs=1e-9)  # a shift changes no decision
    moved = prediction(normalised({"billing": 2.0, "technical": 1.7, "account": -3.1}))
    # billing's lead over technical shrinks by 0.2, over account grows by 0.1; technical against
    # account moved 0.3, but no label decision rests on that pair
    assert decision_error(moved, exact) == pytest.approx(0.2, abs=1e-9)
    below = prediction(normalised({"billing": 2.0, "technical": 1.6, "account": -2.6}))
    assert decision_error(below, exact) == pytest.approx(0.4, abs=1e-9)  # a lead that grew counts too


@pytest.mark.parametrize("seed", range(3))
def test_no_label_changes_under_an_error_smaller_than_the_gap(seed):
    """Random answers over several labels moved by random errors: wherever the label changed, the
    error measured on the fast answer's top label was at least its gap, and the top label's error is
    never more than any two labels' nor less than half of it."""
    import random

    rng = random.Random(seed)
    labels = [f"label{i}" for i in range(rng.choice((3, 6, 12)))]
    changed = 0
    for _ in range(2000):
        logits = {name: rng.gauss(0, 1.0) for name in labels}
        scale = rng.choice((0.01, 0.1, 0.5))
        exact = prediction(normalised(logits), "float32")
        fast = prediction(normalised({name: x + rng.uniform(-scale, scale) for name, x in logits.items()}))
        error = decision_error(fast, exact)
        every_pair = max(math.log(fast.probs[n] / exact.probs[n]) for n in labels) - min(
            math.log(fast.probs[n] / exact.probs[n]) for n in labels)  # fmt: skip
        assert every_pair / 2 - 1e-9 <= error <= every_pair + 1e-9
        if fast.label != exact.label:
            changed += 1
            assert error >= decision_gap(fast) - 1e-9
    assert changed > 20  # the test saw labels change


CATEGORY = Field("category", ("billing", "technical"))
TAGS = Field("tags", ("refund", "outage"), multi=True, select=0.5)


def fields_answer(single: dict[str, float], multi: dict[str, float], precision: str = "int8",
                  category: Field = CATEGORY, tags: Field = TAGS) -> TicketFields:  # fmt: skip
    return TicketFields("s", {"category": FieldResult.single(category, single),
                              "tags": FieldResult.several(tags, multi)}, 3, 3, None, precision=precision)  # fmt: skip


def test_a_schema_gap_is_its_closest_decision_over_every_field():
    answer = fields_answer({"billing": 0.7, "technical": 0.3}, {"refund": 0.9, "outage": 0.45})
    single = math.log(0.7) - math.log(0.3)
    multi = abs(math.log(0.45 / 0.55))  # outage's log-odds against select 0.5's (zero)
    assert decision_gap(answer, {"category": CATEGORY, "tags": TAGS}) == pytest.approx(min(single, multi), abs=1e-9)
    at_select = replace(TAGS, select=0.9)  # refund sits on select 0.9
    assert decision_gap(answer, {"tags": at_select}) == pytest.approx(0.0, abs=1e-6)
    exact = fields_answer({"billing": 0.7, "technical": 0.3}, {"refund": 0.9, "outage": 0.55}, "float32")
    assert decision_error(answer, exact) == pytest.approx(2 * abs(math.log(0.45 / 0.55)), abs=1e-6)


def test_a_field_without_a_review_threshold_is_measured_on_its_top_labels_leads():
    """billing leads; technical's log-probability moved +0.1, account's -0.1: the label decision can
    carry 0.1 (billing's lead over each moved by 0.1), any two labels' difference 0.2. A review
    threshold makes every probability's move count; without the field's spec, so does the error."""
    three = Field("category", ("billing", "technical", "account"))
    fast = {"billing": 0.5, "technical": 0.3, "account": 0.2}
    exact = {"billing": 0.5, "technical": 0.3 / math.exp(0.1), "account": 0.2 * math.exp(0.1)}
    tags = {"refund": 0.9, "outage": 0.1}
    answer, reference = fields_answer(fast, tags, category=three), fields_answer(exact, tags, "float32", three)
    assert decision_error(answer, reference, {"category": three, "tags": TAGS}) == pytest.approx(0.1, abs=1e-9)
    reviewed = replace(three, threshold=0.35)
    assert decision_error(answer, reference, {"category": reviewed, "tags": TAGS}) == pytest.approx(0.2, abs=1e-9)
    assert decision_error(answer, reference) == pytest.approx(0.2, abs=1e-9)


def test_a_review_threshold_is_a_decision_too():
    """confidence 0.4 (0.7 - 0.3) against threshold 0.35: settled while (0.7 + 0.3)(e^gap - 1) < 0.05."""
    category = replace(CATEGORY, threshold=0.35)
    answer = fields_answer({"billing": 0.7, "technical": 0.3}, {"refund": 0.99, "outage": 0.01}, category=category)
    fields = {"category": category, "tags": TAGS}
    assert not answer.fields["category"].review
    assert decision_gap(answer, fields) == pytest.approx(math.log1p(0.05 / 1.0), abs=1e-9)
    assert decision_gap(answer, {"category": CATEGORY, "tags": TAGS}) > 0.5  # no threshold: only the labels
    tags = replace(TAGS, threshold=0.97)  # multi: min |p - 0.5| / 0.5 = 0.98, p(1-p) = 0.0099 at most
    answer = fields_answer({"billing": 0.9, "technical": 0.1}, {"refund": 0.99, "outage": 0.01}, tags=tags)
    gap = decision_gap(answer, {"category": CATEGORY, "tags": tags})
    assert gap == pytest.approx(math.log1p(0.01 * 0.5 / 0.0099), abs=1e-6)


@pytest.mark.parametrize("review", (0.2, 0.0))
@pytest.mark.parametrize("seed", range(3))
def test_no_decision_changes_under_an_error_smaller_than_the_gap(seed, review):
    """Random answers moved by random errors: wherever a label, a chosen label or a review flag
    changed, the error measured was at least the answer's gap (the bound's promise); with the
    single-label field's review threshold (every label's move counts) and without (its top's leads)."""
    import random

    rng = random.Random(seed)
    category = replace(CATEGORY, labels=("billing", "technical", "account"), threshold=review)
    tags = replace(TAGS, threshold=0.3)
    fields = {"category": category, "tags": tags}
    changed = 0
    for _ in range(2000):
        logits = {name: rng.gauss(0, 1.5) for name in category.labels}
        odds = {name: rng.gauss(0, 2.0) for name in tags.labels}
        scale = rng.choice((0.01, 0.1, 0.5))
        moved = {name: x + rng.uniform(-scale, scale) for name, x in logits.items()}
        moved_odds = {name: x + rng.uniform(-scale, scale) for name, x in odds.items()}
        exact = _schema_answer(logits, odds, category, tags, "float32")
        fast = _schema_answer(moved, moved_odds, category, tags, "int8")
        differs = any(fast.fields[n].labels != exact.fields[n].labels or fast.fields[n].review != exact.fields[n].review
                      for n in fields)  # fmt: skip
        if differs:
            changed += 1
            assert decision_error(fast, exact, fields) >= decision_gap(fast, fields) - 1e-9
    assert changed > 20  # the test saw decisions change


def _schema_answer(logits: dict[str, float], odds: dict[str, float], category: Field, tags: Field,
                   precision: str) -> TicketFields:  # fmt: skip
    probs = {name: math.exp(lp) for name, lp in normalised(logits).items()}
    yes = {name: 1.0 / (1.0 + math.exp(-x)) for name, x in odds.items()}
    return fields_answer(probs, yes, precision, category=category, tags=tags)


def test_the_bound_only_widens_and_is_saved_at_once(tmp_path):
    path = tmp_path / "bound.json"
    bound = ErrorBound("int8", Calibration(0.1, 16, 0.0, 0.0, 0.0, 0.1), path)
    assert bound.bound == pytest.approx(0.1 * SAFETY)
    assert bound.unsettled(prediction(normalised({"a": 0.15, "b": 0.0})))
    assert not bound.unsettled(prediction(normalised({"a": 0.25, "b": 0.0})))
    assert not bound.observe(0.05, "test") and bound.measured == 0.1  # smaller: kept
    assert bound.observe(0.3, "test") and bound.bound == pytest.approx(0.3 * SAFETY)
    assert load_calibration(path) == Calibration(0.3, 18, 0.0, 0.0, 0.0, 0.3)
    assert not bound.observe(math.nan, "test")
    assert ErrorBound("bfloat16", Calibration(0.0, 1, 0.0, 0.0)).bound == FLOOR  # never under float32's own rounding


def test_the_bound_grows_with_the_ticket_as_its_calibration_measured():
    """Errors that grow as the square root of the length: the envelope takes exponent 0.5, and a short
    ticket is held to a tighter bound than the flat one (SAFETY x the largest error)."""
    errors = [(tokens, 0.01 * math.sqrt(tokens)) for tokens in (16, 64, 256, 400)]
    exponent, rate = envelope(errors)
    assert exponent == 0.5 and rate == pytest.approx(0.01)
    bound = ErrorBound("bfloat16", Calibration(0.2, 4, 0.0, 0.0, exponent, rate))
    assert bound.bound_at(16) == pytest.approx(0.08) and bound.bound_at(400) == pytest.approx(0.4) == bound.bound
    short = replace(prediction(normalised({"a": 0.1, "b": 0.0})), tokens=16)  # gap 0.1: over 0.08
    assert not bound.unsettled(short) and bound.unsettled(replace(short, tokens=400))
    assert envelope([(16, 0.1), (400, 0.1)]) == (0.0, 0.1)  # flat errors: a flat bound


def test_a_live_error_above_the_envelope_at_its_length_widens_it():
    bound = ErrorBound("bfloat16", Calibration(0.2, 4, 0.0, 0.0, 0.5, 0.01))
    assert not bound.observe(0.15, "re-check", tokens=400)  # under 0.01 x 20 at that length: kept
    assert bound.observe(0.15, "shadow check", tokens=100)  # 0.015 per sqrt-token: the envelope rises
    assert bound.rate == pytest.approx(0.015) and bound.bound_at(400) == pytest.approx(0.6)


def exponential_errors(n: int, scale: float) -> list[float]:
    """n errors at the quantiles of an exponential of `scale`: a sample with no luck in it."""
    return [-scale * math.log(1 - (i + 0.5) / n) for i in range(n)]


def test_the_tail_fit_bounds_the_error_a_ticket_exceeds_with_the_stated_chance():
    """Exponential errors of scale 0.01: one ticket in 10,000 exceeds 0.092. The fitted tail's bound
    is above that (its scale taken at 99% confidence from 25 excesses) and not far above it."""
    errors = exponential_errors(128, 0.01)
    tail = fit_tail(errors)
    truth = -0.01 * math.log(TAIL_CHANCE)
    assert truth < tail.bound() < 1.7 * truth
    assert tail.chance(tail.bound()) == pytest.approx(TAIL_CHANCE)
    assert fit_tail(errors[:30]) is None and tail_bound(errors[:30]) == 0.0  # 6 excesses: too few to fit


def test_a_calibration_whose_largest_error_was_lucky_is_bounded_by_its_tail():
    """128 calibration tickets whose errors are exponential but none above the 90th percentile: SAFETY
    x the largest would trust that luck; the bound is the tail's, the wider. With the whole sample,
    the wider of the two all the same."""
    def run(errors: list[float]) -> ErrorBound:
        texts = [str(i) for i in range(len(errors))]
        fast = {t: prediction({"a": 0.0, "b": -1.0 - e}, "bfloat16") for t, e in zip(texts, errors, strict=True)}
        exact = prediction({"a": 0.0, "b": -1.0}, "float32")
        calibration = calibrate("bfloat16", lambda batch: [fast[t] for t in batch], lambda batch: [exact] * len(batch),
                                texts=texts)  # fmt: skip
        return ErrorBound("bfloat16", calibration)

    whole = exponential_errors(128, 0.01)
    lucky = [min(e, whole[115]) for e in whole]
    assert tail_bound(lucky) > 1.5 * SAFETY * max(lucky)
    assert run(lucky).bound == pytest.approx(tail_bound(lucky))
    assert run(whole).bound == pytest.approx(max(SAFETY * max(whole), tail_bound(whole)))


def test_the_predicted_gain_counts_each_recheck_as_a_float32_answer():
    assert Calibration(0.1, 32, 2.0, 0.0).gain == pytest.approx(2.0)
    assert Calibration(0.1, 32, 2.0, 0.5).gain == pytest.approx(1.0)  # break-even: half re-checked at 2x
    assert Calibration(0.1, 32, 1.36, 0.525).gain == pytest.approx(0.79, abs=0.01)  # int8 on the AVX2 stand-in
    assert Calibration(0.1, 32, 0.0, 0.0).gain == 0.0  # not timed: never served


def test_the_bound_is_widened_safely_from_two_threads(tmp_path):
    bound = ErrorBound("int8", Calibration(0.0, 0, 0.0, 0.0), tmp_path / "b.json")
    threads = [threading.Thread(target=lambda k=k: [bound.observe(k + i / 1000, "t") for i in range(200)])
               for k in range(4)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bound.measured == pytest.approx(3.199) and bound.samples == 800


# ----- the scheduler: duplicates once, unsettled answers re-checked ------------------------------


class FakeEngine:
    """Tickets are strings; an answer is (text, engine name). It is its own policy: `unsure` texts
    are screened `Unsettled` for `recheck`."""

    deferred = False

    def __init__(self, name: str, unsure: set[str] = frozenset(), recheck=None, rows: int = 4) -> None:
        self.name, self.unsure, self.recheck, self.rows = name, unsure, recheck, rows
        self.forwards: list[list[str]] = []
        self.max_batch_tokens = 1024
        self.policy, self.checked = self, recheck is not None

    def route(self, encoded):
        return self

    def screen(self, engine, answers):
        return [Unsettled(a, self.recheck) if a[0] in self.unsure else a for a in answers]

    def encode(self, texts):
        return [EncodedTicket(tuple(ord(ch) for ch in text), len(text), False) for text in texts]

    def plan(self, encoded):
        return plan_optimal([len(e.ids) for e in encoded], max_batch_tokens=self.max_batch_tokens,
                            max_batch_size=self.rows, cost=CostModel(fixed_ms=25.0, token_ms=0.8))  # fmt: skip

    def forward_batch(self, tickets, width=None):
        texts = ["".join(map(chr, t.ids)) for t in tickets]
        self.forwards.append(texts)
        return [(t, self.name) for t in texts]


class FakeRecheck(FakeEngine):
    deferred = True

    def settle(self, fast, exact):
        assert fast[0] == exact[0]
        return (exact[0], "settled")


def run(engine, texts, dedup=True, runs=None):
    answered: list[tuple[int, object]] = []
    planned = PlannedRun(dedup=dedup, runs=runs)
    planned.add([Ticketed(engine, e) for e in engine.encode(texts)])
    results, reports = drain(planned, on_answers=lambda idx, ans: answered.extend(zip(idx, ans, strict=True)))
    return planned, results, reports, answered


def test_duplicates_are_computed_once_and_each_gets_its_answer():
    engine = FakeEngine("fast")
    texts = ["outage", "refund", "outage", "outage", "login"]
    runs = RunTally()
    planned, results, _, answered = run(engine, texts, runs=runs)
    computed = [t for forward in engine.forwards for t in forward]
    assert sorted(computed) == ["login", "outage", "refund"]
    assert results == [(t, "fast") for t in texts]
    assert sorted(i for i, _ in answered) == [0, 1, 2, 3, 4]  # every copy published once, under its own index
    assert planned.duplicates == 2 and runs.deduplicated == 2
    engine.forwards.clear()
    run(engine, texts, dedup=False)
    assert sorted(t for forward in engine.forwards for t in forward) == sorted(texts)


def test_a_duplicate_arriving_after_its_twin_was_answered_gets_it_at_once():
    engine = FakeEngine("fast")
    answered = []
    planned = PlannedRun()
    arrivals = [["outage"], []]
    planned.add([Ticketed(engine, e) for e in engine.encode(["outage"])])
    more = lambda: [Ticketed(engine, e) for e in engine.encode(arrivals.pop(0))] if arrivals else []  # noqa: E731
    results, _ = drain(planned, on_answers=lambda idx, ans: answered.extend(idx), more=more)
    assert results == [("outage", "fast")] * 2 and len(engine.forwards) == 1 and sorted(answered) == [0, 1]


def test_unsettled_answers_are_recomputed_by_the_recheck_and_only_settled_ones_go_out():
    recheck = FakeRecheck("float32")
    engine = FakeEngine("fast", unsure={"bb", "dddd", "ffffff"}, recheck=recheck, rows=2)
    texts = ["a", "bb", "ccc", "dddd", "eeeee", "ffffff", "bb"]
    planned, results, reports, answered = run(engine, texts)
    for text, answer in zip(texts, results, strict=True):
        assert answer == (text, "settled" if text in engine.unsure else "fast")
    assert sorted(i for i, _ in answered) == list(range(len(texts)))  # each once, the settled answer only
    assert dict(answered)[6] == ("bb", "settled")  # a copy of an unsettled ticket waits for its settled answer
    assert sorted(t for forward in recheck.forwards for t in forward) == ["bb", "dddd", "ffffff"]
    assert planned.rechecked == 3 and sum(r.recheck for r in reports) == len(recheck.forwards)


def test_rechecks_are_batched_but_wait_at_most_a_bounded_number_of_forwards():
    """While the fast engine has work, re-checks gather; the oldest runs within DEFER_FORWARDS forwards."""
    recheck = FakeRecheck("float32", rows=64)
    texts = [f"t{i:03d}" for i in range(40)]
    engine = FakeEngine("fast", unsure={texts[0]}, recheck=recheck, rows=1)
    order = []
    engine.forward_batch = (lambda original: lambda tickets, width=None: (order.append("fast"),
                            original(tickets, width))[1])(engine.forward_batch)  # fmt: skip
    recheck.forward_batch = (lambda original: lambda tickets, width=None: (order.append("recheck"),
                             original(tickets, width))[1])(recheck.forward_batch)  # fmt: skip
    run(engine, texts)
    first = order.index("recheck")
    assert order.count("recheck") == 1 and 0 < first <= 1 + DEFER_FORWARDS


def test_only_deferred_engines_waiting_still_run():
    recheck = FakeRecheck("float32")
    engine = FakeEngine("fast", unsure={"x", "y"}, recheck=recheck)
    _, results, _, _ = run(engine, ["x", "y"])
    assert results == [("x", "settled"), ("y", "settled")]


def test_a_fast_answer_keeps_its_precision_and_a_rechecked_one_says_so():
    fast = prediction(normalised({"a": 0.1, "b": 0.0}))
    assert fast.precision == "int8" and not fast.rechecked
    settled = replace(prediction(normalised({"a": 0.0, "b": 0.1}), "float32"), rechecked=True)
    assert settled.precision == "float32" and settled.rechecked and settled.label == "b"
