"""What a worker does with one drained buffer of Celery requests: validate, classify, publish.

Celery-free by design (requests only need `.id`, `.args` and optionally `.request_dict`): the
glue in `worker.app` hands each buffer to `TicketService.process`, which never raises — every
request ends marked done or failed by us, because celery-batches acks the whole buffer when the
batch function returns, whatever happened (a raised exception would lose every result).

Results stream out per forward batch: the engine hands each batch's predictions to the service
the moment they are computed, and the service publishes them then (results stream, Celery
backend, attempts keys) in pipelined round trips, instead of after the whole buffer. A packed
message's backend result is written once its last ticket is done.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import socket
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

import redis

from worker import constants as c
from worker.metrics import Metrics
from worker.results import BatchReport, Prediction
from worker.settings import Settings

log = logging.getLogger(__name__)

# Idempotent publish of one forward batch's results: the first final result for (task, slot) goes
# to the stream, repeats do not. One call per forward batch, not one per ticket.
# KEYS[1] results stream; KEYS[2..n+1] the done key of each result (DONE_KEY: task id, slot).
# ARGV[1] stream MAXLEN (approximate), ARGV[2] done-key expiry in seconds, ARGV[3..n+2] result JSON.
# Returns one flag per result: 1 published now, 0 published before (a re-execution).
PUBLISH_ONCE = """
local added = {}
for i = 2, #KEYS do
  if redis.call('SET', KEYS[i], '1', 'NX', 'EX', ARGV[2]) then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'data', ARGV[i + 1])
    added[i - 1] = 1
  else
    added[i - 1] = 0
  end
end
return added
"""

# Idempotent backend write, in Celery's own format (key `celery-task-meta-<id>`, the same value
# PUBLISHed on that key for pub/sub waiters, as RedisBackend.set does). SET NX keeps Celery's rule
# "a stored result is never overwritten by a later execution" without its extra GET round trip.
# KEYS[1] result key; ARGV[1] encoded meta, ARGV[2] expiry in seconds (0: none).
STORE_ONCE = """
local stored
if tonumber(ARGV[2]) > 0 then
  stored = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2])
else
  stored = redis.call('SET', KEYS[1], ARGV[1], 'NX')
