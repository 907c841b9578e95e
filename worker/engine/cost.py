"""The planner's cost model: the predicted time of one forward pass, and its fit from measurements.

`CostModel` is what `batching.plan_optimal` minimises; `CostModel.fit` is how start-up
(`autotune`) and serving (`livecost`) fit it to a device. No torch: only numpy (float64 least
squares).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

__all__ = ["CostModel", "floored", "sound"]

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
        so a short forward counts as much as a long one: the shapes a planner weighs against each
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


def floored(cost: CostModel) -> CostModel:
    """A fit whose fixed cost came out zero gets one token's worth instead.

    Where every forward is dominated by its tokens, the fixed cost is within the timings' noise and
    least squares can put it at zero; a planner told that a forward costs nothing by itself would
    cut every batch into batches of one. One token's worth keeps the measured per-token cost and
    batches that share a width together."""
    return replace(cost, fixed_ms=cost.token_ms) if cost.fixed_ms <= 0 < cost.token_ms else cost


def sound(cost: CostModel) -> bool:
    """A fit the planner can use: a positive fixed and per-token cost (a zero term is noise)."""
    return cost.fixed_ms > 0 and cost.token_ms > 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
