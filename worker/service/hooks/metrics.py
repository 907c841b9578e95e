"""The worker's Prometheus metrics (`worker.metrics.Metrics`) fed from the pipeline: jobs, forward
batches, queue waits, schema answers, publish times, tickets done by outcome, re-executions."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ticketq.schema import TicketFields
from worker.metrics import Metrics
from worker.results import BatchReport
from worker.service.answers import outcome
from worker.service.hooks import Hook


class MetricsHook(Hook):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_job_start(self) -> None:
        self.metrics.flushes.inc()

    def on_compute(self, slots: Sequence[Any]) -> None:
        waits = [s.joined - s.ticket.submitted_at for s in slots if s.ticket.submitted_at]
        self.metrics.queue_wait.observe_many([max(0.0, wait) for wait in waits])

    def on_forward(self, report: BatchReport) -> None:
        self.metrics.observe_batch(report.rows, report.width, report.real_tokens, report.seconds)

    def on_answer(self, slot: Any, answer: Any) -> None:
        self.metrics.answers.labels(precision=answer.precision, rechecked=str(answer.rechecked).lower()).inc()
        if not isinstance(answer, TicketFields):
            return
        for name, result in answer.fields.items():
            review = "true" if result.review else "false"
            for label in result.labels or ("none",):  # a multi-label field: each label chosen
                self.metrics.field_answers.labels(schema=answer.schema, field=name, label=label, review=review).inc()

    def on_cache_lookup(self, hits: int, misses: int) -> None:
        self.metrics.answer_cache.labels(result="hit").inc(hits)
        self.metrics.answer_cache.labels(result="miss").inc(misses)

    def on_publish(self, seconds: float) -> None:
        self.metrics.publish.observe(seconds)

    def on_first_result(self, seconds: float) -> None:
        self.metrics.first_result.observe(seconds)

    def on_results(self, slots: Sequence[Any]) -> None:
        now, counts, latencies = time.time(), Counter(), []
        for slot in slots:
            result = slot.result
            done = outcome(result)
            counts[result.get("label", "none"), done] += 1
            if slot.ticket and slot.ticket.submitted_at and done == "ok":
                latencies.append(max(0.0, now - slot.ticket.submitted_at))
        self.metrics.latency.observe_many(latencies)
        for (label, done), count in counts.items():
            self.metrics.tickets.labels(label=label, outcome=done).inc(count)

    def on_repeats(self, count: int) -> None:
        self.metrics.duplicates.inc(count)
