"""The hooks a worker attaches, in order: the progress record first (a forward computed is
progress before anything else runs), metrics, dead-letter accounting, then the shadow check and
the live cost model where the settings ask for them."""

from __future__ import annotations

from typing import Any

from worker.health.progress import Progress
from worker.metrics import Metrics
from worker.service.hooks import Hook
from worker.service.hooks.cost import live_cost
from worker.service.hooks.deadletters import DeadLetterCount
from worker.service.hooks.metrics import MetricsHook
from worker.service.hooks.progress import ProgressHook
from worker.service.hooks.shadow import ShadowHook
from worker.service.routing import Routing
from worker.settings import Settings
from worker.shadow import ShadowChecker


def standard_hooks(settings: Settings, classifier: Any, metrics: Metrics, progress: Progress,
                   routing: Routing | None = None, cost: Hook | None = None) -> list[Hook]:  # fmt: skip
    """Every hook of a worker serving `routing`'s schemas (the service's: pass the same one, else the
    shadow check builds its own); `progress` the classifying loop's record (`Health.classifying`);
    `cost` the live cost model's (`hooks.cost.live_cost`)."""
    progress_hook = ProgressHook(settings.worst_batch_s, progress)
    hooks: list[Hook] = [progress_hook, MetricsHook(metrics), DeadLetterCount(metrics)]
    if settings.shadow_rate > 0:
        hooks.append(ShadowHook(ShadowChecker(classifier, metrics, settings.shadow_rate),
                                routing or Routing.of(classifier, settings)))
    if cost is not None:
        hooks.append(cost)
    return hooks


__all__ = ["live_cost", "standard_hooks"]
