"""Batch planning and padding arithmetic: which tickets share a forward pass, and what it costs.

A forward pass pads every row to the longest row in the batch, so the planner decides both how
much padding is computed and how many forwards are run. `plan_optimal` is the one the engine
uses; the other planners are the baselines it is measured against. `CostModel` predicts the time
of one forward and can be fitted from measurements on the device.

No torch: the planner is unit-tested without a model, and the engine is the only place that
touches tensors. The planners are plain Python; only `CostModel.fit` uses numpy (float64 least
squares).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.results import PaddedTokens

__all__ = [
    "Batch",
    "CostModel",
    "Plan",
    "plan_fixed",
    "plan_global_pad",
    "plan_greedy_sorted",
    "plan_optimal",
    "plan_sequential",
    "sort_by_length",
]

# Term subsets tried by `CostModel.fit`. Indices into (fixed, token, quad).
_FIT_TERMS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))
# A fit's squared errors within n * (this share of the largest target)**2 of the best are rounding.
_ROUNDING = 1e-12


@dataclass(frozen=True)
class CostModel:
    """Predicted time of one forward pass: fixed_ms + token_ms*rows*width + quad_ms*rows*width**2.

    `quad_ms` is the attention term (each row attends over its whole width). All coefficients
    are non-negative, which makes the cost monotone in rows and width; `plan_optimal` relies on it.
    """

    fixed_ms: float
    token_ms: float
    quad_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "token_ms", "quad_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {value!r}")

    def batch_ms(self, rows: int, width: int) -> float:
        """Predicted milliseconds of one forward over `rows` rows padded to `width` tokens."""
        if rows < 1 or width < 1:
            raise ValueError(f"batch_ms needs rows >= 1 and width >= 1, got rows={rows}, width={width}")
        computed = rows * width
        return self.fixed_ms + self.token_ms * computed + self.quad_ms * computed * width

    @classmethod
    def fit(cls, samples: Sequence[tuple[int, int, float]], relative: bool = False) -> CostModel:
        """Non-negative least squares fit from `(rows, width, measured_ms)` samples.

        `relative` minimises the errors as shares of each measurement instead of in milliseconds,
        so a 40 ms forward counts as much as a 2 s one: the shapes a planner weighs against each
        other (one batch or two) are the small ones, which absolute errors let the largest drown.

        Three unknowns, so NNLS is cheap by enumeration: the constrained optimum is the unconstrained
        least-squares fit on its own support, so we fit every subset of terms and keep the best
        one whose coefficients are all >= 0 (e.g. a negative quad term is dropped and the rest
        refitted); a subset with fewer terms wins a tie within rounding, so a term the samples do
        not need comes out exactly 0. In float64: each column (1, rows*width, rows*width**2, which
        span six orders of magnitude) is scaled to unit length and solved by an orthogonal
        least squares (`numpy.linalg.lstsq`, SVD), never the normal equations, which would square
        the condition number and lose the small coefficients. Cost: 7 solves of n x 3 at most,
        O(n) in the number of samples; whether the samples determine the three coefficients is
        decided exactly, on the integer features.
        """
        features, targets = _fit_inputs(samples)
        if relative:  # each equation scaled by 1 / its measurement (a zero one keeps weight 1)
            weights = 1 / np.where(targets > 0, targets, 1.0)
            features, targets = features * weights[:, None], targets * weights
        scale = np.linalg.norm(features, axis=0)  # > 0: every feature is >= 1 before weighting
        scaled = features / scale
        rounding = len(targets) * (_ROUNDING * float(np.max(np.abs(targets)))) ** 2
        fits = [(terms, *_solve(scaled, targets, terms)) for terms in _FIT_TERMS]
        feasible = [(terms, coef, sse) for terms, coef, sse in fits if (coef >= 0).all()]
        # Measured times are >= 0 and every column is > 0, so each one-term fit is >= 0: feasible.
        assert feasible
        least = min(sse for _, _, sse in feasible)
        terms, coef, _ = min((f for f in feasible if f[2] <= least + rounding), key=lambda f: (len(f[0]), f[2]))
        found = dict(zip(terms, coef / scale[list(terms)], strict=True))
        return cls(*(float(found.get(k, 0.0)) + 0.0 for k in range(3)))  # + 0.0: no -0.0


def _fit_inputs(samples: Sequence[tuple[int, int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Validate samples; return the features (1, rows*width, rows*width**2) and targets, float64.

    Raises ValueError for a bad sample, and where the samples do not determine the three
    coefficients: the columns are dependent exactly when the points (rows*width, rows*width**2)
    all lie on one line, checked on the integers."""
    if len(samples) < 3:
        raise ValueError(f"CostModel.fit needs at least 3 samples, got {len(samples)}")
    points, targets = [], []
    for i, sample in enumerate(samples):
        rows, width, ms = sample
        if not (_is_int(rows) and _is_int(width) and rows >= 1 and width >= 1):
            raise ValueError(f"samples[{i}]: rows and width must be ints >= 1, got {sample!r}")
        if not (isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0):
            raise ValueError(f"samples[{i}]: measured_ms must be a finite number >= 0, got {sample!r}")
        points.append((rows * width, rows * width * width))
        targets.append(float(ms))
    if _collinear(points):
        raise ValueError(
            "CostModel.fit: samples are degenerate, the three coefficients are not determined; "
            "measure at least 3 different (rows, width) shapes, varying width as well as rows"
        )
    features = np.column_stack([np.ones(len(points)), np.array(points, dtype=np.float64)])
    return features, np.array(targets)


