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

import asyncio
import enum
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio
from redis.commands.core import AsyncScript

from gateway.keys import QUEUED_KEY
from gateway.settings import GatewaySettings
from producer.api import QueuedMessages, idempotent_task_id
from ticketq import codec, connections
from ticketq.aioredis import async_redis_client
from ticketq.lua import script
from ticketq.names import queue_lists

ENQUEUE = script(__package__, "enqueue")
LOST = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)  # worth asking again
RETRY_PAUSE_S = (0.05, 0.5)  # while Redis is away, a POST's pause before asking again: the first, the longest


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
    records: list[bytes]


def outgoing(messages: QueuedMessages, sent: Sequence[tuple[str, str, str | None, dict]]) -> Outgoing:
    """The packed message of `sent` (each: its id as sent, text, schema, and what its marker keeps besides
    the task id), under `idempotent_task_id(queue, ids, packed=True)`; nothing when `sent` is empty."""
    if not sent:
        return Outgoing("", b"", [])
    task_id = idempotent_task_id(messages.queue, [wire for wire, *_ in sent], True)
    message = messages.encode(task_id, [(wire, text, schema) for wire, text, schema, _ in sent])
    return Outgoing(task_id, message, [codec.dumps({"task_id": task_id, "packed": True, **kept}) for *_, kept in sent])


async def asked_again(call: Callable[[], Awaitable[Any]], limit_s: float) -> Any:
    """`await call()`, asked again through a Redis that went away for up to `limit_s`
    (TICKETQ_GATEWAY_SEND_RETRY_S), then its error; a refusal (ResponseError) at once. A push whose
    reply was lost, asked again, finds its tickets `duplicate`."""
    deadline, pause = time.monotonic() + limit_s, RETRY_PAUSE_S[0]
    while True:
        try:
            return await call()
        except LOST:
            if time.monotonic() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(2 * pause, RETRY_PAUSE_S[1])


class Enqueue:
    """The accept step for one queue, on the event loop's own Redis client (no thread hop); the
    message and markers come from `gateway.intake.Intake`. Redis errors propagate."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.bound = settings.gateway_max_queue_depth
        self.lists = queue_lists(settings.queue)
        self.ledger = QUEUED_KEY.format(queue=settings.queue)
        self.marker_ttl_s = settings.result_expires_s
        self._script: AsyncScript | None = None  # EVALSHA, loaded on first use
        self._client: tuple[asyncio.AbstractEventLoop, redis.asyncio.Redis] | None = None

    @property
    def client(self) -> redis.asyncio.Redis:
        """The running event loop's own client on the broker (one per loop: a test client runs several)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            self._client = (loop, async_redis_client(self.settings.broker_url, **self.settings.sentinel))
        return self._client[1]

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client[1].aclose()

    async def push(self, marker_keys: Sequence[str], carried: Sequence[bool], message: bytes,
                   records: Sequence[bytes]) -> Step:  # fmt: skip
        """Push `message` (carrying the tickets whose `carried` is set) with `records` as their markers,
        if exactly those tickets have no marker and the bound has room for them; asked again through a
        Redis that went away for TICKETQ_GATEWAY_SEND_RETRY_S."""
        if self._script is None:
            self._script = self.client.register_script(ENQUEUE)
        mask = "".join("1" if carries else "0" for carries in carried)
        args = [len(self.lists), self.bound, self.marker_ttl_s, message, mask, *records]
        call = functools.partial(self._script, keys=[*self.lists, self.ledger, *marker_keys], args=args,
                                 client=self.client)  # fmt: skip
        outcome, depth, *markers = await asked_again(call, self.settings.gateway_send_retry_s)
        return Step(Outcome(int(outcome)), int(depth), markers)

    async def replicated(self, wanted: int, timeout_s: float) -> int:
        """How many replicas hold every write the master took so far (WAIT, on one connection)."""
        pipe = self.client.pipeline(transaction=False)
        connections.confirm_replicas(pipe, wanted, timeout_s)
        return int((await pipe.execute())[-1])
