"""The precision policy the scheduler consults (`worker.engine.policy.Checked`), with fixed error
sequences and plain-Python engines: a long ticket routed straight to float32 once its length bucket
re-checks more than the break-even share, a short one held to the tight bound and computed fast, the
probe that keeps measuring a straight bucket, and the judgement that stops serving a precision
that no longer pays. The real engine's re-check is tested in test_recheck.py."""

from __future__ import annotations

import math

import pytest

from worker.engine.batching import plan_optimal
from worker.engine.cost import CostModel
from worker.engine.policy import MIN_SEEN, PROBE_EVERY, Checked, LengthRoute
from worker.engine.precision import Calibration, ErrorBound
from worker.engine.prompt import EncodedTicket
from worker.engine.scheduler import Exact, PlannedRun, Ticketed, drain
from worker.results import Prediction


class Engine:
    """Tickets are token-id tuples; the answer's gap is `gap(tokens)` (log space), two labels."""

    deferred = False
    max_batch_tokens = 4096

    def __init__(self, precision: str, gap) -> None:
        self.precision, self.gap = precision, gap
        self.policy = Exact(self)
        self.computed: list[int] = []  # each computed ticket's length

    def encode(self, texts):
        return [EncodedTicket(tuple(range(int(t))), int(t), False) for t in texts]

    def plan(self, encoded):
        return plan_optimal([len(e.ids) for e in encoded], max_batch_tokens=self.max_batch_tokens,
                            max_batch_size=8, cost=CostModel(fixed_ms=25.0, token_ms=0.8))  # fmt: skip

    def forward_batch(self, tickets, width=None):
        self.computed += [len(t.ids) for t in tickets]
        return [self.answer(len(t.ids)) for t in tickets]

    def answer(self, tokens: int) -> Prediction:
        top = 1.0 / (1.0 + math.exp(-self.gap(tokens)))  # log(top / rest) == gap
        return Prediction("a", {"a": top, "b": 1.0 - top}, 2 * top - 1, False, tokens, precision=self.precision)


def checked(gap=lambda tokens: 0.05, speed: float = 2.0) -> tuple[Checked, Engine, Engine]:
    """A bf16 engine held to a float32 twin; bound 2 x 0.01 x sqrt(tokens): 0.08 at 16 tokens, 0.4 at 400."""
    fast, exact = Engine("bfloat16", gap), Engine("float32", gap)
    policy = Checked(fast, exact, ErrorBound("bfloat16", Calibration(0.2, 48, speed, 0.0, 0.5, 0.01)))
    fast.policy = policy
    return policy, fast, exact


def classify(engine: Engine, lengths: list[int]) -> list[Prediction]:
    run = PlannedRun()
    run.add([Ticketed(engine, e) for e in engine.encode(lengths)])
    return drain(run)[0]


def test_a_short_ticket_is_held_to_the_tight_bound_and_a_long_one_rechecked():
    policy, fast, exact = checked()
    policy.bound.rate = 0.002  # bound 0.016 at 16 tokens, 0.08 at 400; every gap is 0.05
    answers = classify(fast, [16, 400])
    assert [a.rechecked for a in answers] == [False, True]
    assert sorted(fast.computed) == [16, 400] and exact.computed == [400]  # the long one computed twice


def test_a_bucket_that_rechecks_past_break_even_goes_straight_to_float32():
    policy, fast, exact = checked()
    policy.bound.rate = 0.002
    classify(fast, [*range(400, 400 + MIN_SEEN), *range(16, 16 + MIN_SEEN)])  # each ~400-token one re-checked
    fast.computed.clear(), exact.computed.clear()
    answers = classify(fast, [420, 421, 17])  # new tickets of the same buckets
    assert sorted(exact.computed) == [420, 421] and fast.computed == [17]  # straight: computed once, in float32
    assert [a.precision for a in answers] == ["float32", "float32", "bfloat16"]
    assert not any(a.rechecked for a in answers)


def test_a_straight_bucket_is_still_probed_so_its_share_is_measured_again():
    route = LengthRoute(break_even=0.5)
    for _ in range(MIN_SEEN):
        route.observe(300, unsettled=True)
    sent = [route.straight(300) for _ in range(3 * PROBE_EVERY)]
    assert sent.count(False) == 3  # one in PROBE_EVERY goes fast
    for _ in range(4 * MIN_SEEN):  # the probes find it settled now: the share falls below break-even
        route.observe(300, unsettled=False)
    assert not route.straight(300)


@pytest.mark.parametrize(("speed", "straight"), [(2.0, False), (1.25, True)])
def test_break_even_is_where_computing_twice_costs_what_float32_alone_does(speed, straight):
    """A 40% re-check share: at 2x float32's speed it still pays (0.5 + 0.4 < 1), at 1.25x it does not
    (0.8 + 0.4 > 1)."""
    route = LengthRoute(break_even=1.0 - 1.0 / speed)
    for k in range(MIN_SEEN * 5):
        route.observe(300, unsettled=k % 5 < 2)
    assert route.straight(300) is straight


def test_a_window_that_predicts_it_slower_than_float32_sends_everything_straight(monkeypatch):
    from worker.engine import policy as module

    monkeypatch.setattr(module, "LIVE_WINDOW", 32)
    policy, fast, exact = checked(gap=lambda tokens: 0.01, speed=1.2)  # every answer within the bound
    classify(fast, [20 + k for k in range(32)])
    assert not policy.pays
    exact.computed.clear(), fast.computed.clear()
    classify(fast, [100, 101])
    assert fast.computed == [] and sorted(exact.computed) == [100, 101]


def test_the_reference_of_a_checked_runner_is_its_twins():
    policy, fast, exact = checked()
    fast.reference = lambda text: ("bf16", text)
    exact.reference = lambda text: ("float32", text)
    assert policy.reference("x") == ("float32", "x") and Exact(fast).reference("x") == ("bf16", "x")
