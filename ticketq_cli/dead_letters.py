"""Dead letters as the operator meets them: read from the stream, settled once their re-sent
ticket is answered, and requeued through Celery with the original task id (the writes a requeue
makes: `worker.redis.requeue`). `ticketq_cli.ops.Ops` gives them to the `ticketq dead` commands."""

from __future__ import annotations

import base64
import json
import sys
from dataclasses import dataclass

import redis
from celery import states

from producer.api import Producer
from ticketq import names
from ticketq.contract import Reason, TicketRejected, validate_ticket
from ticketq.errors import TicketqError
from worker.redis import requeue
from worker.settings import Settings


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead-letter stream (`ticket_entry` or `raw_entry` in ticketq/dead_letters.py)."""

    entry_id: str
    fields: dict[str, str]
    requeued_as: str = ""  # the task id it was re-sent as, while that task has no result

    @property
    def truncated(self) -> bool:
        """The payload was cut when dead-lettered. Entries that predate the flag cut the ticket's
        JSON at LEGACY_CUT characters."""
        if "truncated" in self.fields:
            return self.fields["truncated"] == "true"
        return len(self.fields.get("payload", "")) >= LEGACY_CUT and not isinstance(self.payload, list | dict)

    @property
    def reason(self) -> str:
        return self.fields.get("reason", "?")

    @property
    def task_id(self) -> str:
        return self.fields.get("task_id", "")

    @property
    def payload(self) -> object:
        """The refused payload: the ticket (one slot), the task's args (whole message), or raw bytes."""
        if "payload" in self.fields:
            try:
                return json.loads(self.fields["payload"])
            except ValueError:
                return self.fields["payload"]
        return base64.b64decode(self.fields.get("payload_b64", ""))


LEGACY_CUT = 65536  # where dead letters without a `truncated` field cut the payload's JSON

# Reasons whose failed result was streamed with the dead letter (bit <slot> of the done key set): a
# requeue keeps that failure (`requeue.keep_failure`), so the re-sent ticket streams its answer, or
# another failure, but not the same one again. The others never streamed: a mark means another
# delivery answered.
_STREAMED = frozenset({
    Reason.BAD_PAYLOAD, Reason.MISSING_FIELD, Reason.WRONG_TYPE, Reason.EMPTY_ID, Reason.INVALID_ID,
    Reason.INVALID_UTF8,
    Reason.OVERSIZE, Reason.EMPTY_TEXT, Reason.ENGINE_ERROR, Reason.EXPIRED, Reason.UNKNOWN_SCHEMA,
})  # fmt: skip
# Reasons the ticket itself carries: the contract refuses it again wherever it goes, so a requeue
# says so instead of re-sending it. (`oversize` depends on the worker's limit, which may be raised.)
_IN_THE_TICKET = frozenset({
    Reason.BAD_PAYLOAD, Reason.MISSING_FIELD, Reason.WRONG_TYPE, Reason.EMPTY_ID, Reason.INVALID_ID,
    Reason.INVALID_UTF8,
    Reason.EMPTY_TEXT,
})  # fmt: skip


