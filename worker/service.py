"""What a worker does with one drained buffer of Celery requests: validate, classify, publish.

Celery-free by design (requests only need `.id` and `.args`): the glue in `worker.app` hands
each buffer to `TicketService.process`, which never raises — every request ends marked done or
failed by us, because celery-batches acks the whole buffer when the batch function returns,
whatever happened (a raised exception would lose every result).
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
from typing import Any, Protocol

import redis

from worker import constants as c
from worker.metrics import Metrics
from worker.results import BatchReport, Prediction
from worker.settings import Settings

log = logging.getLogger(__name__)

# Idempotent publish: the first final result for (task, slot) goes to the stream, repeats do not.
PUBLISH_ONCE = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[3]) then
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'data', ARGV[1])
end
return false
"""


class TicketRejected(ValueError):
    """A ticket or message that cannot be classified; `reason` is a short machine-readable code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __repr__(self) -> str:
        return f"TicketRejected({self.reason!r}, {self.detail!r})"


class Classifier(Protocol):
    labels: tuple[str, ...]

    def classify(self, texts: Sequence[str], on_batch: Callable[[BatchReport], None] | None = None) -> Any: ...

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
    slots: list[Slot] = field(default_factory=list)
    packed: dict[str, bool] = field(default_factory=dict)  # task id -> message carried a list


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
        self._publish_once = client.register_script(PUBLISH_ONCE)
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
        """Classify and publish `requests` as one batch; mark them failed on an unexpected error."""
        started = time.time()
        try:
            if count_delivery and self._too_many_deliveries(requests[0], backend):
                return
            work = self._unpack(requests)
            live = [s for s in work.slots if s.ticket is not None and s.result is None]
            self._classify(live, started)
            self._publish(work, backend, started)
        except Exception as exc:  # last line of defence: mark everything still open as failed
            self._fail_batch(requests, backend, exc)

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

    def _unpack(self, requests: Sequence[Any]) -> Work:
        work = Work()
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
                work.slots.append(slot)
        return work

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

    # ----- classification with retries ----------------------------------------------------

    def _classify(self, slots: list[Slot], started: float) -> None:
        if not slots:
            return
        for slot in slots:
            if slot.ticket.submitted_at:
                self.metrics.queue_wait.observe(max(0.0, started - slot.ticket.submitted_at))
        self._classify_resilient(slots, started, attempt=1)

    def _classify_resilient(self, slots: list[Slot], started: float, attempt: int) -> None:
        """Classify; on an engine error split the batch in halves, and retry single tickets up to max_retries."""
        try:
            predictions, _ = self.classifier.classify([s.ticket.text for s in slots], on_batch=self._observe)
        except Exception as exc:
            if len(slots) > 1:
                log.warning("engine failed on %d tickets (%r); retrying in halves", len(slots), exc)
                middle = len(slots) // 2
                self._classify_resilient(slots[:middle], started, attempt)
                self._classify_resilient(slots[middle:], started, attempt)
            elif attempt <= self.settings.max_retries:
                self._classify_resilient(slots, started, attempt + 1)
            else:
                slot = slots[0]
                rejection = TicketRejected("engine_error", f"{type(exc).__name__}: {exc} (after {attempt} attempts)")
                slot.result = self._reject(slot.request, slot.index, _raw(slot.ticket), rejection)
            return
        for slot, prediction in zip(slots, predictions, strict=True):
            slot.result = self._success(slot, prediction, started)
            if self.shadow:
                self.shadow.offer(slot.ticket.text, prediction)

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
        self._dead_letter(request, index, raw, rejection)
        ticket_id = raw.get("id") if isinstance(raw, dict) and isinstance(raw.get("id"), str | int) else None
        return {
            "id": str(ticket_id) if ticket_id is not None else f"{request.id}:{index}",
            "task_id": request.id,
            "status": "failed",
            "reason": rejection.reason,
            "error": str(rejection),
            "worker": self.worker_name,
        }

    def _publish(self, work: Work, backend: Backend, started: float) -> None:
        by_request: dict[str, list[Slot]] = {}
        for slot in work.slots:
            by_request.setdefault(slot.request.id, []).append(slot)
        for task_id, slots in by_request.items():
            self._publish_request(task_id, slots, work.packed[task_id], backend)

    def _publish_request(self, task_id: str, slots: list[Slot], packed: bool, backend: Backend) -> None:
        """Results stream first (idempotent), then the backend state the producer waits on."""
        request = slots[0].request
        results = [slot.result for slot in slots]
        self._retrying(lambda: self._stream(task_id, results))
        if packed:
            self._retrying(lambda: backend.mark_as_done(task_id, results, request=request))
        elif results[0]["status"] == "ok":
            self._retrying(lambda: backend.mark_as_done(task_id, results[0], request=request))
        else:
            error = TicketRejected(results[0]["reason"], results[0]["error"].split(": ", 1)[-1])
            self._retrying(lambda: _mark_failed(backend, request, error))
        self._retrying(lambda: self.redis.delete(c.ATTEMPTS_KEY.format(task_id=task_id)))
        self._count(slots)

    def _stream(self, task_id: str, results: list[dict]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for index, result in enumerate(results):
            keys = [c.DONE_KEY.format(task_id=task_id, slot=index), c.RESULTS_STREAM]
            args = [json.dumps(result), self.settings.stream_maxlen, self.settings.result_expires_s]
            self._publish_once(keys=keys, args=args, client=pipe)
        added = pipe.execute()
        duplicates = sum(1 for entry in added if not entry)
        if duplicates:
            self.metrics.duplicates.inc(duplicates)
            log.info("task %s re-executed: %d result(s) already published, not repeated", task_id, duplicates)

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

    def classify(self, texts: Sequence[str], on_batch: Callable[[BatchReport], None] | None = None):
        if self.poison_marker:
            self._inject_faults(texts)
        predictions = [self.reference(text) for text in texts]
        lengths = [len(text) // 4 + 1 for text in texts]
        report = BatchReport(rows=len(texts), width=max(lengths), real_tokens=sum(lengths), seconds=0.0)
        if on_batch:
            on_batch(report)
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
