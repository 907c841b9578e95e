"""Unit tests for worker.engine.batching: planners, padding arithmetic, cost model fit. No torch."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from worker.engine.batching import (
    Batch,
    Plan,
    plan_fixed,
    plan_global_pad,
    plan_greedy_sorted,
    plan_optimal,
    plan_sequential,
    sort_by_length,
)
from worker.engine.cost import CostModel

PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = settings(max_examples=100, deadline=None)

lengths_st = st.lists(st.integers(1, 600), max_size=80)
# Small integer-ish values as well as arbitrary ones, so ties between plans get exercised.
coef_st = st.one_of(st.integers(0, 50).map(float), st.floats(0, 100, allow_nan=False))
cost_st = st.builds(
    CostModel,
    fixed_ms=coef_st,
    token_ms=st.one_of(st.integers(0, 3).map(float), st.floats(0, 2)),
    quad_ms=st.one_of(st.just(0.0), st.floats(0, 0.01)),
)
budget_tokens_st = st.integers(1, 4096)
budget_rows_st = st.integers(1, 64)


def _all_planners(lengths, max_batch_tokens, max_batch_size, cost):
    return {
        "optimal": plan_optimal(
            lengths, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, cost=cost
        ),
        "greedy": plan_greedy_sorted(
            lengths, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size
        ),
        "fixed": plan_fixed(lengths, max_batch_size),
        "fixed_sorted": plan_fixed(lengths, max_batch_size, sort=True),
        "global": plan_global_pad(lengths, max_batch_size),
        "sequential": plan_sequential(lengths),
    }


def _feasible(plan: Plan, max_batch_tokens: int, max_batch_size: int) -> bool:
    """Within budgets, or the documented exception: an oversize item alone in its batch."""
    return all(
        b.rows <= max_batch_size
        and (b.computed_tokens <= max_batch_tokens or (b.rows == 1 and b.lengths[0] > max_batch_tokens))
        for b in plan.batches
    )


def _le(a: float, b: float) -> bool:
    """a <= b up to float summation order (plans add the same terms in different orders)."""
    return a <= b + 1e-9 * max(1.0, abs(b))


def _block_ms(lengths, block, max_batch_tokens, max_batch_size, cost) -> float:
    """Cost of running `block` (indices) as one batch, inf if it breaks a budget."""
    rows, width = len(block), max(lengths[i] for i in block)
    if rows > max_batch_size or (rows * width > max_batch_tokens and rows > 1):
        return float("inf")
    return cost.batch_ms(rows, width)


def _brute_contiguous(lengths, max_batch_tokens, max_batch_size, cost) -> float:
    order = sort_by_length(lengths)
    n, best = len(order), float("inf") if order else 0.0
    for mask in range(1 << (n - 1) if n else 0):
        cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
        blocks = [order[lo:hi] for lo, hi in itertools.pairwise(cuts)]
        best = min(best, sum(_block_ms(lengths, b, max_batch_tokens, max_batch_size, cost) for b in blocks))
    return best


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [[first], *part]
        for k in range(len(part)):
            yield [*part[:k], [first, *part[k]], *part[k + 1 :]]


def _brute_any_partition(lengths, max_batch_tokens, max_batch_size, cost) -> float:
    return min(
        sum(_block_ms(lengths, b, max_batch_tokens, max_batch_size, cost) for b in part)
        for part in _set_partitions(list(range(len(lengths))))
    )


# --- properties of every planner ---


@PROPS
@given(lengths_st, budget_tokens_st, budget_rows_st, cost_st)
def test_every_index_exactly_once(lengths, max_batch_tokens, max_batch_size, cost):
    for name, plan in _all_planners(lengths, max_batch_tokens, max_batch_size, cost).items():
        assert sorted(plan.order()) == list(range(len(lengths))), name
        for b in plan.batches:
            assert b.lengths == tuple(lengths[i] for i in b.indices), name
            assert b.width >= max(b.lengths), name
        assert plan.real_tokens == sum(lengths), name
        assert plan.computed_tokens == plan.real_tokens + plan.pad_tokens, name


@PROPS
@given(lengths_st, budget_tokens_st, budget_rows_st, cost_st)
def test_budgeted_planners_respect_budgets_and_sort(lengths, max_batch_tokens, max_batch_size, cost):
    plans = _all_planners(lengths, max_batch_tokens, max_batch_size, cost)
    for name in ("optimal", "greedy"):
        plan = plans[name]
        assert _feasible(plan, max_batch_tokens, max_batch_size), name
        run = [lengths[i] for i in plan.order()]
        assert run == sorted(run), name
        assert all(b.width == max(b.lengths) for b in plan.batches), name
    assert all(b.rows == 1 for b in plans["sequential"].batches)


@PROPS
@given(lengths_st, budget_tokens_st, budget_rows_st, cost_st)
def test_optimal_beats_every_feasible_baseline(lengths, max_batch_tokens, max_batch_size, cost):
    plans = _all_planners(lengths, max_batch_tokens, max_batch_size, cost)
    best = plans["optimal"].predicted_ms(cost)
    for name, plan in plans.items():
        if _feasible(plan, max_batch_tokens, max_batch_size):
            assert _le(best, plan.predicted_ms(cost)), name
    # Greedy and sequential are always feasible, so they are always compared.
    assert _feasible(plans["greedy"], max_batch_tokens, max_batch_size)
    assert _feasible(plans["sequential"], max_batch_tokens, max_batch_size)


@PROPS
@given(st.lists(st.integers(1, 60), max_size=8), st.integers(1, 200), st.integers(1, 8), cost_st)
def test_optimal_equals_brute_force_over_contiguous_partitions(
    lengths, max_batch_tokens, max_batch_size, cost
):
    plan = plan_optimal(lengths, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, cost=cost)
    assert plan.predicted_ms(cost) == pytest.approx(
        _brute_contiguous(lengths, max_batch_tokens, max_batch_size, cost), rel=1e-9, abs=1e-9
    )


@SMALL
@given(st.lists(st.integers(1, 40), max_size=6), st.integers(1, 120), st.integers(1, 6), cost_st)
def test_optimal_is_optimal_over_all_partitions(lengths, max_batch_tokens, max_batch_size, cost):
    # Holds because CostModel coefficients are >= 0 (monotone cost): see plan_optimal's docstring.
    plan = plan_optimal(lengths, max_batch_tokens=max_batch_tokens, max_batch_size=max_batch_size, cost=cost)
    assert plan.predicted_ms(cost) == pytest.approx(
        _brute_any_partition(lengths, max_batch_tokens, max_batch_size, cost), rel=1e-9, abs=1e-9
    )


def test_set_partitions_helper_counts_bell_numbers():
    assert [sum(1 for _ in _set_partitions(list(range(n)))) for n in range(7)] == [1, 1, 2, 5, 15, 52, 203]


# --- padding arithmetic by hand ---

HAND = [3, 10, 4, 7, 2, 9]


def test_padding_arithmetic_fixed_arrival_order():
    plan = plan_fixed(HAND, 3)
    a, b = plan.batches
    assert (a.indices, a.width, a.real_tokens, a.computed_tokens, a.pad_tokens) == ((0, 1, 2), 10, 17, 30, 13)
    assert (b.indices, b.width, b.real_tokens, b.computed_tokens, b.pad_tokens) == ((3, 4, 5), 9, 18, 27, 9)
    assert a.padding_ratio == 13 / 30
    assert (plan.real_tokens, plan.computed_tokens, plan.pad_tokens, plan.forwards) == (35, 57, 22, 2)
    assert plan.padding_ratio == 22 / 57


def test_padding_arithmetic_fixed_sorted():
    plan = plan_fixed(HAND, 3, sort=True)
    assert [b.indices for b in plan.batches] == [(4, 0, 2), (3, 5, 1)]
    assert [b.lengths for b in plan.batches] == [(2, 3, 4), (7, 9, 10)]
    assert [b.pad_tokens for b in plan.batches] == [3, 4]
    assert (plan.computed_tokens, plan.pad_tokens, plan.padding_ratio) == (42, 7, 7 / 42)


def test_padding_arithmetic_global_and_sequential():
    glob = plan_global_pad(HAND, 4)
    assert [b.width for b in glob.batches] == [10, 10]
    assert [b.rows for b in glob.batches] == [4, 2]
    assert (glob.computed_tokens, glob.pad_tokens) == (60, 25)
    seq = plan_sequential(HAND)
    assert seq.order() == list(range(6))
    assert (seq.forwards, seq.computed_tokens, seq.pad_tokens, seq.padding_ratio) == (6, 35, 0, 0.0)


def test_empty_input_gives_empty_plan():
    cost = CostModel(25.0, 0.8)
    for plan in _all_planners([], 1024, 64, cost).values():
        assert plan.batches == ()
        assert (plan.forwards, plan.real_tokens, plan.computed_tokens, plan.pad_tokens) == (0, 0, 0, 0)
        assert plan.padding_ratio == 0.0
        assert plan.predicted_ms(cost) == 0.0
        assert plan.order() == []
    assert sort_by_length([]) == []


def test_sort_by_length_is_stable():
    assert sort_by_length([5, 2, 5, 2, 1]) == [4, 1, 3, 0, 2]


def test_greedy_hand_example_with_oversize_singleton():
    plan = plan_greedy_sorted([5, 5, 5, 100, 6], max_batch_tokens=20, max_batch_size=3)
    assert [b.indices for b in plan.batches] == [(0, 1, 2), (4,), (3,)]
    assert plan.batches[-1].computed_tokens == 100  # over budget, alone: the documented exception


def test_optimal_hand_example():
    # fixed 10, 1 per token: one batch = 10 + 5*8 = 50; singles = 5*10 + 12 = 62;
    # [1,1,1,1] + [8] = 14 + 18 = 32.
    cost = CostModel(fixed_ms=10.0, token_ms=1.0)
    plan = plan_optimal([1, 8, 1, 1, 1], max_batch_tokens=1000, max_batch_size=10, cost=cost)
    assert [b.indices for b in plan.batches] == [(0, 2, 3, 4), (1,)]
    assert plan.predicted_ms(cost) == 32.0


def test_optimal_oversize_item_runs_alone():
    cost = CostModel(25.0, 0.8)
    plan = plan_optimal([10, 3000, 12], max_batch_tokens=1024, max_batch_size=64, cost=cost)
    assert [b.indices for b in plan.batches] == [(0, 2), (1,)]


# --- why the objective is time, not padding ---


def _long_tail() -> list[int]:
    rng = random.Random(7)
    lengths = [rng.randint(20, 60) for _ in range(40)]
    for pos in (3, 17, 30):  # a few very long tickets among short ones
        lengths[pos] = 480
    return lengths


def test_minimising_padding_alone_is_wrong():
    lengths, cost = _long_tail(), CostModel(fixed_ms=25.0, token_ms=0.8)
    seq = plan_sequential(lengths)
    best = plan_optimal(lengths, max_batch_tokens=1024, max_batch_size=64, cost=cost)
    assert seq.padding_ratio == 0.0  # the padding optimum ...
    assert seq.forwards == len(lengths)  # ... pays fixed_ms once per ticket
    assert best.padding_ratio > 0.0  # DP accepts some padding on purpose
    assert best.forwards * 4 < seq.forwards
    assert best.predicted_ms(cost) < 0.8 * seq.predicted_ms(cost)


def test_naive_padding_ordering_on_long_tail():
    lengths = _long_tail()
    glob, arrival, by_length = (
        plan_global_pad(lengths, 8),
        plan_fixed(lengths, 8),
        plan_fixed(lengths, 8, sort=True),
    )
    assert glob.padding_ratio > arrival.padding_ratio > by_length.padding_ratio
    assert glob.forwards == arrival.forwards == by_length.forwards == 5


# --- cost model fit ---

GRID = [(r, w) for r in (1, 2, 4, 8, 16, 32) for w in (16, 64, 128, 256, 512)]


@pytest.mark.parametrize("truth", [(25.0, 0.8, 0.0005), (25.0, 0.8, 0.0), (3.5, 0.02, 1e-5), (0.0, 1.0, 0.0)])
def test_fit_recovers_exact_coefficients(truth):
    model = CostModel(*truth)
    fitted = CostModel.fit([(r, w, model.batch_ms(r, w)) for r, w in GRID])
    assert fitted.fixed_ms == pytest.approx(truth[0], abs=1e-6)
    assert fitted.token_ms == pytest.approx(truth[1], abs=1e-6)
    assert fitted.quad_ms == pytest.approx(truth[2], abs=1e-6)


def test_fit_recovers_noisy_coefficients_roughly():
    model, rng = CostModel(25.0, 0.8, 0.0005), random.Random(0)
    samples = [(r, w, model.batch_ms(r, w) * rng.gauss(1.0, 0.02)) for r, w in GRID for _ in range(3)]
    fitted = CostModel.fit(samples)
    assert fitted.token_ms == pytest.approx(0.8, rel=0.1)
    assert fitted.fixed_ms == pytest.approx(25.0, abs=5.0)
    for r, w in GRID:
        assert fitted.batch_ms(r, w) == pytest.approx(model.batch_ms(r, w), rel=0.05)


def test_fit_drops_a_negative_term_and_refits():
    # Concave in width: unconstrained least squares wants quad_ms < 0.
    samples = [(r, w, 10.0 + r * w - 0.001 * r * w * w) for r, w in GRID if w <= 256]
    fitted = CostModel.fit(samples)
    assert fitted.quad_ms == 0.0
    assert fitted.token_ms > 0.0 and fitted.fixed_ms >= 0.0
    # The refit is the plain least-squares line through the same points without the quad term.
    xs = [r * w for r, w, _ in samples]
    ys = [ms for _, _, ms in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    assert fitted.token_ms == pytest.approx(slope, rel=1e-9)
    assert fitted.fixed_ms == pytest.approx(my - slope * mx, rel=1e-9)


def _sse(model: CostModel, samples) -> Fraction:
    coef = [Fraction(model.fixed_ms), Fraction(model.token_ms), Fraction(model.quad_ms)]
    return sum((Fraction(ms) - coef[0] - coef[1] * r * w - coef[2] * r * w * w) ** 2 for r, w, ms in samples)


samples_st = st.lists(
    st.tuples(st.integers(1, 64), st.integers(1, 512), st.floats(0, 1e4, allow_nan=False)),
    min_size=3,
    max_size=12,
)


@SMALL
@given(samples_st, st.lists(st.tuples(st.floats(0, 100), st.floats(0, 2), st.floats(0, 0.01)), max_size=5))
def test_fit_is_the_non_negative_least_squares_optimum(samples, others):
    try:
        fitted = CostModel.fit(samples)
    except ValueError:
        assume(False)
    assert min(fitted.fixed_ms, fitted.token_ms, fitted.quad_ms) >= 0.0
    best = _sse(fitted, samples)
    tol = Fraction(1e-9) * max(1, best)
    candidates = [CostModel(*c) for c in others]
    # Nudges of the fit itself (clamped at zero) probe the neighbourhood of the optimum.
    base = (fitted.fixed_ms, fitted.token_ms, fitted.quad_ms)
    for k, step in itertools.product(range(3), (0.999, 1.001, 0.0)):
        nudged = list(base)
        nudged[k] = nudged[k] * step if step else 0.0
        candidates.append(CostModel(*nudged))
    for other in candidates:
        assert best <= _sse(other, samples) + tol


# --- invalid input ---


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: plan_optimal([1], max_batch_tokens=0, max_batch_size=4, cost=CostModel(1, 1)),
            "max_batch_tokens",
        ),
        (
            lambda: plan_optimal([1], max_batch_tokens=8, max_batch_size=0, cost=CostModel(1, 1)),
            "max_batch_size",
        ),
        (lambda: plan_greedy_sorted([1], max_batch_tokens=-5, max_batch_size=4), "max_batch_tokens"),
        (lambda: plan_greedy_sorted([1], max_batch_tokens=8, max_batch_size=0), "max_batch_size"),
        (lambda: plan_fixed([1, 2], 0), "batch_size"),
        (lambda: plan_global_pad([1, 2], -1), "batch_size"),
        (lambda: plan_fixed([1, 0], 2), r"lengths\[1\]"),
        (lambda: plan_sequential([3, -2]), r"lengths\[1\]"),
        (lambda: plan_global_pad([0], 2), r"lengths\[0\]"),
        (lambda: sort_by_length([4, 2.5]), r"lengths\[1\]"),
        (
            lambda: plan_optimal([5, 0], max_batch_tokens=8, max_batch_size=4, cost=CostModel(1, 1)),
            r"lengths\[1\]",
        ),
        (lambda: CostModel(-1.0, 1.0), "fixed_ms"),
        (lambda: CostModel(1.0, float("nan")), "token_ms"),
        (lambda: CostModel(1.0, 1.0, -0.1), "quad_ms"),
        (lambda: CostModel(1.0, 1.0).batch_ms(0, 8), "rows"),
        (lambda: CostModel.fit([(1, 8, 1.0), (2, 8, 2.0)]), "at least 3 samples"),
        (lambda: CostModel.fit([(1, 10, 5.0), (2, 10, 7.0), (3, 10, 9.0)]), "degenerate"),
        (lambda: CostModel.fit([(1, 8, 1.0)] * 5), "degenerate"),
        (lambda: CostModel.fit([(0, 8, 1.0), (2, 8, 2.0), (3, 9, 3.0)]), r"samples\[0\]"),
        (lambda: CostModel.fit([(1, 8, 1.0), (2, 8, -2.0), (3, 9, 3.0)]), r"samples\[1\]"),
        (lambda: Batch((0, 1), (3,), 3), "one length per index"),
        (lambda: Batch((0,), (9,), 3), "width"),
    ],
)
def test_invalid_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
