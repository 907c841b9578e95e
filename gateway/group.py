"""The dispatcher's reads of the results stream through its consumer group: its own pending
entries (once, at start), new ones, and XAUTOCLAIM of entries a stopped dispatcher left pending.

Trimmed before read: each read of new entries is one MULTI with XINFO STREAM and XINFO GROUPS, so a
range TICKETQ_STREAM_MAXLEN trimmed before the group read it is always seen (never after the read
skipped past it): counted (`ticketq_deliver_trimmed_results_total`), logged once, and recorded in
`keys.DELIVER_GAPS_STREAM` for `ticketq-deliver redeliver-trimmed` (gateway.redeliver). A pending
entry trimmed before its ack (XREADGROUP returns it without fields, XAUTOCLAIM as deleted) is
counted and recorded the same way. The delivery lag (unread plus pending) is a gauge set on each read.
Consumers that hold nothing and were idle past TICKETQ_DELIVER_CLAIM_IDLE_S (stopped dispatchers) are
deleted from the group on each re-claim round that found nothing (forget_consumers.lua).

Across a Redis data loss: an entry of a later epoch (its `epoch` field) repeating a ticket read in
an earlier epoch is acked unsent and counted (`ticketq_deliver_repeats_total`): `unrepeated`, by the
producer's own rule (`ticketq.epoch.AcrossEpochs`) over the last TICKETQ_STREAM_MAXLEN entries read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from gateway.keys import DELIVER_GAPS_STREAM
from gateway.metrics import DeliverMetrics
from gateway.settings import GatewaySettings
from ticketq import codec
from ticketq.epoch import AcrossEpochs
from ticketq.lua import script
from ticketq.names import RESULTS_STREAM

log = logging.getLogger(__name__)
FORGET_CONSUMERS = script(__package__, "forget_consumers")  # idle consumers holding nothing, deleted
READ_BLOCK_MS = 1000  # how long one wait for new results blocks

Entry = tuple[str, dict]


class GroupReader:
    """Entries for one consumer of the dispatcher group, each read accounted for."""

    def __init__(self, client: redis.Redis, settings: GatewaySettings, metrics: DeliverMetrics, consumer: str) -> None:
        self.redis, self.settings, self.metrics = client, settings, metrics
        self.group, self.consumer = settings.deliver_group, consumer
        self._own_done = False  # this consumer's own pending entries (a restart under the same name) re-read
        self.epochs = AcrossEpochs(settings.stream_maxlen)  # the tickets read, per epoch (module docstring)

    def ensure_group(self) -> None:
        """Create the group at the stream's start (results already there are delivered too) if absent."""
        try:
            self.redis.xgroup_create(RESULTS_STREAM, self.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self) -> list[Entry]:
        """This consumer's own pending entries first (once), then new ones: read in one MULTI with the
        stream's and the group's state, so entries trimmed before the group read them are always seen
        (`_account_trimmed`); with nothing new, wait up to READ_BLOCK_MS for it (XREAD, not the group)."""
        count = self.settings.deliver_concurrency  # one thread each: none waits untouched in the pool
        if not self._own_done:
            reply = self.redis.xreadgroup(self.group, self.consumer, {RESULTS_STREAM: "0"}, count=count)
            raw = reply[0][1] if reply else []
            self._own_done = not raw
            entries, gone = _entries(raw)
            for entry_id in gone:  # read by us, trimmed before we acked it
                self._account_trimmed(entry_id, entry_id, 1)
            if gone:
                self.redis.xack(RESULTS_STREAM, self.group, *gone)
            return entries
        pipe = self.redis.pipeline(transaction=True)
        pipe.xinfo_stream(RESULTS_STREAM)
        pipe.xinfo_groups(RESULTS_STREAM)
        pipe.xreadgroup(self.group, self.consumer, {RESULTS_STREAM: ">"}, count=count)
        stream, groups, reply = pipe.execute()
        group = next((g for g in groups if text(g["name"]) == self.group), None)
        if group is None:  # deleted since ensure_group: the XREADGROUP failed too (NOGROUP)
            return []
        self._check_gap(stream, group)
        lag = group.get("lag")
        self.metrics.lag.set((stream["length"] if lag is None else lag) + group["pending"])
        entries, _ = _entries(reply[0][1]) if reply else ([], [])
        if not reply:
            self.redis.xread({RESULTS_STREAM: text(group["last-delivered-id"])}, count=1, block=READ_BLOCK_MS)
        return entries

    def unrepeated(self, entries: Sequence[Entry]) -> list[Entry]:
        """`entries` (in stream order) less those repeating a ticket read in an earlier epoch: acked, counted."""
        repeats = [entry_id for entry_id, fields in entries if self._repeat(fields)]
        if repeats:
            self.redis.xack(RESULTS_STREAM, self.group, *repeats)
            self.metrics.repeats.inc(len(repeats))
            log.info("not delivering %d result(s) (%s...): their tickets were read before Redis lost its data",
                     len(repeats), repeats[0])  # fmt: skip
        return [entry for entry in entries if entry[0] not in repeats]

    def _repeat(self, fields: dict) -> bool:
        try:
            result = codec.loads(fields[b"data"])
        except (KeyError, ValueError):
            return False  # not a result: the dispatcher's to handle
        return isinstance(result, dict) and self.epochs.repeat(fields.get(b"epoch"), result)

    def _check_gap(self, stream: dict, group: dict) -> None:
        """Entries after the group's last-delivered id that the stream no longer holds: trimmed
        (TICKETQ_STREAM_MAXLEN) before the group read them; counted, logged once, recorded for repair."""
        trimmed = trimmed_unread(stream, group)
        if trimmed != 0:
            first = text(stream["first-entry"][0])
            self._account_trimmed(text(group["last-delivered-id"]), first, trimmed or 0)

    def _account_trimmed(self, after: str, before: str, count: int) -> None:
        self.metrics.trimmed.inc(count)
        self.redis.xadd(DELIVER_GAPS_STREAM, {"group": self.group, "after": after, "before": before, "count": count},
                        maxlen=self.settings.stream_maxlen, approximate=True)  # fmt: skip
        log.error("%s result(s) after %s and before %s were trimmed from %s (TICKETQ_STREAM_MAXLEN) before group "
                  "%s delivered them: re-POST them with `ticketq-deliver redeliver-trimmed`",
                  count or "an unknown number (maybe none) of", after, before, RESULTS_STREAM, self.group)  # fmt: skip

    def claim(self) -> list[Entry]:
        """Entries pending in the group for longer than TICKETQ_DELIVER_CLAIM_IDLE_S, now ours."""
        reply = self.redis.xautoclaim(RESULTS_STREAM, self.group, self.consumer,
                                      int(self.settings.deliver_claim_idle_s * 1000), start_id="0-0",
                                      count=self.settings.deliver_concurrency)  # fmt: skip
        entries, gone = _entries(reply[1])
        for entry_id in [*gone, *(text(e) for e in (reply[2] if len(reply) > 2 else []))]:
            self._account_trimmed(entry_id, entry_id, 1)  # pending, then trimmed: XAUTOCLAIM dropped it
        if entries:
            log.info("re-claimed %d result(s) left pending by a dispatcher that stopped", len(entries))
        else:
            self.forget_stopped_consumers()
        return entries

    def forget_stopped_consumers(self) -> list[str]:
        """Delete the group's consumers that hold nothing and were idle past TICKETQ_DELIVER_CLAIM_IDLE_S
        (stopped dispatchers; one script: checked and deleted at once)."""
        idle_ms = int(self.settings.deliver_claim_idle_s * 1000)
        gone = [text(name) for name in self.redis.eval(FORGET_CONSUMERS, 1, RESULTS_STREAM, self.group, idle_ms,
                                                        self.consumer)]  # fmt: skip
        if gone:
            log.info("forgot %d stopped consumer(s) of group %s: %s", len(gone), self.group, ", ".join(gone))
        return gone


def trimmed_unread(stream: dict, group: dict) -> int | None:
    """How many entries after the group's last-delivered id the stream no longer holds (XINFO STREAM
    and XINFO GROUPS replies): 0 when none, None when Redis cannot count them (before Redis 7, or
    after an XDEL or XGROUP SETID made the group's entries-read unknown)."""
    last, first = text(group["last-delivered-id"]), stream.get("first-entry")
    if not first or stream_id(text(first[0])) <= stream_id(last):
        return 0  # the stream still holds the entry right after the last one read
    read, added = group.get("entries-read"), stream.get("entries-added")
    if added is None or (read is None and last != "0-0"):
        return None
    return max(0, added - (read or 0) - stream["length"])


def _entries(raw: Sequence) -> tuple[list[Entry], list[str]]:
    """XREADGROUP/XAUTOCLAIM entries as (id, fields), and the ids of deleted entries (fields None)."""
    out, gone = [], []
    for entry_id, fields in raw:
        if fields:
            out.append((text(entry_id), fields))
        else:
            gone.append(text(entry_id))
    return out, gone


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id, `ms-seq`, as a pair that orders like the stream."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
