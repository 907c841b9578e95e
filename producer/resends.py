"""Re-sends with a budget: which of a wait's messages are plausibly lost, and how many of them to
send again now (`Producer.wait(resend_after=S)`, `ticketq-produce --resend-after S`).

A message without a result is re-sent only when it is plausibly lost: not in the queue, not in a
worker's fetching list, not in kombu's unacked record (fetched by a worker: if that worker dies,
its lease's recovery puts the message back in the queue). `Whereabouts.read` takes those in one
MULTI, so a message moving along that path at that instant is seen in one place or the next, and
its result is read again after it (`producer.waiting`), so one answered meanwhile is not taken
for lost. An attempts key alone is not taken as a delivery: it outlives a message lost
with a failover's unreplicated writes.

"Not in the queue" without reading the whole queue: a Redis list is FIFO (producers LPUSH,
workers take from the right end, and a dead worker's messages go back at the right end). The
read takes the QUEUE_SCAN messages at the consuming end. A message of ours that is not among them
is out of the queue when one of ours sent after it is among them (it would be nearer the end), or
when the whole queue fits in the scan; otherwise it may be queued behind them, and waits.

Per message, exponential backoff: the first re-send `resend_after` after its send (at once for a
message an earlier run sent, `--resume`), the next ones 2, 4, 8, ... times that apart (±20%
jitter), at most BACKOFF_CAP_S. For the whole wait, a budget tied to the measured answer rate, as
gRPC retry throttling ties retries to successes: at most max(RESEND_FLOOR, RESEND_GROWTH × the
messages answered in the last period) re-sends per period, oldest send first; more than the
workers answer would only wait in the queue. A period is `resend_after`, at most PERIOD_MAX_S.

Cost per period with a message due: one HKEYS of the consumers and one MULTI (LLEN, an LRANGE
of QUEUE_SCAN messages, each live consumer's fetching list, HVALS of the unacked record: at
most QUEUE_SCAN + the workers' prefetch windows messages read, each decoded once), set look-ups
over the pending messages, and one MGET per 2,000 of those found lost. Nothing when none is due.

Bound: a lost message is re-sent at most `resend_after` + one period after it is out of the
queue by the rule above (at once when the queue is shorter than QUEUE_SCAN, else once the queue
has moved past where it was: when it would have been delivered), as long as fewer than the
budget are lost at once; L messages lost at once (a Redis that lost its queue) are re-sent over
about log2(L / RESEND_FLOOR) + 1 periods while the workers answer what is re-sent.

Worst case: a message the rule misjudges (one of ours put back beyond the scanned end: more than
QUEUE_SCAN restored at once; sends from two threads reaching Redis out of order; a worker on the
stock kombu fetch, between its BRPOP and its unacked record) is re-sent while it is still there:
classified twice and published once, and the budget bounds how many per period.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import redis

from ticketq import codec
from ticketq.names import CONSUMERS_KEY, FETCHING_KEY, unacked_key

QUEUE_SCAN = 1000  # messages read at the queue's consuming end per period
PERIOD_MAX_S = 5.0  # how often due messages are checked, at most
BACKOFF_CAP_S = 300.0  # the longest pause between two re-sends of one message
JITTER = 0.2  # each backoff pause is drawn from (1 ± JITTER) × its nominal length
RESEND_FLOOR = 100  # re-sends a period may always make (a Redis that lost its queue answers nothing yet)
RESEND_GROWTH = 2  # re-sends a period may make per message answered in the period before

_SENDS = itertools.count()  # the order of this process's sends: each message's latest send number


def next_send() -> int:
    """A number larger than every earlier send's in this process (its place in the queue's order)."""
    return next(_SENDS)


@dataclass
class Whereabouts:
    """Where the messages of ours were at one instant: `present` (queued at the consuming end,
    fetched or unacked), the latest send among ours in the scanned part of the queue, and whether
    the scan covered the whole queue."""

    present: set[str] = field(default_factory=set)
    newest_scanned: int | None = None
    whole_queue: bool = False

    @classmethod
    def read(cls, client: redis.Redis, queue: str, sends: Mapping[str, int]) -> Whereabouts:
        """One HKEYS and one MULTI on the broker (see the module docstring); `sends`: task id ->
        latest send number of each message of ours."""
        consumers = [name.decode() for name in client.hkeys(CONSUMERS_KEY)]
        pipe = client.pipeline(transaction=True)
        pipe.llen(queue)
        pipe.lrange(queue, -QUEUE_SCAN, -1)
        pipe.hvals(unacked_key())
        for consumer in consumers:
            pipe.lrange(FETCHING_KEY.format(consumer=consumer, queue=queue), 0, -1)
        length, scanned, unacked, *fetching = pipe.execute()
        return cls.of(length, scanned, unacked, [item for items in fetching for item in items], sends)

    @classmethod
    def of(cls, length: int, scanned: Sequence[bytes], unacked: Iterable[bytes], fetching: Iterable[bytes],
           sends: Mapping[str, int]) -> Whereabouts:  # fmt: skip
        """From what Redis holds: the queue's length, its scanned items, the unacked records
        ([message, exchange, routing key] each) and the fetching lists' items."""
        queued = {task_id for task_id in map(task_id_of, scanned) if task_id in sends}
        elsewhere = {task_id_of(item) for item in fetching} | {task_id_of(record, in_record=True) for record in unacked}
        newest = max((sends[task_id] for task_id in queued), default=None)
        return cls(queued | (elsewhere & sends.keys()), newest, length <= len(scanned))

    def lost(self, task_id: str, send: int) -> bool:
        """Plausibly lost: nowhere in sight, and out of the queue by the FIFO rule."""
        if task_id in self.present:
            return False
        return self.whole_queue or (self.newest_scanned is not None and send < self.newest_scanned)


