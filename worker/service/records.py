"""The plain records the stages pass along: a message's arguments decoded once, one ticket's
place, one job's slots, and the split of a buffer into first and repeated deliveries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ticketq.contract import Ticket
from ticketq.publishing import payload_digest


@dataclass(frozen=True, slots=True)
class Message:
    """One Celery request's arguments, decoded once: one ticket, or a packed list of them."""

    request: Any
    args: tuple  # as they came; () for arguments that are not a list (a hand-built message)
    payload: Any  # the one argument, or the arguments as a list when there is not exactly one
    packed: bool  # the message carried a list of tickets

    @classmethod
    def of(cls, request: Any) -> Message:
        # Not a list: treat as no arguments; tuple() of it could raise and fail the whole buffer
        # instead of this one request.
        args = tuple(request.args) if isinstance(request.args, list | tuple) else ()
        payload = args[0] if len(args) == 1 else list(args)
        return cls(request, args, payload, len(args) == 1 and isinstance(payload, list))

    @property
    def tickets(self) -> list[Any]:
        """Each ticket as carried (an empty pack: one None, answered bad_payload)."""
        if not self.packed:
            return [self.payload]
        return list(self.payload) or [None]

    @property
    def ticket_count(self) -> int:
        """How many tickets the message carries (a packed list's length; else one)."""
        return len(self.payload) if self.packed else 1

    def carried(self, index: int) -> Any:
        """Ticket `index` exactly as the message carried it (the whole payload when not packed)."""
        if self.packed and index < len(self.payload):
            return self.payload[index]
        return self.payload

    def digest(self) -> str:
        return payload_digest(self.args)


@dataclass(slots=True, eq=False)
class Slot:
    """One ticket's place in the buffer: which message, which position in a packed one. Compared
    and hashed by identity: the scheduler hands each slot's answer back keyed by the slot."""

    message: Message
    index: int
    joined: float  # unix time the ticket joined the run: its queue wait ends and its processing starts
    ticket: Ticket | None = None
    schema: str | None = None  # the schema its answer comes from (None: the classifier's own field)
    result: dict | None = None  # final per-ticket result once known
    encoded: bytes = b""  # the result as JSON, serialised once for the stream and the backend

    @property
    def request(self) -> Any:
        return self.message.request

    @property
    def packed(self) -> bool:
        return self.message.packed


@dataclass
class Work:
    """The slots of one run, by message, and which messages are finished (backend result written)."""

    backend: Any
    started: float  # unix time the run began: time to first result counts from here
    feed: Any = None
    slots: list[Slot] = field(default_factory=list)
    by_task: dict[str, list[Slot]] = field(default_factory=dict)
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


class Deliveries(NamedTuple):
    """A buffer split by delivery: first deliveries (counted at once), and messages delivered
    again while unfinished (least-tried first; each counted when it runs, alone)."""

    fresh: list[Any]
    redelivered: list[Any]
