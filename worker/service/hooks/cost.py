"""The live cost model attached to the pipeline: every forward's report refits the planner's cost
model while serving (TICKETQ_LIVE_COST), its fits exported.

The hook only records (O(1) on the classifying thread); the refits run on a background thread
and swap the model in between plans (`worker.engine.autotune.LiveCostModel` states their cost)."""

from __future__ import annotations

from typing import Any

from worker.metrics import Metrics
from worker.results import BatchReport
from worker.service.hooks import Hook
from worker.service.ports import Classifier
from worker.settings import Settings


class LiveCost(Hook):
    def __init__(self, learner: Any) -> None:
        self.learner = learner  # a LiveCostModel

    def on_forward(self, report: BatchReport) -> None:
        if not report.recheck:  # a float32 re-check runs at another speed than the engine's own forwards
            self.learner.observe(report.rows, report.width, report.seconds)


def live_cost(settings: Settings, classifier: Classifier, metrics: Metrics) -> LiveCost | None:
    """The hook for this classifier, its current fit exported; None without TICKETQ_LIVE_COST or
    for a classifier that plans with no cost model (the null classifier)."""
    cost = classifier.cost
    if cost is not None:
        metrics.observe_cost_model(cost.fixed_ms, cost.token_ms, cost.quad_ms)
    if not settings.live_cost or cost is None:
        return None
    from worker.engine.autotune import LiveCostModel  # torch: only a worker with an engine gets here

    def on_fit(fit: Any, error: float) -> None:
        metrics.observe_cost_model(fit.fixed_ms, fit.token_ms, fit.quad_ms, error)

    return LiveCost(LiveCostModel(classifier, on_fit))
