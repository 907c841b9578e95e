"""celery-batches, extended: the running job takes what arrives while it runs, and the flush
timer survives a broker reconnect."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import celery_batches
from celery import signals
from celery.concurrency.thread import TaskPool as ThreadTaskPool

from worker.transport.fetch import Channel as AtomicChannel

if TYPE_CHECKING:
    from worker.transport.events import WorkerEvents

log = logging.getLogger(__name__)



class Batches(celery_batches.Batches):
    """celery-batches' Batches, feeding the running job with everything that arrives while it runs.

    Stock, every flush (each `flush_every` messages, or the `flush_interval` timer) becomes its own
    pool job; with the one model thread busy they queue behind the running forward and each is
    planned alone, so under load the engine runs many 1-3-ticket jobs and latency grows with the
    queue of tiny jobs. Here a flush that comes while
    a job runs is held; the running job takes what is held between two forwards (`more`), so the
    engine plans every forward over everything waiting at its start, and a message is acked the
    moment its result is out (`done`), which frees its prefetch slot while the job goes on.
    Whatever is still held when the job returns goes as the next job.

    Only for the threads pool (ticketq's worker runs one model thread); any other pool gets the
    stock behaviour. Held requests are unacknowledged (acks_late), like the buffer's: a worker
    that dies holding them has them redelivered.
    """

    events: WorkerEvents | None = None  # set by the consumer once it is ready (worker.transport.consumer)

    def __init__(self) -> None:
        super().__init__()
        self._job_lock = threading.Lock()
        self._job_running = False
        self._held: list[Any] = []
        self._unacked: dict[str, list[Any]] = {}  # task id -> requests of the running job, until acked

    def flush(self, requests: Any) -> Any:
        if not isinstance(self._pool, ThreadTaskPool):
            return super().flush(requests)
        with self._job_lock:
            if self._job_running:
                self._held.extend(requests)
                return None
            self._job_running = True
        return self._submit(list(requests))

    def Strategy(self, task: Any, app: Any, consumer: Any) -> Any:
        """celery-batches' strategy; each request it buffers is also reported as received."""
        signals.task_received.connect(self._on_received, sender=consumer, weak=False,
                                      dispatch_uid=f"ticketq-received-{id(self)}")  # fmt: skip
        return super().Strategy(task, app, consumer)

    def _on_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        if self.events is not None and request is not None and request.task is self:
            self.events.received(request)

    def waiting(self) -> int:
        """Messages in this worker not yet in a job: celery-batches' buffer and the held flushes."""
        return self._buffer.qsize() + len(self._held)

    def running(self) -> int:
        """Messages of the running job not yet answered (acknowledged as each result is out)."""
        return sum(len(requests) for requests in list(self._unacked.values()))

    def more(self) -> list[Any]:
        """For the running job, between two forwards: the requests held since it started (as
        celery-batches' SimpleRequests), now part of it; acked by `done` or when it returns."""
        with self._job_lock:
            held, self._held = self._held, []
            for request in held:
                self._unacked.setdefault(request.id, []).append(request)
        if self.events is not None:
            self.events.started(held)
        return [celery_batches.SimpleRequest.from_request(request) for request in held]

    def done(self, task_ids: Any, failures: Mapping[str, str] | None = None,
             answers: Mapping[str, str] | None = None, revoked: Collection[str] = ()) -> None:  # fmt: skip
        """The results of these messages are out (stream and backend): acknowledge them now.
        `failures`: the error of each message among them that ended in state FAILURE; `answers`:
        a short text of each one's answer, for the task-succeeded event (what Flower shows).

        Never raises: a message whose ack fails (Celery logs a broker error itself) stays unacked
        and comes back; its results are published once, so a redelivery only costs a recompute.
        """
        with self._job_lock:
            requests = [request for task_id in task_ids for request in self._unacked.pop(task_id, ())]
        _acknowledge(requests)
        if self.events is not None:
            for request in requests:
                self.events.finished(request, (failures or {}).get(request.id), (answers or {}).get(request.id, ""),
                                     revoked=request.id in revoked)  # fmt: skip

    def taken_over(self, task_ids: Any) -> set[str]:
        """Task ids of the running job whose every message another worker has taken over: this
        worker's lease lapsed (a partition, a stall) and a live worker recovered the consumer that
        fetched them. Those are the other worker's to answer: not this one's to fail. Asks Redis
        (raises its errors); a message fetched some other way than the atomic fetch counts as held."""
        with self._job_lock:
            requests = {task_id: list(self._unacked.get(task_id, ())) for task_id in task_ids}
        by_channel: dict[Any, list[str]] = {}
        for held in requests.values():
            for request in held:
                channel = request.message.channel
                if isinstance(channel, AtomicChannel):
                    by_channel.setdefault(channel, []).append(request.message.delivery_tag)
        lost: set[str] = set()
        for channel, tags in by_channel.items():
            lost.update(tag for tag, flag in zip(tags, channel.owns(tags), strict=True) if not flag)
        return {task_id for task_id, held in requests.items()
                if held and all(request.message.delivery_tag in lost for request in held)}  # fmt: skip

    def _submit(self, requests: list[Any]) -> Any:
        """celery_batches.Batches.flush, with `_run_job` as the pool target so we learn when it ends."""
        acks_early = [request for request in requests if not request.task.acks_late]
        simple = ([celery_batches.SimpleRequest.from_request(request) for request in requests],)
        job: dict[str, list[Any]] = {}  # this job's own: the next one may start before its on_return runs
        for request in requests:
            job.setdefault(request.id, []).append(request)
        with self._job_lock:
            self._unacked = job

        def on_accepted(pid: int, time_accepted: float) -> None:
            if self.events is not None:
                self.events.started(requests)
            for request in acks_early:
                request.acknowledge()

        def on_return(result: Any) -> None:  # what `done` did not ack: a job that failed outside the engine
            with self._job_lock:
                rest = [request for requests in job.values() for request in requests]
                job.clear()
            _acknowledge(rest)
            if self.events is not None:
                for request in rest:
                    self.events.finished(request, "the job ended before this message's result was published")

        try:
            return self._pool.apply_async(self._run_job, (simple,), accept_callback=on_accepted, callback=on_return)
        except RuntimeError as exc:  # the pool is shutting down: the requests stay unacked and come back
            log.warning("could not start a batch of %d requests (%s); they will be redelivered", len(requests), exc)
            with self._job_lock:
                self._job_running = False
            return None

    def _run_job(self, simple: tuple[list[Any]]) -> Any:
        try:
            return celery_batches.apply_batches_task(self, simple, 0, None)
        finally:
            self._next_job()

    def _next_job(self) -> None:
        """The running job ended: send everything still held as one job, or go idle."""
        with self._job_lock:
            held, self._held = self._held, []
            if not held:
                self._job_running = False
                return
        log.debug("batch of %d requests held while the model was busy", len(held))
        self._submit(held)


def _acknowledge(requests: list[Any]) -> None:
    """Ack late-acked requests; one that fails (Celery logs broker errors itself) is logged and comes back."""
    for request in requests:
        if request.task.acks_late:
            try:
                request.acknowledge()
            except Exception:
                log.exception("could not acknowledge task %s; it will be redelivered", request.id)


def rearm_flush_timer(task: Any, timer: Any) -> None:
    """Re-arm a celery-batches task's flush timer after a broker (re)connect.

    On a lost connection Celery's event loop clears every hub timer, celery-batches' flush_interval
    timer included, but the task keeps its stale `_tref` and never arms a new one: after the
    reconnect a buffer below flush_every waited for more traffic, forever at the tail of a burst.
    """
    if task._tref is not None:  # set by celery-batches' Strategy once the worker consumes
        task._tref.cancel()
        task._tref = timer.call_repeatedly(task.flush_interval, task._do_flush)


