"""A POST's tickets into the queue in one atomic step and one round trip (`enqueue.lua`): the
markers of its tickets read (which were accepted before), the hard queue-depth bound checked
(TICKETQ_GATEWAY_MAX_QUEUE_DEPTH, counting the POST's own new tickets), its new tickets pushed as
one packed message, and a marker written for each. A marker therefore never stands for a ticket
Redis lacks, and two POSTs racing with the same ticket cannot both send it: the second finds the
first's marker.

The depth is counted in tickets, though a message carries several: the gateway keeps a ledger of
the messages it queued (`gateway.keys.QUEUED_KEY`), and the script sums its entries still waiting
(the script's header says how). The message is `producer.api.QueuedMessages`' encoding of a Celery
task message, pushed to the queue's own list as kombu's Redis transport would.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.commands.core import Script

from gateway.keys import QUEUED_KEY
from gateway.settings import GatewaySettings
from producer.api import QueuedMessages, idempotent_task_id
from ticketq.lua import script
from ticketq.names import queue_lists

ENQUEUE = script(__package__, "enqueue")


class Outcome(enum.IntEnum):
    """What `enqueue.lua` did (its first reply)."""

    PUSHED = 1  # the message and its markers are in
    NOTHING_NEW = 0  # every ticket had a marker: nothing sent
    CHANGED = -1  # the tickets without a marker are not those the message carries: build it again
    FULL = -2  # the depth plus the new tickets would pass the bound: nothing sent


@dataclass(frozen=True)
class Step:
    """What one `Enqueue.push` found: the outcome, the depth before it (tickets), each ticket's marker before it."""

    outcome: Outcome
    depth: int
    markers: list[bytes | None]


@dataclass(frozen=True)
class Outgoing:
    """What one try of a POST sends: the message's task id, the message, each carried ticket's marker."""

    task_id: str
    message: bytes
    records: list[str]


def outgoing(messages: QueuedMessages, sent: Sequence[tuple[str, str, str | None, dict]]) -> Outgoing:
    """The packed message of `sent` (each: its id as sent, text, schema, and what its marker keeps besides
    the task id), under `idempotent_task_id(queue, ids, packed=True)`; nothing when `sent` is empty."""
    if not sent:
        return Outgoing("", b"", [])
    task_id = idempotent_task_id(messages.queue, [wire for wire, *_ in sent], True)
    message = messages.encode(task_id, [(wire, text, schema) for wire, text, schema, _ in sent])
    return Outgoing(task_id, message, [json.dumps({"task_id": task_id, "packed": True, **kept}) for *_, kept in sent])


class Enqueue:
    """The accept step for one queue; the message and markers come from `gateway.intake.Intake`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.bound = settings.gateway_max_queue_depth
        self.lists = queue_lists(settings.queue)
        self.ledger = QUEUED_KEY.format(queue=settings.queue)
        self.marker_ttl_s = settings.result_expires_s
        self._script: Script | None = None  # EVALSHA, loaded on first use

    def push(self, client: redis.Redis, marker_keys: Sequence[str], carried: Sequence[bool], message: bytes,
             records: Sequence[str]) -> Step:  # fmt: skip
        """Push `message` (carrying the tickets whose `carried` is set) with `records` as their markers,
        if exactly those tickets have no marker and the bound has room for them."""
        if self._script is None:
            self._script = client.register_script(ENQUEUE)
        mask = "".join("1" if carries else "0" for carries in carried)
        outcome, depth, *markers = self._script(
            keys=[*self.lists, self.ledger, *marker_keys], client=client,
            args=[len(self.lists), self.bound, self.marker_ttl_s, message, mask, *records],
        )  # fmt: skip
        return Step(Outcome(int(outcome)), int(depth), markers)
