"""The review stream as each tenant's work list, and decisions written once.

The worker copies every result below a field's threshold to `names.REVIEW_STREAM` (`data` = the
result, `text` = the ticket's text). The review page reads it through the consumer group
`names.REVIEW_GROUP`: `sort.lua` reads the entries no one has read yet and claims each for its
tenant's consumer (`keys.REVIEW_CONSUMER` + tenant), so a tenant's undecided items are exactly
that consumer's pending entries, oldest first (XPENDING). `decide.lua` writes a decision once: it
acks the entry, appends the `ticketq.labelled` record to `names.LABELLED_STREAM` and keeps it under
the item's decision key; a second decision on the same item writes nothing and is answered with
the first. An entry trimmed from the stream while pending is acked and dropped (nothing to show).

Blocking (redis-py), for a worker thread. Cost per page: one script call, one XPENDING, one
pipelined XRANGE per item shown; per decision, one XRANGE and one script call.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import redis

from gateway.auth import DEFAULT_TENANT
from gateway.keys import REVIEW_CONSUMER, REVIEW_DECISION_KEY
from ticketq import labelled
from ticketq.lua import script
from ticketq.names import LABELLED_STREAM, RESULTS_STREAM, REVIEW_GROUP, REVIEW_STREAM

log = logging.getLogger(__name__)
SORT = script(__package__, "sort")
DECIDE = script(__package__, "decide")
SORTER = "sorter"  # the consumer that reads new entries, for the moment before it hands them out
SORT_BATCH = 500  # new entries handed out per page view at most


@dataclass(frozen=True)
class Field:
    """One field of an item as the model answered it: its labels (the keys of `probs`), the answer."""

    name: str
    probs: dict[str, float]
    answer: labelled.Answer
    confidence: float
    multi: bool

    def chosen(self, label: str) -> bool:
        return label in self.answer if self.multi else label == self.answer


@dataclass(frozen=True)
class Item:
    """One review item: its entry id, the ticket (id as its tenant sent it, text) and the model's answer."""

    review_id: str
    id: str
    tenant: str
    text: str | None  # None: an entry written before the review stream carried the text
    result: dict[str, Any]

    @property
    def fields(self) -> list[Field]:
        return [Field(name, dict(answer.get("probs", {})), labelled.model_answers({"fields": {name: answer}})[name],
                      float(answer.get("confidence", 0.0)), "labels" in answer)
                for name, answer in self.result.get("fields", {}).items()]  # fmt: skip

    def as_record_source(self) -> dict[str, Any]:
        return {"review_id": self.review_id, "id": self.id, "tenant": self.tenant, "text": self.text,
                "result": self.result}  # fmt: skip


@dataclass(frozen=True)
class Decided:
    """What a decision did: `written` (this one was the first), and the record that stands (ours, or
    the first reviewer's; None when the item is not this tenant's or gone)."""

    written: bool
    record: dict[str, Any] | None


def tenant_and_id(wire_id: str, multi_tenant: bool) -> tuple[str, str]:
    """(tenant, the id as the tenant sent it) of a result id, as `gateway.intake.Intake.wire_id` made it."""
    tenant, colon, rest = wire_id.partition(":")
    if multi_tenant and colon and tenant:
        return tenant, rest
    return DEFAULT_TENANT, wire_id