end
if stored then
  redis.call('PUBLISH', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


class TicketRejected(ValueError):
    """A ticket or message that cannot be classified; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str | None = None) -> None:
        if detail is None:  # rebuilt by a Celery client from the stored message "reason: detail"
            reason, _, detail = reason.partition(": ")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __repr__(self) -> str:
        return f"TicketRejected({self.reason!r}, {self.detail!r})"


class Classifier(Protocol):
    labels: tuple[str, ...]

    def classify(
        self,
        texts: Sequence[str],
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: Callable[[Sequence[int], list[Prediction]], None] | None = None,
    ) -> Any: ...

    def reference(self, text: str) -> Prediction: ...


class Backend(Protocol):
    def mark_as_done(self, task_id: str, result: Any, request: Any = None) -> Any: ...

    def mark_as_failure(
        self, task_id: str, exc: BaseException, request: Any = None, call_errbacks: bool = True
    ) -> Any: ...


@dataclass(frozen=True)
class Ticket:
    id: str
    text: str
    submitted_at: float | None


@dataclass
class Slot:
    """One ticket's place in the buffer: which request, which position in a packed message."""

    request: Any
    index: int
    ticket: Ticket | None = None
    result: dict | None = None  # final per-ticket result once known


@dataclass
class Work:
    """The slots of one run, by message, and which messages are finished (backend result written)."""

    backend: Backend
    started: float  # unix time the run began: processing_s and time to first result count from here
    slots: list[Slot] = field(default_factory=list)
    by_task: dict[str, list[Slot]] = field(default_factory=dict)
    packed: dict[str, bool] = field(default_factory=dict)  # task id -> message carried a list
    published: set[str] = field(default_factory=set)  # task ids whose backend result is written
    first_out: bool = False  # the run's first result is published (time-to-first-result observed)

    def add(self, slot: Slot) -> None:
        self.slots.append(slot)
        self.by_task.setdefault(slot.request.id, []).append(slot)

    def completed_by(self, slots: Sequence[Slot]) -> list[str]:
        """Task ids among `slots` whose every ticket now has a result and that are not yet published."""
        touched = dict.fromkeys(slot.request.id for slot in slots if slot.request.id not in self.published)
        return [task_id for task_id in touched if all(s.result is not None for s in self.by_task[task_id])]

    def unfinished(self) -> list[Any]:
        """Requests whose backend result is not written yet (what a last line of defence may fail)."""
        return [slots[0].request for task_id, slots in self.by_task.items() if task_id not in self.published]


class PublishFailed(RuntimeError):
    """Publishing a forward batch's results failed (Redis away too long): not an engine error to retry."""


def parse_ticket(raw: Any, max_bytes: int) -> Ticket:
    """Validate one ticket payload at the edge; raise TicketRejected with a clear reason."""
    if not isinstance(raw, dict):
        raise TicketRejected("bad_payload", f"a ticket must be a JSON object, got {type(raw).__name__}")
    if "text" not in raw:
        raise TicketRejected("missing_field", "ticket has no 'text' field")
    text, ticket_id = raw["text"], raw.get("id")
    if not isinstance(text, str):
        raise TicketRejected("wrong_type", f"'text' must be a string, got {type(text).__name__}")
    if ticket_id is not None and not isinstance(ticket_id, str | int):
        raise TicketRejected("wrong_type", f"'id' must be a string or integer, got {type(ticket_id).__name__}")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # lone surrogates decoded from a JSON \\udcxx escape
        raise TicketRejected("invalid_utf8", f"text is not valid UTF-8 ({exc.reason})") from None
    if size > max_bytes:
        raise TicketRejected("oversize", f"text is {size} bytes, above TICKETQ_MAX_TICKET_BYTES={max_bytes}")
    if not text.strip():
        raise TicketRejected("empty_text", "ticket text is empty or whitespace only")
    submitted = raw.get("submitted_at")
    submitted = float(submitted) if isinstance(submitted, int | float) and math.isfinite(submitted) else None
    return Ticket(id=str(ticket_id) if ticket_id is not None else "", text=text, submitted_at=submitted)


class TicketService:
    """Owns a classifier, the Redis side-channels (results stream, dead letters) and the metrics."""

    def __init__(self, settings: Settings, classifier: Classifier, metrics: Metrics, client: redis.Redis) -> None:
        self.settings = settings
        self.classifier = classifier
        self.metrics = metrics
        self.redis = client
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self.model_fields = _model_fields(classifier, settings)
        self.shadow = ShadowChecker(classifier, metrics, settings.shadow_rate) if settings.shadow_rate > 0 else None

    # ----- the batch function --------------------------------------------------------------

    def process(self, requests: Sequence[Any], backend: Backend) -> None:
        """Classify and publish one buffer; never raises (see module docstring)."""
        self.metrics.flushes.inc()
        try:
            fresh, redelivered = self._triage(requests)
        except Exception as exc:  # Redis away for longer than worst_batch_s
            self._fail_batch(requests, backend, exc)
            return
        self._run(fresh, backend)
        for request in redelivered:
            self._run([request], backend, count_delivery=True)

    def _run(self, requests: Sequence[Any], backend: Backend, count_delivery: bool = False) -> None:
        """Classify `requests` as one batch, publishing per forward batch; fail what is left on an unexpected error."""
        started = time.time()
        work: Work | None = None
        try:
            if not requests or (count_delivery and self._too_many_deliveries(requests[0], backend)):
                return
            work = self._unpack(requests, backend, started)
            self._expire(work)
            self._deliver(work, [s for s in work.slots if s.result is not None])
            self._classify(work, [s for s in work.slots if s.result is None])
        except Exception as exc:  # last line of defence: what is already published stays published
            self._fail_batch(requests if work is None else work.unfinished(), backend, exc)

    def _fail_batch(self, requests: Sequence[Any], backend: Backend, exc: Exception) -> None:
        log.exception("batch of %d requests failed outside the engine", len(requests))
        self._fail_open(requests, backend, exc)

    def _triage(self, requests: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Split the buffer into first deliveries (counted now) and redelivered messages.

        A message whose attempts key still exists was in a batch that never finished: its worker
        died, maybe because of one ticket in that batch. Each such message runs alone, after the
        fresh batch and least-tried first, and counts its delivery only when it runs: a ticket that
        kills workers spends its own deliveries, not those of the tickets that shared its batch
        (counting the whole buffer up front dead-lettered them all together).
        """
        keys = [c.ATTEMPTS_KEY.format(task_id=request.id) for request in requests]
        seen = self._retrying(lambda: self.redis.mget(keys)) if keys else []
        fresh = [request for request, count in zip(requests, seen, strict=True) if count is None]
        redelivered = sorted(
            ((int(count), request) for request, count in zip(requests, seen, strict=True) if count is not None),
            key=lambda pair: pair[0],
        )
        if fresh:
            self._retrying(lambda: self._incr_attempts(*(c.ATTEMPTS_KEY.format(task_id=r.id) for r in fresh)))
        return fresh, [request for _, request in redelivered]

    def _unpack(self, requests: Sequence[Any], backend: Backend, started: float) -> Work:
        work = Work(backend, started)
        for request in requests:
            # Not a list (a hand-built message): treat as no arguments; tuple() of it could raise
            # and fail the whole buffer instead of this one request.
            args = tuple(request.args) if isinstance(request.args, list | tuple) else ()
            # A wrong argument count is dead-lettered with the arguments as they came.
            payload = args[0] if len(args) == 1 else list(args)
            packed = len(args) == 1 and isinstance(payload, list)
            work.packed[request.id] = packed
            raws = payload if packed else [payload]
            if packed and not raws:
                raws = [None]
            for index, raw in enumerate(raws):
                slot = Slot(request, index)
                try:
                    if len(args) != 1:
                        raise TicketRejected("bad_payload", f"expected one argument (ticket or list), got {len(args)}")
                    slot.ticket = parse_ticket(raw, self.settings.max_ticket_bytes)
                except TicketRejected as rejection:
                    slot.result = self._reject(request, index, raw, rejection)
                work.add(slot)
        return work

    def _expire(self, work: Work) -> None:
        """Tickets of a message past its Celery `expires` get an `expired` result and are not computed.

        Celery's own strategy revokes expired messages, but celery-batches buffers them without
        looking; the deadline travels in the message headers (`request_dict["expires"]`, ISO 8601).
        """
        now = work.started
        for slot in work.slots:
            deadline = message_deadline(slot.request)
            if slot.result is None and deadline is not None and deadline <= now:
                when = datetime.fromtimestamp(deadline, timezone.utc).isoformat()
                late = f"deadline {when} passed {now - deadline:.3f}s before the batch started"
                raw = {**_raw(slot.ticket), "id": slot.ticket.id or _slot_id(slot)}
                slot.result = self._failure(slot.request, slot.index, raw, TicketRejected("expired", late))

    def _too_many_deliveries(self, request: Any, backend: Backend) -> bool:
        """A message redelivered past max_retries (its batch keeps killing workers) is dead-lettered."""
        key = c.ATTEMPTS_KEY.format(task_id=request.id)
        attempts = self._retrying(lambda: self._incr_attempts(key))
        if attempts <= self.settings.max_retries + 1:
            return False
        rejection = TicketRejected("too_many_deliveries", f"delivered {attempts} times; it may crash workers")
        self._dead_letter(request, None, request.args, rejection)
        self._retrying(lambda: _mark_failed(backend, request, rejection))
        return True

    def _incr_attempts(self, *keys: str) -> int:
        """INCR each attempts key (with its expiry); the first key's new count."""
        pipe = self.redis.pipeline()
        for key in keys:
            pipe.incr(key)
            pipe.expire(key, self.settings.result_expires_s)
        return int(pipe.execute()[0])

    # ----- classification with retries, results as each forward batch finishes ------------

    def _classify(self, work: Work, slots: list[Slot]) -> None:
        if not slots:
            return
        for slot in slots:
            if slot.ticket.submitted_at:
                self.metrics.queue_wait.observe(max(0.0, work.started - slot.ticket.submitted_at))
        self._classify_resilient(work, slots, attempt=1)

    def _classify_resilient(self, work: Work, slots: list[Slot], attempt: int) -> None:
        """Classify, publishing each forward batch as it finishes; on an engine error retry what is
        still open in halves, and single tickets up to max_retries."""

        def publish(indices: Sequence[int], predictions: list[Prediction]) -> None:
            try:
                self._on_predictions(work, [slots[i] for i in indices], predictions)
            except Exception as exc:  # surfaced as PublishFailed so it is never retried as an engine error
                raise PublishFailed(f"publishing {len(indices)} results failed: {exc!r}") from exc

        try:
            predictions, _ = self.classifier.classify(
                [s.ticket.text for s in slots], on_batch=self._observe, on_predictions=publish
            )
        except PublishFailed:
            raise
        except Exception as exc:
            self._retry_open(work, [s for s in slots if s.result is None], attempt, exc)
            return
        # A classifier that does not call on_predictions still gets its answers published here.
        rest = [(slot, prediction) for slot, prediction in zip(slots, predictions, strict=True) if slot.result is None]
        if rest:
            self._on_predictions(work, [s for s, _ in rest], [p for _, p in rest])

    def _retry_open(self, work: Work, slots: list[Slot], attempt: int, exc: Exception) -> None:
        if len(slots) > 1:
            log.warning("engine failed on %d tickets (%r); retrying in halves", len(slots), exc)
            middle = len(slots) // 2
            self._classify_resilient(work, slots[:middle], attempt)
            self._classify_resilient(work, slots[middle:], attempt)
        elif len(slots) == 1 and attempt <= self.settings.max_retries:
            self._classify_resilient(work, slots, attempt + 1)
        elif slots:
            slot = slots[0]
            rejection = TicketRejected("engine_error", f"{type(exc).__name__}: {exc} (after {attempt} attempts)")
            slot.result = self._reject(slot.request, slot.index, _raw(slot.ticket), rejection)
            self._deliver(work, [slot])

    def _on_predictions(self, work: Work, slots: list[Slot], predictions: list[Prediction]) -> None:
        """One forward batch is computed: its results go out now."""
        for slot, prediction in zip(slots, predictions, strict=True):
            slot.result = self._success(slot, prediction, work.started)
            if self.shadow:
                self.shadow.offer(slot.ticket.text, prediction)
        self._deliver(work, slots)

    def _observe(self, report: BatchReport) -> None:
        self.metrics.observe_batch(report.rows, report.width, report.real_tokens, report.seconds)

    # ----- results -------------------------------------------------------------------------

    def _success(self, slot: Slot, prediction: Prediction, started: float) -> dict:
        ticket = slot.ticket
        return {
            "id": ticket.id or _slot_id(slot),
            "task_id": slot.request.id,
            "status": "ok",
            "label": prediction.label,
            "probs": prediction.probs,
            "margin": prediction.margin,
            "truncated": prediction.truncated,
            **self.model_fields,
            "worker": self.worker_name,
            "queue_wait_s": round(started - ticket.submitted_at, 6) if ticket.submitted_at else None,
            "processing_s": round(time.time() - started, 6),
        }

    def _reject(self, request: Any, index: int, raw: Any, rejection: TicketRejected) -> dict:
        """A failed result whose raw payload also goes to the dead-letter stream."""
        self._dead_letter(request, index, raw, rejection)
        return self._failure(request, index, raw, rejection)

    def _failure(self, request: Any, index: int, raw: Any, rejection: TicketRejected) -> dict:
        ticket_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str | int) else None
        return {
            "id": str(ticket_id) if ticket_id is not None else f"{request.id}:{index}",
            "task_id": request.id,
            "status": "failed",
            "reason": rejection.reason,
            "error": str(rejection),
            "worker": self.worker_name,
        }

    def _deliver(self, work: Work, slots: list[Slot]) -> None:
        """Publish the final results of `slots` now: one pipelined round trip for their stream
        entries (and the attempts keys of the messages they complete), one for the backend."""
        if not slots:
            return
        begun = time.perf_counter()
        complete = work.completed_by(slots)
        self._retrying(lambda: self._stream(slots, complete))
        self._store(work, complete)
        work.published.update(complete)
        self.metrics.publish.observe(time.perf_counter() - begun)
        self._count(slots)
        if not work.first_out:
            work.first_out = True
            self.metrics.first_result.observe(max(0.0, time.time() - work.started))

    def _stream(self, slots: list[Slot], complete: list[str]) -> None:
        """One PUBLISH_ONCE for all `slots` and DEL of the completed messages' attempts keys, in one pipeline.

        EVAL, not a registered Script: redis-py checks SCRIPT EXISTS before every pipeline that
        holds a Script (a second round trip per forward batch, a third of the publish time in a
        profile); EVAL of a short body costs a few hundred bytes and Redis caches the compiled script.

        Deleting an attempts key before the backend write is safe: a crash in between only makes
        the redelivered message look fresh, and its results are published once anyway.
        """
        keys = [c.RESULTS_STREAM, *(c.DONE_KEY.format(task_id=slot.request.id, slot=slot.index) for slot in slots)]
        args = [self.settings.stream_maxlen, self.settings.result_expires_s, *(json.dumps(s.result) for s in slots)]
        pipe = self.redis.pipeline(transaction=False)
        pipe.eval(PUBLISH_ONCE, len(keys), *keys, *args)
        for task_id in complete:
            pipe.delete(c.ATTEMPTS_KEY.format(task_id=task_id))
        added = pipe.execute()[0]
        repeated = [slot for slot, entry in zip(slots, added, strict=True) if not entry]
        if repeated:
            self.metrics.duplicates.inc(len(repeated))
            tasks = sorted({slot.request.id for slot in repeated})
            log.info("re-executed: %d result(s) of %s already published, not repeated", len(repeated), tasks[:5])

    def _store(self, work: Work, complete: list[str]) -> None:
        """The backend state producers wait on: successes pipelined, failures one by one (rare)."""
        successes = []
        for task_id in complete:
            slots = work.by_task[task_id]
            request, results = slots[0].request, [slot.result for slot in slots]
            if getattr(request, "ignore_result", False):
                continue
            if work.packed[task_id]:
                successes.append((request, results))
            elif results[0]["status"] == "ok":
                successes.append((request, results[0]))
            else:
                error = TicketRejected(results[0]["reason"], results[0]["error"].split(": ", 1)[-1])
                self._retrying(lambda request=request, error=error: _mark_failed(work.backend, request, error))
        if successes:
            self._retrying(lambda: self._store_successes(work.backend, successes))

    def _store_successes(self, backend: Backend, successes: list[tuple[Any, Any]]) -> None:
        client = getattr(backend, "client", None)
        if not isinstance(client, redis.Redis):  # not a Redis backend: Celery's own write, one per task
            for request, value in successes:
                backend.mark_as_done(request.id, value, request=request)
            return
        expires = int(backend.expires or 0)
        pipe = client.pipeline(transaction=False)
        for request, value in successes:
            meta = success_meta(backend, request.id, value)
            pipe.eval(STORE_ONCE, 1, backend.get_key_for_task(request.id), backend.encode(meta), expires)
        pipe.execute()

    def _count(self, slots: list[Slot]) -> None:
        now = time.time()
        for slot in slots:
            result = slot.result
            outcome = _outcome(result)
            self.metrics.tickets.labels(label=result.get("label", "none"), outcome=outcome).inc()
            if slot.ticket and slot.ticket.submitted_at and outcome == "ok":
                self.metrics.latency.observe(max(0.0, now - slot.ticket.submitted_at))

    def _dead_letter(self, request: Any, index: int | None, raw: Any, rejection: TicketRejected) -> None:
        entry = {
            "task_id": request.id,
            "slot": "" if index is None else str(index),
            "reason": rejection.reason,
            "error": str(rejection),
            "payload": _dump(raw),
            "worker": self.worker_name,
            "at": f"{time.time():.3f}",
        }
        self._retrying(lambda: self.redis.xadd(c.DEAD_LETTER_STREAM, entry, maxlen=self.settings.stream_maxlen))
        self.metrics.dead_letters.labels(reason=rejection.reason).inc()
        log.warning("dead-lettered task %s slot %s: %s", request.id, entry["slot"], rejection)

    def _fail_open(self, requests: Sequence[Any], backend: Backend, exc: Exception) -> None:
        error = TicketRejected("worker_error", f"{type(exc).__name__}: {exc}")
        for request in requests:
            try:
                _mark_failed(backend, request, error)
                self._dead_letter(request, None, request.args, error)
            except Exception:  # Redis gone too: the message is acked; log loudly so it is visible
                log.exception("could not mark task %s failed", request.id)

    def _retrying(self, action: Callable[[], Any]) -> Any:
        """Run a Redis write, riding out a broker restart for up to TICKETQ_WORST_BATCH_S seconds."""
        deadline = time.monotonic() + self.settings.worst_batch_s
        delay = 0.1
        while True:
            try:
                return action()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)