class DeadLetters:
    """The dead-letter stream of one broker, through a `Producer` (its Celery app and Redis client)."""

    settings: Settings
    producer: Producer
    redis: redis.Redis

    def dead_letters(self, reason: str | None = None) -> list[DeadLetter]:
        """The dead letters (with `reason`), after dropping those whose re-sent message is answered."""
        pending = self.settle_requeued()
        entries = self.redis.xrange(names.DEAD_LETTER_STREAM)
        letters = [DeadLetter(raw_id.decode(), {k.decode(): v.decode() for k, v in fields.items()},
                              pending.get(raw_id.decode(), "")) for raw_id, fields in entries]  # fmt: skip
        return [letter for letter in letters if reason is None or letter.reason == reason]

    def settle_requeued(self) -> dict[str, str]:
        """Drop each requeued dead letter whose re-sent task has a result now (in the backend: a
        requeue removed the old FAILURE first). Returns the entries still waiting (entry -> task id).

        Every operator command that reads dead letters runs this, so a letter leaves the stream the
        first time one looks after its ticket was answered, and never before: a re-sent message that
        is lost leaves its letter to requeue again.
        """
        pending = requeue.requeued(self.redis)
        if not pending:
            return {}
        backend = self.producer.app.backend
        if isinstance(getattr(backend, "client", None), redis.Redis):  # the backend may be another Redis
            pipe = backend.client.pipeline(transaction=False)
            for task_id in pending.values():
                pipe.exists(backend.get_key_for_task(task_id))
            results = pipe.execute()
        else:
            results = [backend.get_task_meta(task).get("status") in states.READY_STATES for task in pending.values()]
        for (entry_id, _), answered in zip(list(pending.items()), results, strict=True):
            if answered:
                requeue.drop_dead_letter(self.redis, entry_id)
                del pending[entry_id]
        return pending

    def find_dead(self, key: str) -> list[DeadLetter]:
        """Dead letters by stream entry id or by task id."""
        return [letter for letter in self.dead_letters() if key in (letter.entry_id, letter.task_id)]

    def requeue(self, letter: DeadLetter) -> str:
        """Re-send a dead letter's payload exactly as it came; returns the task id used.

        A whole message (or a single-ticket one) goes back with its original task id, so waiting
        clients get the new result. A ticket of a packed message goes alone as `<task id>:<slot>`:
        the pack's other results stand. The entry stays until the re-sent task has a result
        (`settle_requeued`). Raises `NotRequeueable` for a payload that was cut or a ticket the
        contract refuses whatever the worker (empty text, a wrong type: it can never succeed), and
        `Answered` (sending nothing, clearing nothing) for a ticket that has a result already.

        Before sending: the attempts counter goes (or the retry would be refused), the old FAILURE
        goes (or the new result could not be stored, and waiters would keep the failure), and where
        this letter's own failure was streamed it is kept (`requeue.keep_failure`): the re-sent ticket
        streams its answer, or another failure, once, and never the same failure a second time.
        """
        if letter.truncated:
            kept = len(letter.fields.get("payload", letter.fields.get("payload_b64", "")))
            raise NotRequeueable(f"the payload was cut at {kept} bytes when dead-lettered; it cannot be re-sent "
                                 "whole: send the ticket again from its source")  # fmt: skip
        if letter.reason == Reason.DUPLICATE_TASK_ID:
            raise NotRequeueable(f"task id {letter.task_id} belongs to another message, answered; "
                                 "send this ticket again under a new id")  # fmt: skip
        _check_can_succeed(letter)
        args, task_id = self._resend_args(letter)
        own = self._check_unanswered(letter, task_id, args)
        requeue.forget_message(self.redis, task_id, digest=own)
        if own:  # the re-sent ticket is slot 0 of task_id: alone, or the first of its own message
            requeue.keep_failure(self.redis, task_id, 0, letter.reason, self.settings.result_expires_s)
        backend = self.producer.app.backend
        if backend.get_task_meta(task_id).get("status") == "FAILURE":
            backend.forget(task_id)
        self.producer.app.send_task(names.TASK_CLASSIFY, args=args, queue=self.settings.queue, task_id=task_id)
        requeue.mark_requeued(self.redis, letter.entry_id, task_id)
        return task_id

    def _check_unanswered(self, letter: DeadLetter, task_id: str, args: list) -> bool:
        """Raise `Answered` when `task_id` has a result a requeue would repeat; else whether its
        slot 0 streamed this letter's own failure (kept, so it is not streamed twice)."""
        meta = self.producer.app.backend.get_task_meta(task_id)
        if meta.get("status") == "SUCCESS":  # a ticket answered ok, or a pack finished (every slot answered)
            raise Answered(f"task {task_id} already has a result (ticketq result {task_id}); nothing re-sent")
        done = requeue.done_count(self.redis, task_id)
        if letter.reason in _STREAMED and (task_id != letter.task_id or letter.fields.get("slot") == "0"):
            return True
        tickets = len(args[0]) if isinstance(args[0], list) else 1
        if done >= tickets:  # every ticket streamed, by a delivery other than the one that failed
            raise Answered(f"every ticket of task {task_id} already has a result in the results stream "
                           f"(ticketq result {task_id}); nothing re-sent")  # fmt: skip
        return False  # some streamed: their marks stay, so the re-sent message publishes only the rest

    def _resend_args(self, letter: DeadLetter) -> tuple[list, str]:
        payload = letter.payload
        if isinstance(payload, str):
            raise NotRequeueable("the payload is not JSON (it was not a ticket's); nothing to re-send")
        if isinstance(payload, bytes):
            payload = _celery_args(payload, letter.fields.get("task", ""))
            return payload, letter.task_id
        slot = letter.fields.get("slot", "")
        if slot == "":  # the whole message: payload is its args
            return (payload if isinstance(payload, list) else [payload]), letter.task_id
        meta = self.producer.app.backend.get_task_meta(letter.task_id)
        # packs never end FAILURE, and end SUCCESS with a list; a single ticket's result is one dict
        single = meta.get("status") == "FAILURE" or isinstance(meta.get("result"), dict)
        return [payload], letter.task_id if single and slot == "0" else f"{letter.task_id}:{slot}"


class NotRequeueable(TicketqError, ValueError):
    """A dead letter that cannot be re-sent: its bytes are not a ticketq task's JSON arguments, or
    were cut, or its task id belongs to another message."""


class Answered(NotRequeueable):
    """A dead letter whose ticket has a result already: re-sending it would answer it twice."""


def _check_can_succeed(letter: DeadLetter) -> None:
    """`NotRequeueable` for a ticket the contract refuses for what it holds (empty text, a wrong
    type): re-sent as it is, it would fail again on every worker."""
    if letter.reason not in _IN_THE_TICKET or letter.fields.get("slot", "") == "" or "payload" not in letter.fields:
        return
    try:
        validate_ticket(letter.payload, max_bytes=sys.maxsize)  # the size limit is the worker's to judge
    except TicketRejected as rejection:
        raise NotRequeueable(f"it can never succeed as it is ({rejection}): correct the ticket at its source "
                             "and send it again") from None  # fmt: skip


def _celery_args(body: bytes, task: str) -> list:
    if task and task != names.TASK_CLASSIFY:
        raise NotRequeueable(f"task {task!r} is not {names.TASK_CLASSIFY}; nothing to re-send")
    try:
        args = json.loads(body)[0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise NotRequeueable("the payload is not a JSON Celery message; it cannot be re-sent") from None
    if not isinstance(args, list) or len(args) != 1:
        raise NotRequeueable("the payload's arguments are not one ticket or one list of tickets")
    return args
