"""Measure this device's forward-pass cost and fit the planner's cost model to it.

A few seconds of timed forward passes over a grid of (rows, width) shapes, through the same
cached, label-only path that serves tickets, then:

- `CostModel.fit` — fixed cost per forward + cost per computed token (+ a quadratic attention
  term when the fit wants one); the DP planner minimises the sum of these.
- the token budget: the smallest padded-token size whose throughput is within 5% of the best
  measured, so batches stay as small (low latency, low padding) as this device allows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from worker.engine.batching import CostModel
from worker.engine.prompt import EncodedTicket

log = logging.getLogger(__name__)

ROWS = (1, 2, 4, 8, 16, 32)
WIDTHS = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Tuning:
    cost: CostModel
    max_batch_tokens: int
    samples: tuple[tuple[int, int, float], ...]  # (rows, width, ms)

    def describe(self) -> str:
        c = self.cost
        return (
            f"cost(rows, width) = {c.fixed_ms:.2f} ms + {c.token_ms:.4f} ms x tokens"
            + (f" + {c.quad_ms:.2e} ms x rows x width^2" if c.quad_ms else "")
            + f"; budget {self.max_batch_tokens} padded tokens"
        )


def shape_order(max_tokens: int) -> list[tuple[int, int]]:
    """Every width once at one row and at the most rows first, so a short budget still spans the
    widths the planner will use; then the rest of the grid, cheapest first."""
    grid = [(r, w) for r in ROWS for w in WIDTHS if r * w <= max_tokens]
    first = [(1, w) for w in WIDTHS] + [(max(r for r in ROWS if r * w <= max_tokens), w) for w in WIDTHS]
    first = list(dict.fromkeys(s for s in first if s in grid))
    return first + sorted((s for s in grid if s not in first), key=lambda s: s[0] * s[1])


def measure(engine, max_tokens: int = 1024, budget_s: float = 20.0) -> list[tuple[int, int, float]]:
    """Timed forwards per shape (best of two for short ones), widest coverage first, within `budget_s`."""
    token = engine.prompt.encode("hello").ids[0]
    for width in (16, max(WIDTHS)):  # warm-up: allocator and kernels for small and large shapes
        engine.forward_batch([_row(engine, token, width)])
    deadline = time.monotonic() + budget_s
    samples = []
    for rows, width in shape_order(max_tokens):
        if time.monotonic() > deadline and len(samples) >= 6:
            break
        batch = [_row(engine, token, width)] * rows
        timings = []
        for _ in range(2 if rows * width < 512 else 1):  # a minimum filters out a neighbour's burst
            start = time.perf_counter()
            engine.forward_batch(batch)
            timings.append((time.perf_counter() - start) * 1000)
        samples.append((rows, width, min(timings)))
    return samples


def choose_budget(samples: list[tuple[int, int, float]], floor: int, tolerance: float = 0.05) -> int:
    """Smallest padded-token size within `tolerance` of the best measured tokens/s (at least `floor`)."""
    rate = {}
    for rows, width, ms in samples:
        tokens = rows * width
        rate[tokens] = max(rate.get(tokens, 0.0), tokens / ms)
    best = max(rate.values())
    good = min(tokens for tokens, r in rate.items() if r >= (1 - tolerance) * best)
    return max(good, floor)


def autotune(engine, budget_s: float = 20.0) -> Tuning:
    """Measure, fit, and apply the cost model and token budget to `engine`; returns what it chose."""
    samples = measure(engine, budget_s=budget_s)
    cost = CostModel.fit(samples)
    if cost.fixed_ms <= 0 or cost.token_ms <= 0:
        # A zero term would make the DP favour batches of one (or one giant batch): noise, not the device.
        log.warning("autotune fit %s looks like noise; keeping the configured cost model", cost)
        cost = engine.cost
    floor = engine.prompt.max_ticket_tokens + len(engine.prompt.suffix_ids)
    tuning = Tuning(cost, choose_budget(samples, floor), tuple(samples))
    engine.cost, engine.max_batch_tokens = tuning.cost, tuning.max_batch_tokens
    log.info("autotuned on %s/%s: %s", engine.info.device, engine.info.dtype, tuning.describe())
    return tuning


def _row(engine, token: int, width: int) -> EncodedTicket:
    ticket = max(1, width - len(engine.prompt.suffix_ids))
    return EncodedTicket(ids=(*([token] * ticket), *engine.prompt.suffix_ids), ticket_tokens=ticket, truncated=False)