def message_deadline(request: Any) -> float | None:
    """A Celery message's `expires` as a unix time, or None (no deadline, or one we cannot read).

    celery-batches' SimpleRequest does not copy `Request.expires`, but keeps every header in
    `request_dict`; Celery sends `expires` as an ISO 8601 string (UTC when no offset is given).
    """
    headers = getattr(request, "request_dict", None)
    expires = headers.get("expires") if isinstance(headers, dict) else None
    if not isinstance(expires, str):
        return None
    try:
        when = datetime.fromisoformat(expires)
    except ValueError:
        log.warning("task %s: unreadable expires %r ignored", getattr(request, "id", "?"), expires[:64])
        return None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def success_meta(backend: Any, task_id: str, value: Any) -> dict:
    """Celery's result meta for a SUCCESS, as `BaseBackend._store_result` builds it (result_extended off).

    Built from public API only (`app.now`, the backend's `encode` serialises it); ticketq tasks have
    no children, group or parent, and the worker runs with `result_extended=False`.
    """
    return {
        "status": "SUCCESS",
        "result": value,
        "traceback": None,
        "children": [],
        "date_done": backend.app.now().isoformat(),
        "task_id": task_id,
    }


class ShadowChecker:
    """Re-runs a sample of tickets through the reference path on a background thread.

    `ticketq_shadow_agreed_total / ticketq_shadow_checked_total` shows, live, whether the
    optimised path still answers as the reference does. The queue is bounded: when the checker
    falls behind, samples are dropped (and counted), never the hot path slowed.
    """

    def __init__(self, classifier: Classifier, metrics: Metrics, rate: float, capacity: int = 256) -> None:
        self.classifier = classifier
        self.metrics = metrics
        self.rate = rate
        self.dropped = metrics.shadow_dropped
        self._queue: queue.Queue[tuple[str, Prediction]] = queue.Queue(maxsize=capacity)
        self._random = random.Random(0)
        threading.Thread(target=self._run, name="ticketq-shadow", daemon=True).start()

    def offer(self, text: str, prediction: Prediction) -> None:
        if self._random.random() >= self.rate:
            return
        try:
            self._queue.put_nowait((text, prediction))
        except queue.Full:
            self.dropped.inc()

    def join(self) -> None:
        self._queue.join()

    def _run(self) -> None:
        while True:
            text, served = self._queue.get()
            try:
                reference = self.classifier.reference(text)
                self.metrics.shadow_checked.inc()
                if reference.label == served.label:
                    self.metrics.shadow_agreed.inc()
                else:
                    log.error("SHADOW MISMATCH: served %s, reference %s (%r)", served, reference, text[:80])
            except Exception:
                log.exception("shadow check failed")
            finally:
                self._queue.task_done()


