"""The hard queue-depth bound (TICKETQ_GATEWAY_MAX_QUEUE_DEPTH): a POST reserves room for the
tickets it will send before it sends them, atomically (`reserve.lua`), and gives the room back once
they are in the queue. The depth a POST is checked against is the waiting messages plus every live
reservation, so concurrent POSTs (from any gateway process) never overshoot the bound together, and
a POST is refused when its own new tickets would take the queue past it. The same step reads the
tickets' markers (which were accepted before): the check costs no round trip of its own.

A reservation held by a gateway that died before it gave it back lapses after RESERVE_TTL_S; until
then it counts against the bound (refusing early, never overshooting).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from redis.commands.core import Script

from gateway.keys import RESERVED_KEY
from gateway.settings import GatewaySettings
from ticketq.lua import script
from ticketq.names import queue_lists

RESERVE = script(__package__, "reserve")
RESERVE_TTL_S = 60.0  # more than one POST's send (TICKETQ_GATEWAY_SEND_RETRY_S) ever takes


@dataclass(frozen=True)
class Room:
    """What `Capacity.reserve` found: the depth before this POST, its tickets' markers (None: new),
    and the reservation to give back (None when nothing was reserved)."""

    depth: int
    new: int
    granted: bool
    markers: list[bytes | None]
    member: str | None


class Capacity:
    """Reservations against TICKETQ_GATEWAY_MAX_QUEUE_DEPTH for one queue."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.bound = settings.gateway_max_queue_depth
        self.key = RESERVED_KEY.format(queue=settings.queue)
        self.lists = queue_lists(settings.queue)
        self._script: Script | None = None  # EVALSHA, loaded on first use

    def reserve(self, client: redis.Redis, marker_keys: Sequence[str]) -> Room:
        """Read the markers and reserve room for the tickets that have none, in one step."""
        tag = uuid.uuid4().hex
        if self._script is None:
            self._script = client.register_script(RESERVE)
        depth, new, granted, *markers = self._script(keys=[self.key, *self.lists, *marker_keys], client=client,
                                                     args=[len(self.lists), self.bound, int(RESERVE_TTL_S * 1000), tag])
        return Room(int(depth), int(new), bool(granted), markers, f"{tag}:{new}" if granted else None)

    def release(self, client: redis.Redis | redis.client.Pipeline, room: Room) -> None:
        """Give `room`'s reservation back (queued on a pipeline, or at once on a client)."""
        if room.member is not None:
            client.zrem(self.key, room.member)
