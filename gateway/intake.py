"""Taking tickets in: parse and check a request body with the contract's rule, make a retried POST
a no-op, and send what is new through `Producer` only when Redis can keep it.

Framework-free (the HTTP layer is `gateway.app`): every refusal is a `Refused` with the status,
a reason and a one-line message.

Everything is per tenant (`gateway.auth.tenant_of`): with several tenants a ticket goes to the
workers as `tenant:id` (`Intake.wire_id`), so its marker, task id and result are its tenant's, and
the same id in two tenants is two tickets; with the one tenant `default` ids are sent as given.

Idempotency, in two parts, both keyed in Redis (`gateway.keys`):
- a ticket id: a marker written with the message that carries it, in the same atomic step
  (`gateway.enqueue`), says it was accepted and under which task id; a POST of a marked id sends
  nothing and is answered with that task id. Two POSTs racing with the same id cannot both send it.
- an `Idempotency-Key` header: the first POST claims the key atomically (`CLAIM_SCRIPT`) with its
  body's digest, then stores its answer there (TICKETQ_GATEWAY_IDEMPOTENCY_TTL_S); the same key
  again gets that answer, a different body under it a 422 (at once or later: one is queued), the
  same body while the first is still in flight a 409 with Retry-After. A POST that fails after
  its claim gives the key back; a claim left by a dead process lapses after CLAIM_TTL_S.
  Tickets without an id get one derived from the key, so a retry names the same tickets.

A POST's new tickets go as one packed message (task id `idempotent_task_id(queue, their ids,
packed=True)`); each has its own result, under its own id, carrying that task id. The queue-depth
bound is hard and counts tickets (`gateway.enqueue`): a POST is refused 429 when its new tickets
would take the queue past it.

Cost: one script per POST, one round trip (markers, bound, push, markers written), and a WAIT with
TICKETQ_REPLICA_ACKS; with an Idempotency-Key, its claim and its answer are one more each.

A 202 means Redis took the message and its markers (and TICKETQ_REPLICA_ACKS replicas hold them,
where set). Anything else is a 503 with Retry-After; nothing was queued, except when the replicas
did not confirm (then a retry is answered `duplicate` once they do) or the reply was lost (then
a retry finds the tickets `duplicate`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from gateway.auth import DEFAULT_TENANT
from gateway.enqueue import Enqueue, Outcome, Outgoing, Step, outgoing
from gateway.keys import IDEMPOTENCY_KEY, TICKET_KEY
from gateway.settings import GatewaySettings
from producer.api import Producer, QueuedMessages, TicketResult
from ticketq import codec
from ticketq.contract import ID_TENANT_ROOM, MAX_ID_CHARS, Reason, TicketRejected, UniqueIds, validate_ticket

FIELDS = ("id", "text", "schema", "metadata")
CLAIM_TTL_S = 60  # an Idempotency-Key claimed by a POST that never answered is free again after this
MAX_NESTING = 32  # a body nested deeper (objects and lists in one another) is refused with 400
# The gateway's ids leave room for the `tenant:` prefix they are sent with (`Intake.wire_id`).
MAX_GATEWAY_ID_CHARS = MAX_ID_CHARS - ID_TENANT_ROOM
# The field a contract reason is about (WRONG_TYPE names its field in the detail).
REASON_FIELDS = {Reason.MISSING_FIELD: "text", Reason.EMPTY_ID: "id", Reason.INVALID_ID: "id",
                 Reason.INVALID_UTF8: "text", Reason.OVERSIZE: "text", Reason.EMPTY_TEXT: "text",
                 Reason.DUPLICATE_ID: "id"}  # fmt: skip
_REDIS_ERRORS = (redis.exceptions.RedisError, OSError)


@dataclass
class Refused(Exception):
    """A request the gateway does not take: `status`, `reason` (a word), a one-line `message`;
    `errors` per bad ticket (`index`, `field`, `reason`, `message`), `retry_after` seconds."""

    status: int
    reason: str
    message: str
    errors: list[dict] = field(default_factory=list)
    retry_after: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"error": self.reason, "message": self.message}
        if self.errors:
            out["errors"] = self.errors
        return out


@dataclass(frozen=True)
class Checked:
    """A ticket that passed the rule; `id` always set (assigned when none was given)."""

    id: str
    text: str
    schema: str | None
    metadata: dict | None


def parse_body(body: bytes) -> list[object]:
    """The tickets of a POST body (one object or a list), or `Refused` 400: not JSON, nested deeper
    than MAX_NESTING, or holding a number that is not finite (NaN, Infinity, or one like 1e999)."""
    try:
        data = codec.loads_finite(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Refused(400, Reason.INVALID_JSON.value, f"the body is not JSON: {exc}") from None
    except RecursionError:  # deeper than the parser goes: far past MAX_NESTING
        raise _too_deep() from None
    _check_shape(data)
    if isinstance(data, dict):
        return [data]
    if isinstance(data, list) and data:
        return data
    shown = "an empty list" if data == [] else type(data).__name__
    raise Refused(400, Reason.BAD_PAYLOAD.value, f"the body must be a ticket object or a list of them, got {shown}")


def _check_shape(data: object) -> None:
    """`Refused` 400 when `data` nests deeper than MAX_NESTING or holds a non-finite float (1e999 parses as inf)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_NESTING:
                raise _too_deep()
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise Refused(400, "non_finite_number", "the body holds a number too large to be finite; numbers must be "
                          "finite")  # fmt: skip