def _mark_failed(backend: Backend, request: Any, exc: BaseException) -> None:
    # call_errbacks=False: Celery's mark_as_failure reads `request.errbacks` after storing the
    # state, and celery-batches' SimpleRequest has no such attribute. The AttributeError used to
    # reach process()'s last line of defence, which then marked the whole buffer failed (successes
    # included) and dead-lettered every ticket in it a second time. Batch tasks carry no errbacks.
    backend.mark_as_failure(request.id, exc, request=request, call_errbacks=False)


def _model_fields(classifier: Classifier, settings: Settings) -> dict:
    info = getattr(classifier, "info", None)
    return {
        "model": info.name if info else "null-classifier",
        "standin": bool(info and info.standin),
    }


def _outcome(result: dict) -> str:
    if result["status"] == "ok":
        return "ok"
    if result["reason"] == "expired":
        return "expired"
    return "failed" if result["reason"] in ("engine_error", "worker_error") else "rejected"


def _slot_id(slot: Slot) -> str:
    return f"{slot.request.id}:{slot.index}" if slot.index else slot.request.id


def _raw(ticket: Ticket) -> dict:
    return {"id": ticket.id, "text": ticket.text, "submitted_at": ticket.submitted_at}


def _dump(raw: Any) -> str:
    try:
        return json.dumps(raw, ensure_ascii=True)[:65536]
    except (TypeError, ValueError):
        return repr(raw)[:65536]


