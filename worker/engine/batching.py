"""Batch planning and padding arithmetic: which tickets share a forward pass, and what it costs.

A forward pass pads every row to the longest row in the batch, so the planner decides both how
much padding is computed and how many forwards are run. `plan_optimal` is the one the engine
uses; the other planners are the baselines it is measured against. The time of a forward is
predicted by `worker.engine.cost.CostModel`.

No torch: the planner is plain Python, unit-tested without a model, and the engine is the only
place that touches tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.cost import CostModel
from worker.results import PaddedTokens

__all__ = [
    "Batch",
    "Plan",
    "plan_fixed",
    "plan_global_pad",
    "plan_greedy_sorted",
    "plan_optimal",
    "plan_sequential",
    "sort_by_length",
]

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
