"""The dispatcher's repair commands: results it could not deliver, listed and POSTed again.

- Dead letters (`keys.DELIVER_DEAD_STREAM`, or the dispatcher's `dead_stream`: the write-back's
  own): `ticketq-deliver dead` lists them, `ticketq-deliver
  dead --redeliver` POSTs each once more, under its first delivery id, and deletes the dead letter
  when the receiver answered 2xx. A dead letter carries its result's epoch: one whose ticket an
  earlier dead letter of an earlier epoch holds too (answered before and after a Redis data loss)
  is deleted unsent (`ticketq.epoch.AcrossEpochs`, the dispatcher's own rule), counted as a repeat.
- Trimmed ranges (`keys.DELIVER_GAPS_STREAM`, recorded by the dispatcher when TICKETQ_STREAM_MAXLEN
  trimmed results its group had not read): `ticketq-deliver redeliver-trimmed` POSTs every result
  the Celery backend still holds (`celery-task-meta-<task>`, kept TICKETQ_RESULT_EXPIRES_S) stored in
  that range, widened by `margin_s` on each side (a result is stored a moment apart from its entry),
  under delivery id `task:<task id>:<slot>`, and deletes the range once all were answered 2xx. A
  result near a range's edge may so be delivered twice, under two delivery ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from typing import Any

from gateway.deliver import Dispatcher
from gateway.group import stream_id, text
from gateway.keys import CELERY_RESULT_KEY, DELIVER_GAPS_STREAM
from ticketq import codec

SCAN_COUNT = 1000  # keys per SCAN step over the Celery backend


@dataclass
class DeadLetter:
    """One entry of the delivery dead-letter stream."""

    dead_id: str  # its id in DELIVER_DEAD_STREAM
    delivery_id: str  # the result's entry id in the results stream, its X-Ticketq-Delivery
    url: str
    error: str
    result: Any
    epoch: bytes | None = None  # the results-stream entry's `epoch` field (None: an older dead letter)


@dataclass
class Repaired:
    """What one repair command did: results POSTed and answered 2xx, and those that failed (with why)."""

    delivered: int = 0
    failed: int = 0
    last_error: str = ""
    repeats: int = 0  # dead letters of a ticket an earlier epoch's dead letter holds too: deleted unsent

    def line(self, verb: str) -> str:
        """What the command prints: `N delivered, M failed (last: ...)`, `verb` for "delivered"."""
        repeats = f", {self.repeats} repeat(s) of an earlier epoch deleted" if self.repeats else ""
        return f"{self.delivered} {verb}, {self.failed} failed{repeats}" + (
            f" (last: {self.last_error})" if self.failed else "")


def dead_letters(dispatcher: Dispatcher) -> list[DeadLetter]:
    """Every delivery dead letter, oldest first."""
    out = []
    for dead_id, fields in dispatcher.redis.xrange(dispatcher.dead_stream):
        data = fields.get(b"data")
        out.append(DeadLetter(text(dead_id), text(fields.get(b"entry_id", b"")), text(fields.get(b"url", b"")),
                              text(fields.get(b"error", b"")), codec.loads(data) if data else None,
                              fields.get(b"epoch") or None))  # fmt: skip
    return out


def redeliver_dead(dispatcher: Dispatcher) -> Repaired:
    """POST each dead letter once more; each answered 2xx is deleted from the dead-letter stream, and so is
    each that repeats an earlier epoch's ticket (module docstring), unsent."""
    done = Repaired()
    for letter in dead_letters(dispatcher):
        if isinstance(letter.result, dict) and dispatcher.reader.epochs.repeat(letter.epoch, letter.result):
            dispatcher.redis.xdel(dispatcher.dead_stream, letter.dead_id)
            done.repeats += 1
            continue
        error = dispatcher.post_once(letter.delivery_id, letter.result)
        _count(done, error)
        if not error:
            dispatcher.redis.xdel(dispatcher.dead_stream, letter.dead_id)
            dispatcher.metrics.deliveries.inc()
    return done


def redeliver_trimmed(dispatcher: Dispatcher, margin_s: float) -> Repaired:
    """POST the stored results of every trimmed range this group recorded; delete each range repaired."""
    done = Repaired()
    gaps = [(text(gap_id), fields) for gap_id, fields in dispatcher.redis.xrange(DELIVER_GAPS_STREAM)
            if text(fields[b"group"]) == dispatcher.group]  # fmt: skip
    if not gaps:
        return done
    margin_ms = margin_s * 1000  # a result's store and its stream entry are moments apart, either way
    windows = [(_ms(f[b"after"]) - margin_ms, _ms(f[b"before"]) + margin_ms) for _, f in gaps]
    for task_id, slot, result, done_ms in stored_results(dispatcher):
        if any(low <= done_ms <= high for low, high in windows):
            _count(done, dispatcher.post_once(f"task:{task_id}:{slot}", result))
    if not done.failed:
        dispatcher.redis.xdel(DELIVER_GAPS_STREAM, *(gap_id for gap_id, _ in gaps))
    return done


def stored_results(dispatcher: Dispatcher) -> Iterator[tuple[str, int, Any, float]]:
    """(task id, slot, result, stored at in unix ms) of every SUCCESS in the Celery backend: a packed
    message's result is a list, one per ticket (slot = its place), an unpacked one's slot is 0."""
    keys = dispatcher.redis.scan_iter(CELERY_RESULT_KEY.format(task_id="*"), count=SCAN_COUNT)
    while page := list(islice(keys, SCAN_COUNT)):
        for key, raw in zip(page, dispatcher.redis.mget(page), strict=True):  # one round trip a page
            meta = json.loads(raw) if raw else {}
            if meta.get("status") != "SUCCESS" or not meta.get("date_done"):
                continue
            stored = datetime.fromisoformat(meta["date_done"])
            stored = stored if stored.tzinfo else stored.replace(tzinfo=timezone.utc)  # Celery's now() is UTC
            value, task_id = meta.get("result"), meta.get("task_id") or text(key).rpartition("meta-")[2]
            for slot, result in enumerate(value if isinstance(value, list) else [value]):
                yield task_id, slot, result, stored.timestamp() * 1000


def _ms(entry_id: bytes) -> int:
    return stream_id(text(entry_id))[0]


def _count(done: Repaired, error: str) -> None:
    if error:
        done.failed += 1
        done.last_error = error
    else:
        done.delivered += 1
