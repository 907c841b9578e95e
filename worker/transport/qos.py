"""kombu's unacked record for the atomic fetch (`worker.transport.fetch`): recorded per fetched batch,
acked per event-loop turn, swept by Redis's clock.

Every change goes through the worker-state script (`worker.transport.state`). Times in the record
are Redis's (`TIME`, read inside the script and by the sweep), so a worker whose clock runs ahead
never restores another worker's messages in flight as if their visibility timeout had passed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from worker.transport.state import WorkerState

log = logging.getLogger(__name__)


class QoS(kombu_redis.QoS):
    """kombu's unacked record, written in the same script call that empties the fetching list.

    Per fetched batch, not per message: the channel records every message of a fetch as unacked
    in one call (`record`: the worker-state script's `claim`) before it hands any of them to
    kombu. An ack updates kombu's in-memory state at once; its Redis removal waits for the end of
    the event loop's turn (`flush_acks`, on every tick), where every ack of that turn goes in one
    call (without an event loop, as in a plain kombu consumer, an ack is written at once). A
    worker killed before a tick's flush has those messages redelivered; their results are
    published once (worker.redis.outbox).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._acked: list[str] = []  # acked in memory; removed from Redis at the next tick
        self.last_appended: str | None = None
        self._sweeps = 0  # calls of restore_visible: every `interval`-th one sweeps

    def append(self, message: Any, delivery_tag: str) -> None:
        if not self.channel.recorded:  # not fetched by Channel's fetch (basic_get): record it now, as kombu does
            delivery = message.delivery_info
            self.record([(delivery_tag, dumps([message._raw, delivery["exchange"], delivery["routing_key"]]), None)])
        virtual.QoS.append(self, message, delivery_tag)  # the in-memory bookkeeping of kombu's QoS
        self.last_appended = delivery_tag

    @property
    def state(self) -> WorkerState:
        return WorkerState(self.unacked_index_key, self.unacked_key)

    def record(self, records: Sequence[tuple[str, str, bytes | None]], queue: str = "") -> list[bool]:
        """(delivery tag, kombu's record, fetched item) as unacked, owned by this consumer, and gone
        from its fetching list for `queue`: one script call. Returns, per record, whether it was
        claimed: a fetched item no longer in the fetching list was recovered by another worker."""
        if not records:
            return []
        with self.channel.conn_or_acquire() as client:
            return self.state.claim(client, self.channel.consumer, queue, records)

    def can_consume(self) -> bool:
        """kombu's prefetch check, and no fetch while Redis refuses writes or before the lease is held."""
        return self.channel.may_fetch() and super().can_consume()

    def ack(self, delivery_tag: str) -> None:
        if self.channel.closed:
            # A reconnect closed the channel under the running job: kombu put its unacked messages
            # back at close, and their redelivery is answered from the results already published.
            log.debug("ack of %s after its channel closed: left to its redelivery", delivery_tag)
            return
        self._acked.append(delivery_tag)
        virtual.QoS.ack(self, delivery_tag)
        if not self.channel.connection.acks_per_tick:
            self.flush_acks()

    def flush_acks(self) -> None:
        """Remove the records of every message acked since the last flush, in one script call."""
        tags, self._acked = self._acked, []
        if not tags:
            return
        try:
            with self.channel.conn_or_acquire() as client:
                acked = self.state.ack(client, self.channel.consumer, tags)
        except redis.ResponseError as exc:
            self._acked[:0] = tags  # tried again at the next tick, and at close
            if not self.channel.refused(exc, "acks"):
                raise
            return
        except Exception:
            self._acked[:0] = tags
            raise
        if acked < len(tags):
            log.warning(
                "%d of %d acked message(s) were no longer this consumer's (%s): its lease lapsed and "
                "another worker took them over; theirs to answer and ack", len(tags) - acked, len(tags),
                self.channel.consumer,
            )  # fmt: skip

    def restore_visible(self, start: int = 0, num: int = 10, interval: int = 10) -> None:
        """kombu's sweep of messages past the visibility timeout (every `interval`-th call), judged by
        Redis's clock; skipped while Redis refuses writes (its mutex is a write)."""
        self._sweeps += 1
        if (self._sweeps - 1) % (interval or 1):
            return
        try:
            with self.channel.conn_or_acquire() as client:
                seconds, micros = client.time()
                ceiling = seconds + micros / 1e6 - self.visibility_timeout
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    visible = client.zrange(self.unacked_index_key, ceiling, 0, desc=True, byscore=True,
                                            offset=num and start, num=num)  # fmt: skip
                    for tag in visible or []:
                        self.restore_by_tag(tag, client)
        except kombu_redis.MutexHeld:
            pass
        except redis.ResponseError as exc:
            if not self.channel.refused(exc, "the visibility-timeout sweep"):
                raise

    def restore_unacked(self, client: Any = None) -> Any:
        try:  # acked messages must not be restored from records their flush has not removed yet
            self.flush_acks()
        except redis.RedisError as exc:
            log.warning("could not remove the records of %d acked messages (%s); they may be redelivered",
                        len(self._acked), exc)  # fmt: skip
        return super().restore_unacked(client)

    def _remove_from_indices(self, delivery_tag: str, pipe: Any = None) -> Any:
        return super()._remove_from_indices(delivery_tag, pipe).srem(self.channel.owned_key, delivery_tag)