# Fault injection for the reliability tests only; never set it in a deployment (see NullClassifier).
POISON_MARKER_ENV = "TICKETQ_TEST_POISON_MARKER"


class EngineFault(RuntimeError):
    """Raised by the null classifier's fault-injection hook, standing in for an engine exception."""


class NullClassifier:
    """Zero-cost classifier (TICKETQ_NULL_CLASSIFIER=1): only for measuring the queue's own ceiling.

    Labels are a hash of the text; no model is loaded. Token counts are bytes/4, roughly BPE's.

    Fault-injection hook, for tests only: with `TICKETQ_TEST_POISON_MARKER=<marker>` in the
    environment, a batch holding a text that contains `<marker>` raises `EngineFault` (an engine
    exception), and a text containing `<marker>:exit` ends the process with `os._exit(1)` (a
    worker that crashes on a ticket). The variable is deliberately outside `Settings`, is read
    only by this test classifier and the marker is chosen by the test, so no real ticket or
    deployment trips it by accident.
    """

    info = None

    def __init__(self, labels: tuple[str, ...], poison_marker: str | None = None) -> None:
        self.labels = labels
        self.poison_marker = poison_marker if poison_marker is not None else os.environ.get(POISON_MARKER_ENV) or None
        if self.poison_marker:
            log.warning("%s is set: tickets containing %r fail on purpose", POISON_MARKER_ENV, self.poison_marker)

    def classify(
        self,
        texts: Sequence[str],
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: Callable[[Sequence[int], list[Prediction]], None] | None = None,
    ):
        if self.poison_marker:
            self._inject_faults(texts)
        predictions = [self.reference(text) for text in texts]
        lengths = [len(text) // 4 + 1 for text in texts]
        report = BatchReport(rows=len(texts), width=max(lengths), real_tokens=sum(lengths), seconds=0.0)
        if on_batch:
            on_batch(report)
        if on_predictions:  # one "forward batch" holding every text
            on_predictions(range(len(texts)), predictions)
        return predictions, [report]

    def reference(self, text: str) -> Prediction:
        label = self.labels[zlib.crc32(text.encode("utf-8", "surrogatepass")) % len(self.labels)]
        probs = {name: float(name == label) for name in self.labels}
        return Prediction(label=label, probs=probs, margin=1.0, truncated=False, tokens=len(text) // 4 + 1)

    def _inject_faults(self, texts: Sequence[str]) -> None:
        marker = self.poison_marker
        if any(f"{marker}:exit" in text for text in texts):
            log.critical("fault injection: crashing the worker process on a %s:exit ticket", marker)
            logging.shutdown()
            os._exit(1)
        poisoned = sum(marker in text for text in texts)
        if poisoned:
            log.warning("fault injection: engine fault on a batch of %d texts (%d poisoned)", len(texts), poisoned)
            raise EngineFault(f"injected engine fault ({poisoned} poisoned ticket(s) in a batch of {len(texts)})")