class ReviewStore:
    """Each tenant's undecided review items, and their decisions (see the module's docstring)."""

    def __init__(self, client: redis.Redis, multi_tenant: bool, decision_ttl_s: int, stream_maxlen: int,
                 deliver: bool = False) -> None:  # fmt: skip
        self.redis, self.multi_tenant, self.deliver = client, multi_tenant, deliver
        self.decision_ttl_s, self.stream_maxlen = decision_ttl_s, stream_maxlen

    def ensure_group(self) -> None:
        """The review group, created at the stream's start (MKSTREAM) if absent."""
        try:
            self.redis.xgroup_create(REVIEW_STREAM, REVIEW_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def sort(self) -> int:
        """Hand new review entries to their tenants' consumers; how many were handed out."""
        args = [REVIEW_GROUP, SORTER, SORT_BATCH, "1" if self.multi_tenant else "0", REVIEW_CONSUMER]
        try:
            return int(self.redis.eval(SORT, 1, REVIEW_STREAM, *args))
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()
            return int(self.redis.eval(SORT, 1, REVIEW_STREAM, *args))

    def pending(self, tenant: str, count: int) -> list[Item]:
        """`tenant`'s oldest undecided items, at most `count`."""
        self.sort()
        rows = self.redis.xpending_range(REVIEW_STREAM, REVIEW_GROUP, "-", "+", count, REVIEW_CONSUMER + tenant)
        ids = [row["message_id"] for row in rows]
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(REVIEW_STREAM, entry_id, entry_id)
        items, gone = [], []
        for entry_id, found in zip(ids, pipe.execute(), strict=True):
            item = self._item(entry_id, found[0][1]) if found else None
            if item is None:
                gone.append(entry_id)
            elif item.tenant == tenant:
                items.append(item)
        if gone:  # trimmed (or unreadable) while pending: nothing left to show or decide
            log.warning("review: %d pending item(s) of %s trimmed from %s, dropped", len(gone), tenant, REVIEW_STREAM)
            self.redis.xack(REVIEW_STREAM, REVIEW_GROUP, *gone)
        return items

    def item(self, tenant: str, review_id: str) -> Item | None:
        """`tenant`'s item `review_id` if it is still in the stream (decided or not), else None."""
        try:
            found = self.redis.xrange(REVIEW_STREAM, review_id, review_id)
        except redis.ResponseError:  # not a stream id
            return None
        item = self._item(review_id, found[0][1]) if found else None
        return item if item is not None and item.tenant == tenant else None

    def decide(self, item: Item, expected: dict[str, labelled.Answer], reviewer: str, at: float) -> Decided:
        """Write `reviewer`'s decision on `item` once (see `decide.lua`)."""
        record = labelled.decision(item.as_record_source(), expected, reviewer, at)
        revised = json.dumps(self.revised(item, record)) if self.deliver else ""
        keys = [REVIEW_STREAM, LABELLED_STREAM, REVIEW_DECISION_KEY.format(entry_id=item.review_id), RESULTS_STREAM]
        args = [REVIEW_GROUP, item.review_id, REVIEW_CONSUMER + item.tenant, json.dumps(record),
                self.decision_ttl_s, revised, self.stream_maxlen]  # fmt: skip
        answer = self.redis.eval(DECIDE, len(keys), *keys, *args)
        if int(answer[0]) == 1:
            return Decided(True, record)
        return Decided(False, json.loads(answer[1]) if len(answer) > 1 else None)

    @staticmethod
    def revised(item: Item, record: dict[str, Any]) -> dict[str, Any]:
        """The item's result with the reviewer's answers in place of the model's (its probabilities kept),
        `review` false and `reviewed` {by, at, corrected}: delivered like any result."""
        fields = {}
        for name, answer in item.result.get("fields", {}).items():
            decided = record["expected"].get(name)
            key = "labels" if "labels" in answer else "label"
            fields[name] = {**answer, key: decided, "review": False} if decided is not None else answer
        reviewed = {"by": record["reviewer"], "at": record["decided_at"], "corrected": record["corrected"]}
        return {**item.result, "fields": fields, "review": False, "reviewed": reviewed}

    def _item(self, entry_id: str | bytes, fields: dict) -> Item | None:
        try:
            result = json.loads(fields[b"data"])
        except (KeyError, ValueError):
            return None
        if not isinstance(result, dict) or not isinstance(result.get("fields"), dict):
            return None
        tenant, ticket_id = tenant_and_id(str(result.get("id", "")), self.multi_tenant)
        text = fields.get(b"text")
        review_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return Item(review_id, ticket_id, tenant, text.decode() if text is not None else None, result)