def _collinear(points: list[tuple[int, int]]) -> bool:
    """Whether every point lies on one line (or on one point), exactly: integer cross products."""
    x0, z0 = points[0]
    other = next(((x, z) for x, z in points if (x, z) != (x0, z0)), None)
    if other is None:
        return True
    dx, dz = other[0] - x0, other[1] - z0
    return all(dx * (z - z0) == dz * (x - x0) for x, z in points)


def _solve(scaled: np.ndarray, targets: np.ndarray, terms: tuple[int, ...]) -> tuple[np.ndarray, float]:
    """Least squares on the (unit-length) columns `terms`: their coefficients and the sum of squared errors."""
    columns = scaled[:, list(terms)]
    coef = np.linalg.lstsq(columns, targets, rcond=None)[0]
    residual = targets - columns @ coef
    return coef, float(residual @ residual)


@dataclass(frozen=True)
class Batch(PaddedTokens):
    """One forward pass: which items (indices into the caller's list), their lengths, the padded width."""

    indices: tuple[int, ...]
    lengths: tuple[int, ...]
    width: int

    def __post_init__(self) -> None:
        if not self.indices or len(self.indices) != len(self.lengths):
            raise ValueError(
                f"Batch needs >= 1 item and one length per index, got {len(self.indices)} indices "
                f"and {len(self.lengths)} lengths"
            )
        if self.width < max(self.lengths):
            raise ValueError(f"Batch.width {self.width} is shorter than its longest item {max(self.lengths)}")

    @property
    def rows(self) -> int:
        return len(self.indices)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def computed_tokens(self) -> int:
        return self.rows * self.width


@dataclass(frozen=True)
class Plan(PaddedTokens):
    """Batches in execution order, with the padding and cost totals used to compare planners."""

    batches: tuple[Batch, ...]

    @property
    def real_tokens(self) -> int:
        return sum(b.real_tokens for b in self.batches)

    @property
    def computed_tokens(self) -> int:
        return sum(b.computed_tokens for b in self.batches)

    @property
    def forwards(self) -> int:
        return len(self.batches)

    def predicted_ms(self, cost: CostModel) -> float:
        return sum(cost.batch_ms(b.rows, b.width) for b in self.batches)

    def order(self) -> list[int]:
        """Every index, in the order the items are run."""
        return [i for b in self.batches for i in b.indices]


def sort_by_length(lengths: Sequence[int]) -> list[int]:
    """Indices of `lengths` in ascending length; ties keep arrival order (Python's sort is stable)."""
    _check_lengths(lengths)
    return sorted(range(len(lengths)), key=lengths.__getitem__)


