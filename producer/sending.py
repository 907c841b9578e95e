"""Publishing messages: one at a time, or in Redis pipelines of PUBLISH_BATCH that ride out an
outage and say exactly what Redis took when a bulk send stops part way.

Cost of an outage: each pipeline that failed on a lost connection is sent again whole once Redis
answers (`producer.outage`), under the same task ids; worst case, a message of it reaches Redis
twice, and the worker publishes its answer once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

from tqdm import tqdm

from producer.backend import BulkRedisBackend, finished
from producer.broker import Broker
from producer.errors import BATCH_ERRORS, CONNECTION_ERRORS, SendInterrupted, SendStopped
from producer.messages import Checked, TicketResult, argsrepr, idempotent_task_id, payload
from producer.outage import Outage
from producer.resends import next_send
from ticketq.names import TASK_CLASSIFY
from ticketq.process import bar_disabled

log = logging.getLogger(__name__)

PUBLISH_BATCH = 500  # messages per Redis pipeline in submit_many (kombu >= 5.7's Producer.batch)


class Sender:
    """Sends messages to the classify task on `settings.queue` through `broker`."""

    def __init__(self, broker: Broker, retry_for_s: float) -> None:
        self.broker, self.retry_for_s = broker, retry_for_s
        self.result_cls = broker.app.subclass_with_self(TicketResult)

    def send_chunks(self, chunks: list, task_ids: list, packed: bool, progress: bool) -> list[TicketResult]:
        """Publish `chunks` one message each, PUBLISH_BATCH per Redis pipeline.

        A pipeline per block of PUBLISH_BATCH, each flushed before the next starts, so what Redis
        took is known exactly when the run stops part way: Ctrl-C (`SendInterrupted`), or Redis
        lost for longer than `retry_for_s` or refusing the writes (`SendStopped`). A block whose
        pipeline failed on a lost connection is sent again whole once Redis answers, under the
        same task ids (fixed here, before the first try): at worst a duplicate, published once.
        """
        sent: list[TicketResult] = []
        try:
            task_ids = [task_id or str(uuid.uuid4()) for task_id in task_ids]
            bar = tqdm(total=sum(map(len, chunks)), unit="ticket", desc="enqueue", disable=bar_disabled(progress))
            with bar:
                for first in range(0, len(chunks), PUBLISH_BATCH):
                    block = range(first, min(first + PUBLISH_BATCH, len(chunks)))
                    self._send_block([chunks[i] for i in block], [task_ids[i] for i in block], packed, sent)
                    bar.update(sum(len(chunks[index]) for index in block))
        except SendInterrupted:
            raise
        except KeyboardInterrupt:  # between two pipelines: Redis took `sent`, and nothing else
            raise SendInterrupted(sent, []) from None
        return sent

    def _send_block(self, chunks: list, task_ids: list[str], packed: bool, sent: list[TicketResult]) -> None:
        """One pipeline of messages, tried again through an outage (`Outage`, up to `retry_for_s`),
        added to `sent` (what the run sent so far, which the exceptions that stop it carry) once
        Redis took it: here, so that no Ctrl-C falls between the flush and the count."""
        outage = Outage("sending", None, self.retry_for_s, refusals=False)
        maybe: list[TicketResult] = []  # the most of the block any try handed to Redis
        try:
            while True:
                attempted: list[TicketResult] = []
                try:
                    with self.broker.acquire_producer() as kombu_producer, publish_batch(kombu_producer):
                        # The queue declared once a block (kombu remembers it per connection), not per message.
                        kombu_producer.maybe_declare(self.broker.app.amqp.queues[self.broker.settings.queue])
                        for chunk, task_id in zip(chunks, task_ids, strict=True):
                            attempted.append(self.send(chunk, packed, kombu_producer, task_id))
                            maybe = max(maybe, attempted, key=len)
                    outage.over()
                    sent.extend(attempted)
                    return
                except (*CONNECTION_ERRORS, *BATCH_ERRORS) as exc:  # a pipeline flushed at the end of the block
                    self.broker.checked = False
                    if len(attempted) < len(chunks):  # the message whose publish met the error flushed the pipeline
                        at = len(attempted)
                        maybe = max(maybe, [*attempted, self.result_of(task_ids[at], chunks[at], packed)], key=len)
                    error = self.broker.unreachable(exc, sent=len(sent))
                    if not outage.ride_out(error, raises=False):
                        raise SendStopped(error, sent, maybe) from None
        except KeyboardInterrupt:
            taken = {result.id for result in sent}  # a Ctrl-C just after the block was counted: it is not a maybe
            raise SendInterrupted(sent, [result for result in maybe if result.id not in taken]) from None

    def send(self, tickets: Sequence[Checked], packed: bool, producer: object = None,
             task_id: str | None = None) -> TicketResult:  # fmt: skip
        """Publish one message. `submitted_at` (the send time, for the queue-wait figures) is left
        out of the worker's comparison of an idempotent message (`task_id` given) sent again: the
        same tickets under the same id are one message, other tickets under it another message
        reusing the id (answered `duplicate_task_id`)."""
        self.broker.ensure_checked()
        now = time.time()
        rows = [{**payload(ticket), "submitted_at": now} for ticket in tickets]
        ticket_ids = tuple(ticket_id for ticket_id, *_ in tickets)
        args = (rows if packed else rows[0],)
        return self.publish(task_id or str(uuid.uuid4()), args, ticket_ids, packed, producer)

    def publish(self, task_id: str, args: tuple, ticket_ids: tuple[str, ...], packed: bool,
                producer: object = None) -> TicketResult:  # fmt: skip
        try:
            result = self.broker.app.send_task(
                TASK_CLASSIFY,
                args=list(args),
                queue=self.broker.settings.queue,
                task_id=task_id,
                result_cls=self.result_cls,
                # Celery copies repr(args) into the message headers, where logs and Flower show it;
                # tickets carry customer text, so the headers name the ticket ids only.
                argsrepr=argsrepr(list(ticket_ids), packed),
                producer=producer,  # None: Celery acquires one from its pool for this message
                # A block's producer declared the queue before its first message (`_send_block`);
                # kombu's per-message check costs a tenth of a bulk send's CPU. Alone, Celery declares.
                **({"declare": []} if producer is not None else {}),
            )
        except (*CONNECTION_ERRORS, RuntimeError) as exc:
            self.broker.checked = False
            raise self.broker.unreachable(exc) from None
        result.ticket_ids, result.packed, result.message_args = ticket_ids, packed, args
        result.sent_seq = next_send()
        return result

    def result_of(self, task_id: str, chunk: Sequence[Checked], packed: bool) -> TicketResult:
        """The result of a message sent before (under `task_id`), as if this producer had just sent it."""
        result = self.result_cls(task_id)
        rows = [payload(ticket) for ticket in chunk]
        result.ticket_ids, result.packed = tuple(ticket_id for ticket_id, *_ in chunk), packed
        result.message_args = (rows if packed else rows[0],)
        result.sent_before = True
        return result

    def send_once(self, chunks: list, packed: bool, progress: bool, already_sent: Iterable[str]) -> list[TicketResult]:
        """`Producer.submit_many(idempotent=True)`'s send: each message's task id from (queue, its
        ticket ids); one already answered in the backend, or among `already_sent`, is not sent again
        (its result comes back as if just sent). Results in the order of `chunks`."""
        queue = self.broker.settings.queue
        task_ids = [idempotent_task_id(queue, [i for i, *_ in chunk], packed) for chunk in chunks]
        skipped = self.answered(task_ids) | (set(already_sent) & set(task_ids))
        if skipped:
            log.info("%d message(s) were sent before: not sent again", len(skipped))
        todo = [index for index, task_id in enumerate(task_ids) if task_id not in skipped]
        before = [self.result_of(task_ids[i], chunks[i], packed) for i in range(len(chunks)) if task_ids[i] in skipped]
        try:
            sent = self.send_chunks([chunks[i] for i in todo], [task_ids[i] for i in todo], packed, progress)
        except (SendInterrupted, SendStopped) as stop:
            stop.results[:0] = before  # what an earlier run sent is sent too
            raise
        self.confirm(sent, before)
        by_id = {result.id: result for result in (*before, *sent)}
        return [by_id[task_id] for task_id in task_ids]

    def confirm(self, sent: list[TicketResult], before: Sequence[TicketResult] = ()) -> None:
        """TICKETQ_REPLICA_ACKS' wait for `sent`; Ctrl-C during it is a `SendInterrupted` holding
        every message (Redis took them all: only their replication was not confirmed)."""
        try:
            self.broker.confirm_replicas(sent)
        except KeyboardInterrupt:
            raise SendInterrupted([*before, *sent], []) from None

    def answered(self, task_ids: Sequence[str]) -> set[str]:
        """The task ids among `task_ids` that have a finished result in the Redis result backend."""
        backend = self.broker.app.backend
        if not isinstance(backend, BulkRedisBackend) or not task_ids:
            return set()
        try:
            return {task_id for task_id, _, _ in finished(backend, task_ids)}
        except CONNECTION_ERRORS as exc:
            raise self.broker.unreachable(exc) from None


def publish_batch(producer: object) -> AbstractContextManager:
    """kombu >= 5.7 buffers a `batch()` block's publishes in Redis pipelines, flushed every
    `max_size` messages and at the block's end (a block that raises discards what is not flushed
    yet). Older kombu, or a transport that cannot batch, publishes each message at once."""
    batch = getattr(producer, "batch", None)
    return batch(max_size=PUBLISH_BATCH) if batch is not None else nullcontext()
