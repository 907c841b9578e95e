"""One worker process once started: its classifier, service, metrics and readiness.

The process's health (`worker.health.Health`) and its runs' tally are built here, once, and handed
to each reader and writer: the transport (through the transport options), the outbox, the service
and its progress hook, the metrics and /readyz."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from ticketq import connections
from ticketq.contract import DEAD_LETTER_REASONS
from worker.app.preflight import preflight, wait_for_writes
from worker.errors import ModelNotReady
from worker.health import Health
from worker.metrics import Metrics
from worker.nullclassifier import NullClassifier
from worker.redis.answer_cache import AnswerCache
from worker.redis.outbox import Outbox
from worker.results import RunTally
from worker.service.core import TicketService
from worker.service.hooks.standard import live_cost, standard_hooks
from worker.service.ports import Classifier
from worker.service.routing import Routing
from worker.settings import Settings
from worker.transport import guards

log = logging.getLogger(__name__)


ClassifierFactory = Callable[[Settings], Classifier]


class Runtime:
    """One worker process once started: its settings, service, metrics and readiness."""

    def __init__(self, settings: Settings, classifier_factory: ClassifierFactory | None = None) -> None:
        self.settings = settings
        self.classifier_factory = classifier_factory or build_classifier
        self.health = Health()  # the loops' progress, Redis's refusals, data lost: this process's
        self.runs = RunTally()  # what runs saved (duplicates) or spent (re-checks): the metrics read it
        self.service: TicketService | None = None
        self.metrics: Metrics | None = None
        self.consumer_running = False  # between worker_ready and worker_shutting_down: /readyz
        self.controller: Any = None  # Celery's WorkController (worker_init's sender): its exit code

    def start(self) -> TicketService:
        """Check the libraries and Redis, build the classifier, serve metrics: the worker's start-up."""
        settings = self.settings
        guards.check_versions()
        client = preflight(settings)
        metrics = Metrics(queue=settings.queue, health=self.health, runs=self.runs)
        classifier = self.classifier_factory(settings)
        info = classifier.info
        metrics.model.info(
            {"model": info.name, "standin": str(info.standin).lower(), "dtype": info.dtype, "device": info.device,
             "matmul": info.matmul, "recheck": str(info.recheck).lower(),
             "fused": str(info.fused).lower(),  # after the self-check: the path that serves
             "scorer": info.scorer, "heads": info.heads or "-"}  # issue 43: the heads served and their digests
            if info else {"model": "null-classifier", "standin": "false", "dtype": "-", "device": "-", "matmul": "-",
                          "recheck": "false", "fused": "false", "scorer": "-", "heads": "-"}
        )  # fmt: skip
        fields = [(schema.name, spec.name, (*spec.labels, *(("none",) if spec.multi else ())))
                  for schema in settings.load_schemas() for spec in schema.fields]  # fmt: skip
        metrics.preinit(settings.label_names, tuple(str(reason) for reason in DEAD_LETTER_REASONS), fields)
        metrics.watch_queue(lambda: client.llen(settings.queue))
        if callable(getattr(classifier, "error_bounds", None)):
            metrics.watch_bounds(classifier.error_bounds)
        if settings.metrics_port:
            about = lambda: "Redis " + connections.describe_memory(connections.memory_state(client))  # noqa: E731
            metrics.serve(settings.metrics_host, settings.metrics_port, ready=self.ready_problem, about=about)
            log.info("metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port)
        self.metrics = metrics
        routing = Routing.of(classifier, settings)
        hooks = standard_hooks(settings, classifier, metrics, self.health.classifying, routing,
                               live_cost(settings, classifier, metrics))  # fmt: skip
        cache = AnswerCache(client, settings.answer_cache_s, settings.answer_cache_entries) \
            if settings.answer_cache_s else None
        outbox = Outbox.from_settings(client, settings, self.health)
        self.service = TicketService(settings, classifier, outbox, hooks, routing, cache, self.runs)
        metrics.watch_hook_errors(lambda: self.service.hooks.errors if self.service else {})
        wait_for_writes(client, self.health.refusals)
        return self.service

    def ready_problem(self) -> str | None:
        # Redis refusing writes, results not on the replicas yet, a stalled loop (its lease is no longer
        # renewed meanwhile, worker.transport.lease, unless Redis refuses writes).
        problems = [*([] if self.consumer_running else ["consumer not running"]), *self.health.problems()]
        return "; ".join(problems) or None


def build_classifier(settings: Settings) -> Classifier:
    """The engine the settings ask for (model loaded, prefix primed, autotuned), or the null classifier."""
    if settings.null_classifier:
        log.warning("TICKETQ_NULL_CLASSIFIER is on: labels are a hash, for measuring queue overhead only")
        return NullClassifier(settings.label_names)
    from worker.engine import ModelNotFound  # torch is imported only by workers that classify
    from worker.engine.replicas import load_engine

    started = time.perf_counter()
    try:
        engine = load_engine(settings)
    except ModelNotFound as exc:
        raise ModelNotReady(str(exc)) from None
    if settings.autotune:
        from worker.engine.autotune import autotune

        autotune(engine, budget_s=settings.autotune_s)
    elif settings.live_cost:
        from worker.engine.autotune import load_cached

        cached = load_cached(engine)
        if cached is not None:
            engine.cost = cached
            log.info("cost model: this machine's last fit, %.2f ms + %.4f ms x tokens",
                     cached.fixed_ms, cached.token_ms)  # fmt: skip
    info = engine.info
    log.info(
        "model %s ready on %s/%s%s%s in %.1fs (prefix %d tokens cached)%s",
        info.name, info.device, info.dtype, ", re-checked in float32" if info.recheck else "",
        (" (oneDNN GEMMs, fused layers)" if info.fused else " (oneDNN GEMMs)") if info.matmul == "onednn" else "",
        time.perf_counter() - started, engine.prefix_len,
        " — STAND-IN: labels are meaningless" if info.standin else "",
    )  # fmt: skip
    if info.self_check:
        log.info("self-check (batched path against the reference, docs/models.md): %s", info.self_check)
    return engine


def runtime_of(app: Celery) -> Runtime:
    return app.ticketq_runtime
