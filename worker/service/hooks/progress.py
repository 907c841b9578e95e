"""The classifying loop's progress record (`worker.health.Health.classifying`) marked from the
pipeline: work in hand from a job's start to its end, progress at each forward computed and each
publish done."""

from __future__ import annotations

from worker.health.progress import Progress
from worker.results import BatchReport
from worker.service.hooks import Hook


class ProgressHook(Hook):
    def __init__(self, bound_s: float, progress: Progress) -> None:
        """`bound_s`: TICKETQ_WORST_BATCH_S, the longest a forward and its publish may go without progress;
        `progress`: the process's classifying loop record (`Health.classifying`)."""
        self.bound_s, self.progress = bound_s, progress

    def on_job_start(self) -> None:
        self.progress.begin(self.bound_s)

    def on_job_end(self) -> None:
        self.progress.end()

    def on_forward(self, report: BatchReport) -> None:
        self.progress.advanced()  # what follows (the live cost refit) starts the next wait

    def on_publish(self, seconds: float) -> None:
        self.progress.advanced()

    def __repr__(self) -> str:
        return f"ProgressHook(bound_s={self.bound_s!r})"