def _too_deep() -> Refused:
    return Refused(400, "too_deep", f"the body nests objects and lists deeper than {MAX_NESTING} levels")


def check_tickets(raws: Sequence[object], settings: GatewaySettings, id_seed: str | None = None) -> list[Checked]:
    """Every ticket checked with the contract's rule, or `Refused` 422 naming each bad field.

    `id_seed` (from an Idempotency-Key): tickets without an id get `<seed>-<index>`, the same on a retry.
    """
    if len(raws) > settings.gateway_max_tickets:
        raise Refused(413, "too_many_tickets", f"{len(raws)} tickets in one request, above "
                      f"TICKETQ_GATEWAY_MAX_TICKETS={settings.gateway_max_tickets}")  # fmt: skip
    checked, errors, ids = [], [], UniqueIds()
    for index, raw in enumerate(raws):
        try:
            ticket = _check_one(raw, settings)
            ticket_id = ticket.id or (f"{id_seed}-{index}" if id_seed else uuid.uuid4().hex)
            ids.add(ticket_id, f"at #{index}")
            checked.append(Checked(ticket_id, ticket.text, ticket.schema, ticket.metadata))
        except TicketRejected as exc:
            errors.append({"index": index, "field": _field_of(exc), "reason": exc.reason, "message": exc.detail})
    if errors:
        first = errors[0]
        raise Refused(422, "invalid_tickets", f"{len(errors)} of {len(raws)} ticket(s) invalid, none accepted; "
                      f"#{first['index']} {first['field'] or 'ticket'}: {first['message']}", errors)  # fmt: skip
    return checked


def _check_one(raw: object, settings: GatewaySettings) -> Checked:
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise TicketRejected("unknown_field", f"unknown field(s) {', '.join(map(repr, unknown))}; a ticket has "
                                                  f"{', '.join(FIELDS)}")  # fmt: skip
        metadata = raw.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise TicketRejected(Reason.WRONG_TYPE, f"'metadata' must be an object, got {type(metadata).__name__}")
        raw = {name: value for name, value in raw.items() if name != "metadata"}
    else:
        metadata = None
    ticket = validate_ticket(raw, settings.max_ticket_bytes, MAX_GATEWAY_ID_CHARS)
    if ticket.schema is not None and settings.gateway_schemas and ticket.schema not in settings.gateway_schemas:
        raise TicketRejected(Reason.UNKNOWN_SCHEMA, f"'schema' {ticket.schema!r} is not served; served: "
                                                    f"{', '.join(settings.gateway_schemas)}")  # fmt: skip
    return Checked(ticket.id, ticket.text, ticket.schema, metadata)


def _field_of(exc: TicketRejected) -> str | None:
    if exc.reason in REASON_FIELDS:
        return REASON_FIELDS[Reason(exc.reason)]
    for name in FIELDS:
        if exc.detail.startswith(f"'{name}'"):
            return name
    return "schema" if exc.reason == Reason.UNKNOWN_SCHEMA else None


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


