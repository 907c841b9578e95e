"""The queue mode (`ticketq-queue`): every ticket through Redis and a real `ticketq worker` process
(`ticketq_bench.procs`) started once with the bench's own model, precision, threads and cost model,
timed from the first send to the last result; the worker's own metrics give its padding."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

from ticketq_bench.memory import peak_rss_mb
from ticketq_bench.modes import ModeRun, RunContext
from ticketq_bench.procs import free_port, running_worker
from ticketq_bench.records import Answer, Bench, Load, ModeResult


class QueueRun(ModeRun):
    """All tickets through Redis and a real `ticketq worker` process (started once), timed first send to last result."""

    producer = None

    def start(self) -> None:
        from producer.api import Producer
        from producer.errors import BrokerUnavailable

        bench = self.context.bench
        self.result.rss_of = "worker process"
        queue = f"ticketq-bench-{os.getpid()}"
        self.producer = Producer(bench.settings.model_copy(update={"queue": queue}))
        try:
            self.producer.check_connection()
        except BrokerUnavailable as exc:
            self.result.skipped = f"Redis unreachable, mode skipped: {exc}"
            return
        self.log_path = Path(tempfile.gettempdir(), f"ticketq-bench-worker-{os.getpid()}.log")
        self.stack = contextlib.ExitStack()
        try:
            env = _worker_env(bench, queue, free_port())
            self.worker = self.stack.enter_context(running_worker(env, self.log_path))
        except (RuntimeError, OSError) as exc:  # the worker died or never got ready
            self.result.skipped = f"ticketq-queue failed: {exc} (worker log: {self.log_path})"

    def round(self, number: int, load: Load) -> None:
        try:
            answers, seconds = _drive_queue(self.producer, self.worker, self.context, self.result, number)
        except (RuntimeError, OSError) as exc:  # the worker died, Redis went away
            self.crash(f"failed: {exc} (worker log: {self.log_path})", number)
            return
        self.result.add_round(answers, seconds, load)

    def close(self) -> None:
        if self.producer is None:
            return
        if hasattr(self, "stack"):
            self.stack.close()
        self.producer.close()


def _drive_queue(producer, worker, context: RunContext, result: ModeResult, number: int) -> tuple[list[Answer], float]:
    """One round through the queue; ticket ids carry the round (each round's results are its own)."""
    warm = context.warm_texts or ["hello"]
    # A warm-up round trip: kernels warmed, and proof that the consumer takes messages.
    warm_sent = producer.submit_many([{"id": f"warmup-{number}-{i}", "text": t} for i, t in enumerate(warm)])
    producer.wait(warm_sent, timeout=600)
    tickets = [{"id": f"r{number}-{t['id']}", "text": t["text"]} for t in context.tickets]
    before = worker.metrics()
    start = time.perf_counter()
    sent = producer.submit_many(tickets, progress=True)
    replies = producer.wait(sent, timeout=max(600.0, 10.0 * len(tickets)), progress=True)
    seconds = time.perf_counter() - start
    after = worker.metrics()
    by_id = {r["id"]: r for r in replies}
    answers = []
    for ticket in tickets:
        reply = by_id.get(ticket["id"], {"status": "missing"})
        ok = reply.get("status") == "ok"
        answers.append(Answer(reply["label"], reply["probs"]) if ok else Answer(f"<{reply['status']}>"))
    failed = sum(a.probs is None for a in answers)
    if failed:
        result.notes.append(
            f"ticketq-queue: {failed} tickets failed or timed out in round {number} (worker log: {worker.log_path})"
        )
    if number == 1:
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        result.padding = (
            int(delta.get("ticketq_tokens_padded_total{}", 0)),
            int(delta.get("ticketq_tokens_computed_total{}", 0)),
        )
        result.forwards = int(delta.get("ticketq_batch_size_count{}", 0))
    result.peak_rss_mb = peak_rss_mb(worker.pid)
    return answers, seconds


def _worker_env(bench: Bench, queue: str, port: int) -> dict[str, str]:
    """The bench's own settings for the worker: same model, dtype, device, threads and planner."""
    import torch

    engine, cost = bench.engine, bench.engine.cost
    return {
        **os.environ,
        "TICKETQ_MODEL": bench.settings.model,
        "TICKETQ_DTYPE": engine.info.dtype,
        "TICKETQ_MATMUL": engine.info.matmul,
        "TICKETQ_DEVICE": engine.info.device.split(":")[0],
        "TICKETQ_THREADS": str(torch.get_num_threads()),
        "TICKETQ_QUEUE": queue,
        "TICKETQ_METRICS_HOST": "127.0.0.1",
        "TICKETQ_METRICS_PORT": str(port),
        "TICKETQ_MAX_BATCH_TOKENS": str(engine.max_batch_tokens),
        # the worker plans with exactly the cost model the in-process mode used
        "TICKETQ_COST_FIXED_MS": repr(cost.fixed_ms),
        "TICKETQ_COST_TOKEN_MS": repr(cost.token_ms),
        "TICKETQ_COST_QUAD_MS": repr(cost.quad_ms),
        "TICKETQ_AUTOTUNE": "false",
        "TICKETQ_NULL_CLASSIFIER": "false",
        "PYTHONUNBUFFERED": "1",
    }