def task_id_of(raw: bytes, in_record: bool = False) -> str | None:
    """The task id of a kombu message as Redis holds it (a queue item; `in_record`: an unacked
    record, [message, exchange, routing key]); None for anything else (another client's format)."""
    try:
        message = codec.loads(raw)
        if in_record:
            message = message[0]
        task_id = message["headers"]["id"]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return task_id if isinstance(task_id, str) else None


@dataclass
class _Tracked:
    send: int  # latest send number (-1: sent by an earlier run, before every send of this one)
    due: float  # monotonic time from which it may be re-sent
    resends: int = 0


class Resends:
    """Per-message backoff and the wait's budget (see the module docstring). No I/O: the producer
    reads `Whereabouts` and publishes; `rng` makes the jitter reproducible in tests."""

    def __init__(self, messages: Iterable[tuple[str, int | None]], resend_after: float, now: float,
                 rng: random.Random | None = None) -> None:  # fmt: skip
        """`messages`: (task id, send number, None for one an earlier run sent) of each re-sendable message."""
        self.base, self.period = resend_after, min(resend_after, PERIOD_MAX_S)
        self.rng = rng or random.Random()
        self.tracked = {task_id: _Tracked(-1, now) if send is None else _Tracked(send, now + resend_after)
                        for task_id, send in messages}  # fmt: skip
        self.answered_in_period = 0

    def answered(self, task_id: str) -> None:
        if self.tracked.pop(task_id, None) is not None:
            self.answered_in_period += 1

    def due(self, now: float) -> list[str]:
        """The task ids that may be re-sent now, oldest send first."""
        due = [(tracked.send, task_id) for task_id, tracked in self.tracked.items() if tracked.due <= now]
        return [task_id for _, task_id in sorted(due)]

    def all_due(self, now: float) -> int:
        """Every message waited for may be re-sent now (Redis lost them all); how many."""
        for tracked in self.tracked.values():
            tracked.due = min(tracked.due, now)
        return len(self.tracked)

    def sends(self) -> dict[str, int]:
        return {task_id: tracked.send for task_id, tracked in self.tracked.items()}

    def budget(self) -> int:
        """Re-sends allowed this period; starts the next period's count of answers."""
        allowed = max(RESEND_FLOOR, RESEND_GROWTH * self.answered_in_period)
        self.answered_in_period = 0
        return allowed

    def lost(self, due: Sequence[str], where: Whereabouts) -> list[str]:
        return [task_id for task_id in due if where.lost(task_id, self.tracked[task_id].send)]

    def resent(self, task_id: str, send: int, now: float) -> None:
        """`task_id` was sent again (send number `send`): its next re-send after the doubled pause."""
        tracked = self.tracked[task_id]
        tracked.resends += 1
        pause = min(BACKOFF_CAP_S, self.base * 2**tracked.resends)
        tracked.send, tracked.due = send, now + pause * self.rng.uniform(1 - JITTER, 1 + JITTER)