# KEYS[1]: an Idempotency-Key's entry (gateway.keys.IDEMPOTENCY_KEY).
# ARGV[1]: this POST's entry, JSON {body, answer: null, claim}; ARGV[2]: its TTL in seconds.
# Returns the entry already there (the key is taken), or false after storing ARGV[1] (claimed).
CLAIM_SCRIPT = """
local found = redis.call('GET', KEYS[1])
if found then return found end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""
# KEYS[1]: as above; ARGV[1]: the entry CLAIM_SCRIPT stored. Deletes it only if it is still that one.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def check_room(step: Step, settings: GatewaySettings) -> None:
    """`Refused` 429 when the POST's new tickets would take the queue past TICKETQ_GATEWAY_MAX_QUEUE_DEPTH,
    413 when they alone are more than it (no retry would be taken)."""
    bound, new = settings.gateway_max_queue_depth, step.markers.count(None)
    if step.outcome is not Outcome.FULL:
        return
    if new > bound:
        raise Refused(413, "too_many_tickets", f"{new} new tickets in one request, above "
                      f"TICKETQ_GATEWAY_MAX_QUEUE_DEPTH={bound}: send them in smaller requests")  # fmt: skip
    raise Refused(429, "queue_full", f"{step.depth} tickets wait, and this request's {new} would pass "
                  f"TICKETQ_GATEWAY_MAX_QUEUE_DEPTH={bound}; retry later", [],
                  settings.gateway_retry_after_s)  # fmt: skip


class Intake:
    """Sends checked tickets, once: a POST's steps on the event loop (`gateway.enqueue`'s client);
    `lookup` blocking, for a worker thread, through a `Producer` per thread (Celery's clients are not
    shared across threads here)."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._local = threading.local()
        self._producers: list[Producer] = []
        self._lock = threading.Lock()
        self.enqueue = Enqueue(settings)
        self._messages: QueuedMessages | None = None

    @property
    def producer(self) -> Producer:
        producer = getattr(self._local, "producer", None)
        if producer is None:
            producer = Producer(self.settings, retry_for_s=self.settings.gateway_send_retry_s)
            self._local.producer = producer
            with self._lock:
                self._producers.append(producer)
        return producer

    def close(self) -> None:
        with self._lock:
            producers, self._producers = self._producers, []
        for producer in producers:
            producer.close()

    def wire_id(self, tenant: str, ticket_id: str) -> str:
        """The id `tenant`'s ticket `ticket_id` is sent, recorded and answered under: `tenant:id` when
        tokens name several tenants (tenant names hold no ':', so no two tenants' ids meet), else as given."""
        return f"{tenant}:{ticket_id}" if self.settings.multi_tenant else ticket_id

    def ticket_key(self, wire_id: str) -> str:
        return TICKET_KEY.format(queue=self.settings.queue, ticket_id=wire_id)

    # --- POST ---

    async def claim(self, tenant: str, key: str, digest: str) -> tuple[str | None, dict | None]:
        """Claim an Idempotency-Key for a body: (the claim to `release` or `remember` with, None) when
        this POST is its first, (None, the stored answer) for a retry of an answered one; `Refused`
        422 when another body holds it, 409 while the same body's first POST is still in flight."""
        claim = json.dumps({"body": digest, "answer": None, "claim": uuid.uuid4().hex})
        name = self._idempotency_key(tenant, key)
        try:
            found = await self.enqueue.client.eval(CLAIM_SCRIPT, 1, name, claim, CLAIM_TTL_S)
        except _REDIS_ERRORS as exc:
            raise self._refusal(exc) from None
        if found is None:
            return claim, None
        entry = json.loads(found)
        if entry["body"] != digest:
            raise Refused(422, "idempotency_key_reused", f"Idempotency-Key {key[:80]!r} was used with another body; "
                          "use a new key for new tickets")  # fmt: skip
        if entry["answer"] is None:
            raise Refused(409, "idempotency_key_in_flight", f"a POST under Idempotency-Key {key[:80]!r} is still "
                          "being answered; send again to get its answer", [], 1)  # fmt: skip
        return None, entry["answer"]

    async def release(self, tenant: str, key: str, claim: str) -> None:
        """Give back a claimed key whose POST failed, so its retry is taken (best effort: it lapses anyway)."""
        name = self._idempotency_key(tenant, key)
        with contextlib.suppress(*_REDIS_ERRORS):  # else the claim lapses after CLAIM_TTL_S
            await self.enqueue.client.eval(RELEASE_SCRIPT, 1, name, claim)

    async def remember(self, tenant: str, key: str, claim: str, answer: dict) -> None:
        """Store `answer` in the key this POST claimed."""
        entry = {**json.loads(claim), "answer": answer}
        # On a Redis error the tickets are in: a retry is answered 409 until the claim lapses, then by their markers.
        with contextlib.suppress(*_REDIS_ERRORS):
            await self.enqueue.client.set(self._idempotency_key(tenant, key), json.dumps(entry), xx=True,
                                          ex=self.settings.gateway_idempotency_ttl_s)  # fmt: skip

    def _idempotency_key(self, tenant: str, key: str) -> str:
        return IDEMPOTENCY_KEY.format(tenant=tenant, digest=hashlib.sha256(key.encode()).hexdigest())

    async def accept(self, tickets: Sequence[Checked], tenant: str = DEFAULT_TENANT, token: str = "") -> list[dict]:
        """Send `tenant`'s tickets not accepted before, as one packed message; one row per ticket: id,
        task_id, status (`accepted`, or `duplicate` for one accepted by an earlier POST). `Refused` 413/429/503."""
        wire = [self.wire_id(tenant, ticket.id) for ticket in tickets]
        keys = [self.ticket_key(w) for w in wire]
        carried = [True] * len(tickets)
        for _ in range(len(tickets) + 2):  # a marker only ever appears: each try carries fewer, or ends
            out = self._message(wire, tickets, carried, tenant, token)
            try:
                step = await self.enqueue.push(keys, carried, out.message, out.records)
            except _REDIS_ERRORS as exc:
                raise self._refusal(exc) from None
            if step.outcome is not Outcome.CHANGED:
                break
            carried = [marker is None for marker in step.markers]
        else:
            raise self._unavailable("contended", "other POSTs kept taking these tickets; send again")
        check_room(step, self.settings)
        await self._confirm_replicas()
        before = {w: json.loads(marker) for w, marker in zip(wire, step.markers, strict=True) if marker is not None}
        return [{"id": t.id, "task_id": before[w]["task_id"], "status": "duplicate"} if w in before
                else {"id": t.id, "task_id": out.task_id, "status": "accepted"}
                for w, t in zip(wire, tickets, strict=True)]  # fmt: skip

    def _message(self, wire: Sequence[str], tickets: Sequence[Checked], carried: Sequence[bool], tenant: str,
                 token: str) -> Outgoing:  # fmt: skip
        if self._messages is None:
            self._messages = QueuedMessages(self.producer.app, self.settings.queue)
        return outgoing(self._messages, [(w, t.text, t.schema, {"metadata": t.metadata, "token": token,
                        "tenant": tenant, "id": t.id}) for w, t, c in zip(wire, tickets, carried, strict=True) if c])

    async def _confirm_replicas(self) -> None:
        """With TICKETQ_REPLICA_ACKS, `Refused` 503 unless that many replicas hold every write so far
        (a retry of the same tickets, answered `duplicate`, asks again)."""
        wanted = self.settings.replica_acks
        try:
            acked = await self.enqueue.replicated(wanted, self.settings.replica_timeout_s) if wanted else 0
        except _REDIS_ERRORS as exc:
            raise self._refusal(exc) from None
        if acked < wanted:
            raise self._unavailable("not_replicated", f"the tickets are queued, but only {acked} of {wanted} "
                                    "replica(s) (TICKETQ_REPLICA_ACKS) confirmed them; send again")  # fmt: skip

    # --- GET ---

    def lookup(self, ticket_id: str, tenant: str = DEFAULT_TENANT) -> tuple[int, dict]:
        """(200, the result) / (202, pending) / (404, unknown) for `tenant`'s ticket id."""
        wire = self.wire_id(tenant, ticket_id)
        try:
            marker = self.producer.redis.get(self.ticket_key(wire))
        except _REDIS_ERRORS as exc:
            raise self._refusal(exc) from None
        if marker is None:
            return 404, {"error": "unknown_ticket", "message": f"no ticket {ticket_id!r} was accepted (or its result "
                         "expired: TICKETQ_RESULT_EXPIRES_S)"}  # fmt: skip
        record = json.loads(marker)
        result = TicketResult(record["task_id"], app=self.producer.app)
        result.ticket_ids, result.packed = (wire,), bool(record.get("packed"))
        rows = [row for row in self.producer.ready_now([result]) if row.get("id") == wire]  # its own of a pack
        if rows:
            return 200, {**rows[0], "id": ticket_id}
        return 202, {"id": ticket_id, "task_id": result.id, "status": "pending"}

    # --- Redis ---

    def _refusal(self, exc: BaseException) -> Refused:
        if isinstance(exc, redis.exceptions.ResponseError):  # OOM, READONLY, NOREPLICAS on a read-modify path
            return self._unavailable("redis_refused_write", f"Redis refused: {exc}")
        return self._unavailable("redis_unavailable", f"Redis is not reachable: {exc}")

    def _unavailable(self, reason: str, message: str) -> Refused:
        return Refused(503, reason, message.splitlines()[0] if message else reason, [],
                       self.settings.gateway_retry_after_s)  # fmt: skip
