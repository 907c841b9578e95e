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

from worker.batching import CostModel
from worker.prompt import EncodedTicket

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


def measure(engine, max_tokens: int = 4096, budget_s: float = 20.0) -> list[tuple[int, int, float]]:
    """Time one forward per shape (after a warm-up), cheapest shapes first, within `budget_s`."""
    token = engine.prompt.encode("hello").ids[0]
    shapes = sorted(((r, w) for r in ROWS for w in WIDTHS if r * w <= max_tokens), key=lambda s: s[0] * s[1])
    engine.forward_batch([_row(engine, token, 16)])  # warm-up: allocator, kernels
    deadline = time.monotonic() + budget_s
    samples = []
    for rows, width in shapes:
        if time.monotonic() > deadline and len(samples) >= 6:
            break
        batch = [_row(engine, token, width)] * rows
        start = time.perf_counter()
        engine.forward_batch(batch)
        samples.append((rows, width, (time.perf_counter() - start) * 1000))
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
    floor = engine.prompt.max_ticket_tokens + len(engine.prompt.suffix_ids)
    tuning = Tuning(cost, choose_budget(samples, floor), tuple(samples))
    engine.cost, engine.max_batch_tokens = tuning.cost, tuning.max_batch_tokens
    log.info("autotuned on %s/%s: %s", engine.info.device, engine.info.dtype, tuning.describe())
    return tuning


def _row(engine, token: int, width: int) -> EncodedTicket:
    ticket = max(1, width - len(engine.prompt.suffix_ids))
    return EncodedTicket(ids=(*([token] * ticket), *engine.prompt.suffix_ids), ticket_tokens=ticket, truncated=False)