def plan_optimal(
    lengths: Sequence[int], *, max_batch_tokens: int, max_batch_size: int, cost: CostModel
) -> Plan:
    """The plan with the least predicted time, by exact dynamic programming over sorted lengths.

    The objective is time, not padding: minimising padding alone is degenerate, since batches of
    one have 0% padding and win, at the price of n forwards that each pay `fixed_ms`. The cost
    model trades the two off.

    Searching only contiguous runs of the sorted list loses nothing while the cost is monotone in
    rows and width (it is: coefficients >= 0). Take any feasible plan, order its batches by width
    and refill them, same sizes, with the sorted items in turn: the first k batches held their
    items, all no longer than the k-th width, so the k-th refilled batch is no wider than before.
    Rows are unchanged, widths never grow, so cost and budgets only improve.

    Budgets: rows <= max_batch_size and rows*width <= max_batch_tokens, except that an item longer
    than max_batch_tokens runs alone (every input has a feasible plan). O(n * max_batch_size).
    """
    _check_positive("max_batch_tokens", max_batch_tokens)
    _check_positive("max_batch_size", max_batch_size)
    order = sort_by_length(lengths)
    sorted_lengths = [lengths[i] for i in order]
    n = len(order)
    # best[end]: least predicted ms for sorted items [0, end); start[end]: where its last batch begins.
    best = [0.0] + [math.inf] * n
    start = [0] * (n + 1)
    for end in range(1, n + 1):
        width = sorted_lengths[end - 1]  # sorted, so the last item is the longest of any batch ending here
        max_rows = min(end, max_batch_size, max(1, max_batch_tokens // width))
        # Most rows first with strict `<`: on a tie, prefer fewer forwards.
        for rows in range(max_rows, 0, -1):
            total = best[end - rows] + cost.batch_ms(rows, width)
            if total < best[end]:
                best[end], start[end] = total, end - rows
    cuts = []
    end = n
    while end > 0:
        cuts.append((start[end], end))
        end = start[end]
    return Plan(tuple(_batch(lengths, order[lo:hi]) for lo, hi in reversed(cuts)))


def plan_greedy_sorted(lengths: Sequence[int], *, max_batch_tokens: int, max_batch_size: int) -> Plan:
    """Sort ascending, then fill each batch until the next item would break a budget."""
    _check_positive("max_batch_tokens", max_batch_tokens)
    _check_positive("max_batch_size", max_batch_size)
    groups: list[list[int]] = []
    for i in sort_by_length(lengths):
        rows = len(groups[-1]) + 1 if groups else 0
        # Sorted, so item i would be the new longest: the batch's width becomes lengths[i].
        if groups and rows <= max_batch_size and rows * lengths[i] <= max_batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])  # also how an oversize item ends up alone: nothing can join it
    return Plan(tuple(_batch(lengths, g) for g in groups))


def plan_fixed(lengths: Sequence[int], batch_size: int, *, sort: bool = False) -> Plan:
    """Naive baseline: fixed-size chunks in arrival (or length) order, each padded to its own longest."""
    _check_positive("batch_size", batch_size)
    order = sort_by_length(lengths) if sort else _arrival(lengths)
    return Plan(tuple(_batch(lengths, order[k : k + batch_size]) for k in range(0, len(order), batch_size)))


def plan_global_pad(lengths: Sequence[int], batch_size: int) -> Plan:
    """Naive-global baseline: arrival-order chunks, every row padded to the longest of all items."""
    _check_positive("batch_size", batch_size)
    order = _arrival(lengths)
    width = max(lengths, default=0)
    return Plan(
        tuple(_batch(lengths, order[k : k + batch_size], width) for k in range(0, len(order), batch_size))
    )


def plan_sequential(lengths: Sequence[int]) -> Plan:
    """Unbatched baseline: one item per forward, arrival order. No padding, n forwards."""
    return Plan(tuple(_batch(lengths, [i]) for i in _arrival(lengths)))


def _batch(lengths: Sequence[int], indices: Sequence[int], width: int | None = None) -> Batch:
    items = tuple(lengths[i] for i in indices)
    return Batch(tuple(indices), items, max(items) if width is None else width)


def _arrival(lengths: Sequence[int]) -> list[int]:
    _check_lengths(lengths)
    return list(range(len(lengths)))


def _check_lengths(lengths: Sequence[int]) -> None:
    for i, length in enumerate(lengths):
        if not (_is_int(length) and length >= 1):
            raise ValueError(f"lengths[{i}] must be a positive int (token count), got {length!r}")


def _check_positive(name: str, value: int) -> None:
    if not (_is_int(value) and value >= 1):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
