"""What a worker does with one drained buffer of Celery requests: validate, classify, publish.

Celery-free by design (requests only need `.id`, `.args` and optionally `.request_dict`): the
glue in `worker.app` hands each buffer to `TicketService.process`, which never raises — every
request ends marked done or failed by us, because whatever a job has not acknowledged when the
batch function returns is acked then, whatever happened (a raised exception would lose every
result).

Results stream out per forward batch: the engine hands each batch's predictions to the service
the moment they are computed, and the service publishes them then (results stream, Celery
backend, attempts keys) in pipelined round trips, instead of after the whole buffer. A packed
message's backend result is written once its last ticket is done.

Between two forwards the running job takes the requests that arrived meanwhile from its `Feed`
(`worker.transport.batches.Batches`): they are triaged and validated like the first ones and join the
engine's plan, so every forward is chosen from everything waiting at its start. A message is
acknowledged through the feed as soon as its result is out, not when the job ends.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

import redis

from ticketq import codec
from ticketq.contract import Reason, Ticket, TicketRejected, result_id, validate_ticket
from ticketq.errors import TicketqError
from ticketq.schema import DEFAULT_SCHEMA_NAME, TicketFields
from worker.metrics import Metrics
from worker.progress import CLASSIFYING
from worker.results import BatchReport, Prediction
from worker.settings import Settings
from worker.shadow import ShadowChecker
from worker.store import Outbox, Unconfirmed, dead_letter_bound, payload_digest, ticket_entry

log = logging.getLogger(__name__)


class Classifier(Protocol):
    """What the service needs of a classifier (`worker.engine.Engine`, `NullClassifier`, or a
    `classifier_factory`'s own). `classify` calls `on_predictions` once per forward batch and asks
    `more()` for tickets that arrived meanwhile; it may ignore `more` (its jobs then take no
    arrivals, which wait for the next job)."""

    labels: tuple[str, ...]

    def classify(
        self,
        texts: Sequence[str],
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: Callable[[Sequence[int], list[Prediction]], None] | None = None,
        more: Callable[[], Sequence[str]] | None = None,
    ) -> Any: ...

    def reference(self, text: str) -> Prediction: ...


class Backend(Protocol):
    def mark_as_done(self, task_id: str, result: Any, request: Any = None) -> Any: ...

    def mark_as_failure(
        self, task_id: str, exc: BaseException, request: Any = None, call_errbacks: bool = True
    ) -> Any: ...


class Feed(Protocol):
    """Where the running job finds more work, and tells that a message is finished."""

    def more(self) -> list[Any]:
        """Requests that arrived since the job started; from now on they are part of it."""
        ...

    def done(self, task_ids: Sequence[str], failures: Mapping[str, str] | None = None,
             answers: Mapping[str, str] | None = None) -> None:  # fmt: skip
        """These messages' results are out: acknowledge them (never raises). `failures`: the error
        of each that ended in state FAILURE; `answers`: a short text of each one's answer."""
        ...

    def taken_over(self, task_ids: Sequence[str]) -> set[str]:
        """Those of these messages that another worker took over (this worker's lease lapsed):
        theirs to answer, not this worker's to fail. May raise Redis' errors."""
        ...


@dataclass(slots=True)
class Slot:
    """One ticket's place in the buffer: which request, which position in a packed message."""

    request: Any
    index: int
    joined: float  # unix time the ticket joined the run: its queue wait ends and its processing starts
    packed: bool = False  # the message carried a list of tickets
    ticket: Ticket | None = None
    schema: str | None = None  # the schema its answer comes from (None: the classifier's own field)
    result: dict | None = None  # final per-ticket result once known
    encoded: bytes = b""  # the result as JSON, serialised once for the stream and the backend


@dataclass
class Work:
    """The slots of one run, by message, and which messages are finished (backend result written)."""

    backend: Backend
    started: float  # unix time the run began: time to first result counts from here
    feed: Feed | None = None
    slots: list[Slot] = field(default_factory=list)
    by_task: dict[str, list[Slot]] = field(default_factory=dict)
    packed: dict[str, bool] = field(default_factory=dict)  # task id -> message carried a list
    digests: dict[str, str] = field(default_factory=dict)  # task id -> payload_digest of its arguments
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


class PublishFailed(TicketqError, RuntimeError):
    """Publishing a forward batch's results failed (Redis away too long): not an engine error to retry."""


class TicketService:
    """Owns a classifier, the Redis side-channels (results stream, dead letters) and the metrics."""

    def __init__(self, settings: Settings, classifier: Classifier, metrics: Metrics, client: redis.Redis,
                 on_forward: Callable[[BatchReport], None] | None = None) -> None:  # fmt: skip
        """`on_forward` hears every forward's report too (the live cost model)."""
        self.settings = settings
        self.on_forward = on_forward
        self.classifier = classifier
        self.metrics = metrics
        self.redis = client
        self.outbox = Outbox.from_settings(client, settings)
        self.worker_name = f"{socket.gethostname()}:{os.getpid()}"
        self.model_fields = _model_fields(classifier, settings)
        self.schemas = _schema_set(classifier, settings)
        own = getattr(classifier, "schema", None)
        self.known_schemas = self.schemas.names if self.schemas else (own.name if own else DEFAULT_SCHEMA_NAME,)
        self.shadow = ShadowChecker(classifier, metrics, settings.shadow_rate) if settings.shadow_rate > 0 else None
        self.job_limit = 4 * settings.effective_prefetch  # tickets one job takes in before it ends
        self.dead_letter_limit = dead_letter_bound(settings.max_ticket_bytes)

    # ----- the batch function --------------------------------------------------------------

    def process(self, requests: Sequence[Any], backend: Backend, feed: Feed | None = None) -> None:
        """Classify and publish one buffer (and what `feed` adds while it runs); never raises (see
        module docstring). Work is in hand meanwhile: the lease promises progress on it
        (`worker.progress`)."""
        self.metrics.flushes.inc()
        CLASSIFYING.begin(self.settings.worst_batch_s)
        try:
            triaged = self._triage_or_fail(requests, backend, feed)
            if triaged is None:
                return
            fresh, redelivered = triaged
            self._guarded(fresh, backend, feed, lambda work: self._run_batch(work, fresh, redelivered))
            for request in redelivered:
                self._guarded([request], backend, feed, lambda work, request=request: self._run_alone(work, request))
        finally:
            CLASSIFYING.end()

    def _guarded(self, requests: Sequence[Any], backend: Backend, feed: Feed | None,
                 run: Callable[[Work], None]) -> None:  # fmt: skip
        """`run` on a new Work for `requests`; on an unexpected error fail what it has not finished."""
        if not requests:
            return
        work: Work | None = None
        try:
            work = Work(backend, time.time(), feed)
            run(work)
        except Exception as exc:  # last line of defence: what is already published stays published
            self._fail_batch(requests if work is None else work.unfinished(), backend, exc, feed)
            if work is not None:
                self._settle_unconfirmed(work, exc)

    def _settle_unconfirmed(self, work: Work, exc: Exception) -> None:
        """A publish that gave up may have run after all (sent into a partition, it arrives when
        the link heals): count the results it streamed, which every later publish finds repeated."""
        cause = exc.__cause__ if isinstance(exc, PublishFailed) else exc
        if not isinstance(cause, Unconfirmed):
            return
        try:
            landed = self.outbox.landed(cause)
        except Exception as error:  # Redis still away: those results are counted by no one
            log.warning("could not learn whether %d unconfirmed result(s) were published (%s)", len(cause.order), error)
            return
        if landed is None:
            return
        skipped = {*landed.repeats, *landed.conflicts}
        by_place = {(slot.request.id, slot.index): slot for slot in work.slots}
        streamed = [by_place[place] for place in cause.order if place not in skipped and place in by_place]
        self._count_outcomes([slot for slot in streamed if slot.result is not None])
        log.info("an unconfirmed publish of %d result(s) ran after all: %d streamed by this worker",
                 len(cause.order), len(streamed))  # fmt: skip

    def _run_batch(self, work: Work, requests: Sequence[Any], redelivered: list[Any]) -> None:
        """First deliveries as one batch; arrivals through the feed join it between forwards (the
        redelivered among them are appended to `redelivered`, to run alone after)."""
        slots = self._admit(work, requests)
        arrivals = self._arrivals(work, slots, redelivered) if work.feed is not None else None
        self._classify(work, slots, arrivals)

    def _run_alone(self, work: Work, request: Any) -> None:
        """A redelivered message, alone, its delivery counted now: past max_retries it is dead-lettered."""
        if not self._too_many_deliveries(request, work.backend):
            self._classify(work, self._admit(work, [request]))

    def _admit(self, work: Work, requests: Sequence[Any]) -> list[Slot]:
        """Unpack `requests` into `work`; refused and expired tickets are answered now. Returns the
        slots to classify."""
        slots = self._unpack(work, requests)
        self._expire(slots)
        self._publish(work, [s for s in slots if s.result is not None])
        return [s for s in slots if s.result is None]

    def _arrivals(self, work: Work, slots: list[Slot], redelivered: list[Any]) -> Callable[[], list]:
        """The engine's `more`: requests that arrived during the last forward join `slots` (so the
        engine's indices into its texts stay indices into `slots`); their `_items` are returned."""

        def more() -> list[str]:
            # A job under steady traffic would never end: bound it, so redelivered messages (which
            # run alone, after) do not wait for a lull and `work` does not grow without end.
            if redelivered or len(work.slots) >= self.job_limit:
                return []
            requests = work.feed.more()
            if not requests:
                return []
            triaged = self._triage_or_fail(requests, work.backend, work.feed)
            if triaged is None:
                return []
            fresh, again = triaged
            redelivered.extend(again)
            added = self._admit(work, fresh)
            self._observe_wait(added)
            slots.extend(added)
            return self._items(added)

        return more

    def _triage_or_fail(self, requests: Sequence[Any], backend: Backend,
                        feed: Feed | None) -> tuple[list[Any], list[Any]] | None:  # fmt: skip
        """`_triage`, or None once every request is failed (Redis away for longer than worst_batch_s)."""
        try:
            return self._triage(requests)
        except Exception as exc:
            self._fail_batch(requests, backend, exc, feed)
            return None

    def _fail_batch(self, requests: Sequence[Any], backend: Backend, exc: Exception, feed: Feed | None) -> None:
        cause = exc.__cause__ if isinstance(exc, PublishFailed) else exc
        if isinstance(cause, redis.ConnectionError | redis.TimeoutError):  # an outage, not a bug: no traceback
            log.error("batch of %d requests stopped: Redis unreachable for longer than TICKETQ_WORST_BATCH_S "
                      "(%ss): %s", len(requests), self.settings.worst_batch_s, cause)  # fmt: skip
        else:
            log.exception("batch of %d requests failed outside the engine", len(requests))
        self._fail_open(requests, backend, exc, feed)

    def _triage(self, requests: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """Split the buffer into first deliveries (counted now) and redelivered messages.

        A message whose attempts key still exists was in a batch that never finished: its worker
        died, maybe because of one ticket in that batch. Each such message runs alone, after the
        fresh batch and least-tried first, and counts its delivery only when it runs: a ticket that
        kills workers spends its own deliveries, not those of the tickets that shared its batch
        (counting the whole buffer up front dead-lettered them all together).
        """
        seen = self.outbox.attempts([request.id for request in requests])
        fresh = [request for request, count in zip(requests, seen, strict=True) if count is None]
        redelivered = sorted(
            ((count, request) for request, count in zip(requests, seen, strict=True) if count is not None),
            key=lambda pair: pair[0],
        )
        if fresh:
            self.outbox.count_deliveries([request.id for request in fresh])
        return fresh, [request for _, request in redelivered]

    def _unpack(self, work: Work, requests: Sequence[Any]) -> list[Slot]:
        joined, slots = time.time(), []
        for request in requests:
            # Not a list (a hand-built message): treat as no arguments; tuple() of it could raise
            # and fail the whole buffer instead of this one request.
            args = tuple(request.args) if isinstance(request.args, list | tuple) else ()
            # A wrong argument count is dead-lettered with the arguments as they came.
            payload = args[0] if len(args) == 1 else list(args)
            packed = len(args) == 1 and isinstance(payload, list)
            work.packed[request.id] = packed
            work.digests[request.id] = payload_digest(args)
            raws = payload if packed else [payload]
            if packed and not raws:
                raws = [None]
            for index, raw in enumerate(raws):
                slot = Slot(request, index, joined, packed)
                try:
                    if len(args) != 1:
                        detail = f"expected one argument (ticket or list), got {len(args)}"
                        raise TicketRejected(Reason.BAD_PAYLOAD, detail)
                    slot.ticket = validate_ticket(raw, self.settings.max_ticket_bytes)
                    slot.schema = self._schema_of(slot.ticket)
                except TicketRejected as rejection:
                    slot.result = self._reject(slot, raw, rejection)
                work.add(slot)
                slots.append(slot)
        return slots

    def _schema_of(self, ticket: Ticket) -> str | None:
        """The schema `ticket` is answered with (None: the classifier's own field); `unknown_schema`
        for a name this worker does not serve."""
        if self.schemas is not None:
            name = ticket.schema or self.schemas.default
            if name in self.schemas:
                return name
        elif ticket.schema is None or ticket.schema == self.known_schemas[0]:
            return None
        served = ", ".join(self.known_schemas)
        raise TicketRejected(Reason.UNKNOWN_SCHEMA, f"no schema named {ticket.schema!r} here; this worker serves: "
                                                    f"{served} (TICKETQ_SCHEMAS)")  # fmt: skip

    def _items(self, slots: Sequence[Slot]) -> list:
        """What the classifier takes for `slots`: texts, or (schema, text) pairs for a schema set."""
        if self.schemas is None:
            return [slot.ticket.text for slot in slots]
        return [(slot.schema, slot.ticket.text) for slot in slots]

    def _expire(self, slots: Sequence[Slot]) -> None:
        """Tickets of a message past its Celery `expires` get an `expired` result and are not computed.

        Celery's own strategy revokes expired messages, but celery-batches buffers them without
        looking; the deadline travels in the message headers (`request_dict["expires"]`, ISO 8601).
        """
        deadlines: dict[str, float | None] = {}  # per message, not per ticket of a packed one
        for slot in slots:
            now, task_id = slot.joined, slot.request.id
            if task_id not in deadlines:
                deadlines[task_id] = message_deadline(slot.request)
            deadline = deadlines[task_id]
            if slot.result is None and deadline is not None and deadline <= now:
                when = datetime.fromtimestamp(deadline, timezone.utc).isoformat()
                late = f"deadline {when} passed {now - deadline:.3f}s before the batch started"
                raw = {**_raw(slot.ticket), "id": _result_id(slot, slot.ticket.id)}
                slot.result = self._failure(slot, raw, TicketRejected(Reason.EXPIRED, late))

    def _too_many_deliveries(self, request: Any, backend: Backend) -> bool:
        """A message redelivered past max_retries (its batch keeps killing workers) is dead-lettered."""
        attempts = self.outbox.count_deliveries([request.id])
        if attempts <= self.settings.max_retries + 1:
            return False
        rejection = TicketRejected(Reason.TOO_MANY_DELIVERIES, f"delivered {attempts} times; it may crash workers")
        self._dead_letter(request, None, request.args, rejection)
        self.outbox.mark_failed(backend, request, rejection)
        return True

    # ----- classification with retries, results as each forward batch finishes ------------

    def _classify(self, work: Work, slots: list[Slot], more: Callable[[], list[str]] | None = None) -> None:
        if not slots:
            return
        self._observe_wait(slots)
        self._classify_resilient(work, slots, attempt=1, more=more)

    def _observe_wait(self, slots: Sequence[Slot]) -> None:
        waits = [s.joined - s.ticket.submitted_at for s in slots if s.ticket.submitted_at]
        self.metrics.queue_wait.observe_many([max(0.0, wait) for wait in waits])

    def _classify_resilient(
        self, work: Work, slots: list[Slot], attempt: int, more: Callable[[], list[str]] | None = None
    ) -> None:
        """Classify, publishing each forward batch as it finishes (`more` may extend `slots` between
        forwards); on an engine error retry what is still open in halves, and single tickets up to
        max_retries."""

        def publish(indices: Sequence[int], predictions: list[Prediction]) -> None:
            try:
                self._on_predictions(work, [slots[i] for i in indices], predictions)
            except Exception as exc:  # surfaced as PublishFailed so it is never retried as an engine error
                raise PublishFailed(f"publishing {len(indices)} results failed: {exc!r}") from exc

        try:
            if self.schemas is None:
                predictions, _ = self.classifier.classify(
                    self._items(slots), on_batch=self._observe, on_predictions=publish, more=more
                )
            else:
                predictions, _ = self.schemas.classify(
                    self._items(slots), on_batch=self._observe, on_results=publish, more=more
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
            rejection = TicketRejected(Reason.ENGINE_ERROR, f"{type(exc).__name__}: {exc} (after {attempt} attempts)")
            slot.result = self._reject(slot, _raw(slot.ticket), rejection)
            self._publish(work, [slot])

    def _on_predictions(self, work: Work, slots: list[Slot], predictions: list[Prediction | TicketFields]) -> None:
        """One forward batch is computed: its results go out now."""
        now = time.time()
        for slot, prediction in zip(slots, predictions, strict=True):
            if isinstance(prediction, TicketFields):
                slot.result = self._triaged(slot, prediction, now)
                self._count_fields(prediction)
                if self.shadow:  # its schema's own reference, looked up here (the set is not thread-safe)
                    self.shadow.offer(slot.ticket.text, prediction, self.schemas.runner(slot.schema).reference)
                continue
            slot.result = self._success(slot, prediction, now)
            if self.shadow:
                self.shadow.offer(slot.ticket.text, prediction)
        self._publish(work, slots)

    def _count_fields(self, answer: TicketFields) -> None:
        for name, result in answer.fields.items():
            review = "true" if result.review else "false"
            for label in result.labels or ("none",):  # a multi-label field: each label chosen
                self.metrics.field_answers.labels(schema=answer.schema, field=name, label=label, review=review).inc()

    def _observe(self, report: BatchReport) -> None:
        CLASSIFYING.advanced()  # a forward computed: what follows (the live cost refit) starts the next wait
        self.metrics.observe_batch(report.rows, report.width, report.real_tokens, report.seconds)
        if self.on_forward is not None:
            self.on_forward(report)

    # ----- results -------------------------------------------------------------------------

    def _success(self, slot: Slot, prediction: Prediction, now: float) -> dict:
        """A ticket answered with the classifier's own field (`contract.Classified`)."""
        return self._answered(slot, now, {
            "label": prediction.label,
            "probs": prediction.probs,
            "margin": prediction.margin,
            "truncated": prediction.truncated,
            "truncation": self.settings.truncation if prediction.truncated else None,
        })  # fmt: skip

    def _triaged(self, slot: Slot, answer: TicketFields, now: float) -> dict:
        """A ticket answered with a schema: every field's answer (`contract.Triaged`)."""
        return self._answered(slot, now, answer.to_json())

    def _answered(self, slot: Slot, now: float, answer: dict) -> dict:
        """An `ok` result: who and when around `answer`, in the contract's key order."""
        ticket, started = slot.ticket, slot.joined
        return {
            "id": _result_id(slot, ticket.id),
            "task_id": slot.request.id,
            "status": "ok",
            **answer,
            **self.model_fields,
            "worker": self.worker_name,
            "queue_wait_s": round(started - ticket.submitted_at, 6) if ticket.submitted_at else None,
            "processing_s": round(now - started, 6),
        }

    def _reject(self, slot: Slot, raw: Any, rejection: TicketRejected) -> dict:
        """A failed result whose raw payload also goes to the dead-letter stream."""
        self._dead_letter(slot.request, slot.index, raw, rejection)
        return self._failure(slot, raw, rejection)

    def _failure(self, slot: Slot, raw: Any, rejection: TicketRejected) -> dict:
        return {
            "id": _result_id(slot, raw.get("id") if isinstance(raw, dict) else None),
            "task_id": slot.request.id,
            "status": "failed",
            "reason": rejection.reason,
            "error": str(rejection),
            "worker": self.worker_name,
        }

    def _publish(self, work: Work, slots: list[Slot]) -> None:
        """Publish the final results of `slots` now: one pipelined round trip for their stream
        entries (and the attempts keys of the messages they complete), one for the backend."""
        if not slots:
            return
        begun = time.perf_counter()
        for slot in slots:
            slot.encoded = codec.dumps(slot.result)
        complete = work.completed_by(slots)
        repeated, reused = self._publish_stream(work, slots, complete)
        failures = self._publish_backend(work, [task_id for task_id in complete if task_id not in reused])
        work.published.update(complete)
        if work.feed is not None and complete:
            work.feed.done(complete, failures, {task_id: _answer_text(work.by_task[task_id]) for task_id in complete})
        self.metrics.publish.observe(time.perf_counter() - begun)
        CLASSIFYING.advanced()
        self._count_outcomes([slot for slot in slots if (slot.request.id, slot.index) not in repeated])
        if not work.first_out:
            work.first_out = True
            self.metrics.first_result.observe(max(0.0, time.time() - work.started))

    def _publish_stream(self, work: Work, slots: list[Slot], complete: list[str]) -> tuple[set, set[str]]:
        """Stream the slots' results once each, closing the attempts of the messages they complete.

        Returns the (task id, slot) already published by the same message (re-executions: counted
        apart, not as tickets done), and the task ids of messages that reused another message's
        task id, whose tickets are answered `duplicate_task_id` instead.
        """
        digests = work.digests
        entries = [(slot.request.id, slot.index, slot.encoded, digests.get(slot.request.id, "")) for slot in slots]
        review = {(slot.request.id, slot.index) for slot in slots if slot.result.get("review") is True}
        repeated, conflicts = self.outbox.publish(entries, complete, review)
        if repeated:
            self.metrics.duplicates.inc(len(repeated))
            tasks = sorted({task_id for task_id, _ in repeated})
            log.info("re-executed: %d result(s) of %s already published, not repeated", len(repeated), tasks[:5])
        if conflicts:
            self._answer_reused_ids(slots, set(conflicts))
        return set(repeated), {task_id for task_id, _ in conflicts}

    def _answer_reused_ids(self, slots: list[Slot], conflicts: set[tuple[str, int]]) -> None:
        """Tickets of a message whose task id already answered another payload: failed
        `duplicate_task_id`, dead-lettered, and streamed without publish-once marks (the id's marks
        and its backend result belong to the message answered first)."""
        reused = [slot for slot in slots if (slot.request.id, slot.index) in conflicts]
        for slot in reused:
            detail = f"task id {slot.request.id} already answered another message; send this one under a new id"
            raw = _payload(slot)
            slot.result = self._reject(slot, raw, TicketRejected(Reason.DUPLICATE_TASK_ID, detail))
            slot.encoded = codec.dumps(slot.result)
        self.outbox.stream_results([slot.encoded for slot in reused])

    def _publish_backend(self, work: Work, complete: list[str]) -> dict[str, str]:
        """The backend state producers wait on: successes pipelined, failures one by one (rare).
        Returns the error of each message that ended FAILURE."""
        successes, failures = [], {}
        for task_id in complete:
            slots = work.by_task[task_id]
            request, results = slots[0].request, [slot.result for slot in slots]
            if getattr(request, "ignore_result", False):
                continue
            if work.packed[task_id]:
                successes.append((request, b"[" + b",".join(slot.encoded for slot in slots) + b"]"))
            elif results[0]["status"] == "ok":
                successes.append((request, slots[0].encoded))
            else:
                error = TicketRejected(results[0]["reason"], results[0]["error"].split(": ", 1)[-1])
                self.outbox.mark_failed(work.backend, request, error)
                failures[task_id] = str(error)
        if successes:
            self.outbox.store_successes(work.backend, successes)
        return failures

    def _count_outcomes(self, slots: list[Slot]) -> None:
        now, counts, latencies = time.time(), Counter(), []
        for slot in slots:
            result = slot.result
            outcome = _outcome(result)
            counts[result.get("label", "none"), outcome] += 1
            if slot.ticket and slot.ticket.submitted_at and outcome == "ok":
                latencies.append(max(0.0, now - slot.ticket.submitted_at))
        self.metrics.latency.observe_many(latencies)
        for (label, outcome), count in counts.items():
            self.metrics.tickets.labels(label=label, outcome=outcome).inc(count)

    def _dead_letter(self, request: Any, index: int | None, raw: Any, rejection: TicketRejected) -> None:
        entry = ticket_entry(request.id, index, rejection.reason, str(rejection), raw, self.worker_name,
                             self.dead_letter_limit)  # fmt: skip
        self.outbox.dead_letter(entry)
        self.metrics.dead_letters.labels(reason=rejection.reason).inc()
        log.warning("dead-lettered task %s slot %s: %s", request.id, entry["slot"], rejection)

    def _fail_open(self, requests: Sequence[Any], backend: Backend, exc: Exception, feed: Feed | None = None) -> None:
        """FAILURE and a dead letter for each request without a final result, except where another
        worker has it. A worker cut off from Redis for longer than its lease meets requests that a
        live worker took over (recovered as a dead consumer's) and may have answered meanwhile:
        those are left to it, answered or not (a FAILURE would overwrite or pre-empt its answer, a
        requeue of the dead letter repeat it). One whose every ticket is in the results stream but
        whose backend result is not written yet is left alone too: a FAILURE would contradict the
        stream and block the SUCCESS that follows."""
        error = TicketRejected(Reason.WORKER_ERROR, f"{type(exc).__name__}: {exc}")
        try:
            answered = self.outbox.answered(backend, [(request.id, _ticket_count(request)) for request in requests])
        except Exception:  # Redis away past worst_batch_s: nothing to check against; each failure below logs its own
            answered = set()
        if answered:
            log.info("not failing %d message(s) answered meanwhile: %s", len(answered), sorted(answered)[:5])
        open_ids = [request.id for request in requests if request.id not in answered]
        taken = self._taken_over(feed, open_ids)
        if taken:
            log.warning("not failing %d message(s) another worker took over while this worker's lease had "
                        "lapsed (theirs to answer): %s", len(taken), sorted(taken)[:5])  # fmt: skip
        for request in (request for request in requests if request.id not in answered and request.id not in taken):
            try:
                self.outbox.mark_failed(backend, request, error)
                self._dead_letter(request, None, request.args, error)
            except Exception:  # Redis gone too: the message is acked; log loudly so it is visible
                log.exception("could not mark task %s failed", request.id)


    def _taken_over(self, feed: Feed | None, task_ids: list[str]) -> set[str]:
        """`feed.taken_over`, with Redis given worst_batch_s to answer; an empty set when it cannot."""
        if feed is None or not task_ids:
            return set()
        try:
            return self.outbox.retrying(lambda: feed.taken_over(task_ids), write=False)
        except Exception as exc:  # Redis still away: nothing to check against; the failures below log their own
            log.warning("could not check whether another worker took over %d message(s) (%s)", len(task_ids), exc)
            return set()


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


def _model_fields(classifier: Classifier, settings: Settings) -> dict:
    info = getattr(classifier, "info", None)
    return {
        "model": info.name if info else "null-classifier",
        "standin": bool(info and info.standin),
    }


def _schema_set(classifier: Classifier, settings: Settings) -> Any:
    """The `SchemaSet` of TICKETQ_SCHEMAS on the classifier's model, or None (no schemas, or a
    classifier without a model to compile them on, e.g. the null classifier)."""
    schemas = settings.load_schemas()
    if not schemas:
        return None
    if not callable(getattr(classifier, "fields", None)):
        log.warning("TICKETQ_SCHEMAS ignored: %s answers its own labels only", type(classifier).__name__)
        return None
    from worker.engine.schemas import SchemaSet

    schema_set = SchemaSet(classifier, schemas, settings.schema_cache)
    log.info("schemas served: %s (tickets naming none: %s)", ", ".join(schema_set.names), schema_set.default)
    return schema_set


def _outcome(result: dict) -> str:
    if result["status"] == "ok":
        return "ok"
    if result["reason"] == "expired":
        return "expired"
    return "failed" if result["reason"] in ("engine_error", "worker_error") else "rejected"


def _result_id(slot: Slot, given: object) -> str:
    return result_id(given, slot.request.id, slot.index, slot.packed)


def _answer_text(slots: Sequence[Slot]) -> str:
    """A message's answer in a few words: its label (or each field's), a list for a packed message."""
    answers = []
    for slot in slots:
        result = slot.result or {}
        if "fields" in result:
            answers.append({name: field.get("labels", field.get("label")) for name, field in result["fields"].items()})
        else:
            answers.append(result.get("label") or result.get("reason") or result.get("status"))
    return repr(answers if slots and slots[0].packed else answers[0] if answers else None)


def _ticket_count(request: Any) -> int:
    """How many tickets a message carries (a packed list's length; else one)."""
    args = request.args if isinstance(request.args, list | tuple) else ()
    return len(args[0]) if len(args) == 1 and isinstance(args[0], list) else 1


def _payload(slot: Slot) -> Any:
    """The ticket of `slot` exactly as its message carried it."""
    args = tuple(slot.request.args) if isinstance(slot.request.args, list | tuple) else ()
    payload = args[0] if len(args) == 1 else list(args)
    return payload[slot.index] if slot.packed and isinstance(payload, list) and slot.index < len(payload) else payload


def _raw(ticket: Ticket) -> dict:
    return {"id": ticket.id, "text": ticket.text, "submitted_at": ticket.submitted_at}
