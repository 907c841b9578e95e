"""Results out by webhook: `ticketq-deliver` reads `ticketq:results` through a consumer group and
POSTs each result, signed, to the configured URL, at least once.

A result is acked (XACK) only after the receiver answered 2xx, or after it went to the dead-letter
stream (`keys.DELIVER_DEAD_STREAM`, in the same MULTI as its ack). A dispatcher killed at any point
leaves its unacked results pending in the group: on start it re-reads its own (same consumer name:
TICKETQ_DELIVER_CONSUMER, by default the host name),
and every dispatcher re-claims, with XAUTOCLAIM, any pending longer than TICKETQ_DELIVER_CLAIM_IDLE_S
(a dispatcher that died). So a result may be POSTed more than once, never zero times; the receiver
deduplicates by `X-Ticketq-Delivery`, the result's stream entry id, the same on every attempt.

Each POST carries `X-Ticketq-Timestamp` (unix seconds) and `X-Ticketq-Signature:
sha256=<hex HMAC-SHA256(key, timestamp + "." + body)>`; the body is `{"delivery_id", "tenant",
"result", "metadata"}` (the tenant and metadata the gateway recorded with the ticket, if any).

Per tenant: the gateway's record of each ticket names its tenant, so a result goes to its tenant's
URL (TICKETQ_DELIVER_URLS `schema@tenant=url` or `@tenant=url`), signed with its tenant's key
(TICKETQ_DELIVER_SECRETS `@tenant=key`); a tenant without its own gets TICKETQ_DELIVER_URL and
TICKETQ_DELIVER_SECRET. The result's `id` is the id the tenant sent (not the wire's `tenant:id`).

Retries: a POST that fails (no answer, or not 2xx) is tried again after TICKETQ_DELIVER_BACKOFF_S,
doubling up to TICKETQ_DELIVER_BACKOFF_MAX_S, with jitter (half the pause random), for at most
TICKETQ_DELIVER_MAX_ATTEMPTS POSTs; then it is dead-lettered. Worst case per result: that many
POSTs, each up to TICKETQ_DELIVER_TIMEOUT_S, plus the pauses (with the defaults: 30 POSTs over 11.5
to 23 minutes of pauses, `pause_bounds`: a receiver down for ten minutes dead-letters nothing), and
again per dispatcher crash, whose count starts over. Before
each retry the entry is claimed again by its own consumer (one XCLAIM), so its idle time restarts
and no other dispatcher takes a result that is merely backing off: an entry in work is never idle
longer than one POST and one pause, which is why TICKETQ_DELIVER_CLAIM_IDLE_S must exceed
TICKETQ_DELIVER_TIMEOUT_S + TICKETQ_DELIVER_BACKOFF_MAX_S (checked at start). A batch is
TICKETQ_DELIVER_CONCURRENCY results, each POSTed by its own thread at once, and the next batch waits
for the slowest: a receiver that is down holds the stream back, and gets the backlog once it is back.

Across a Redis data loss: publish-once marks go with the data, so a ticket answered before the loss
and re-sent after it is streamed again in the new epoch (each entry's `epoch` field). The reader
remembers what it read per epoch, by the producer's own rule (`ticketq.epoch.AcrossEpochs`, the
last TICKETQ_STREAM_MAXLEN results), and acks an entry that repeats an earlier epoch's ticket
without POSTing it (`ticketq_deliver_repeats_total`, gateway.group). Its memory is the process's:
a dispatcher started after the loss never saw the old epoch and delivers the new one whole.

Reading the group (own pending entries, new ones, re-claims, ranges trimmed before they were read)
is gateway.group's; the repair commands are gateway.redeliver's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import random
import signal
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import redis

from gateway.group import Entry, GroupReader
from gateway.keys import (
    DELIVER_DEAD_STREAM,
    DELIVERY_HEADER,
    SIGNATURE_HEADER,
    TICKET_KEY,
    TIMESTAMP_HEADER,
)  # fmt: skip
from gateway.metrics import DeliverMetrics
from gateway.settings import GatewaySettings
from ticketq import codec, connections
from ticketq.names import RESULTS_STREAM

log = logging.getLogger(__name__)
REDIS_PAUSE_S = 1.0  # pause after a Redis error in the loop before asking again
NO_URL = "no receiver URL for its schema or tenant (TICKETQ_DELIVER_URLS)"


def urls_by_tenant(urls: dict[str, str]) -> bool:
    """True when TICKETQ_DELIVER_URLS names a tenant (`@tenant`, `schema@tenant`)."""
    return any("@" in key for key in urls)


def sign(secret: bytes, timestamp: str, body: bytes) -> str:
    """The X-Ticketq-Signature of `body` sent at `timestamp`: `sha256=<hex>`."""
    return "sha256=" + hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def pause_bounds(attempts: int, base_s: float, cap_s: float) -> tuple[float, float]:
    """Least and most time, in pauses, between the first and the last of `attempts` POSTs of one result:
    a receiver down for less than the least loses nothing to the dead-letter stream."""
    full = sum(min(cap_s, base_s * 2 ** (attempt - 1)) for attempt in range(1, attempts))
    return full / 2, full


def backoff_s(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Pause before POST number `attempt + 1`: base doubling per attempt, capped; half of it random."""
    pause = min(cap_s, base_s * 2 ** (attempt - 1))
    return pause / 2 + rng.uniform(0, pause / 2)


def dead_letter(entry_id: str, fields: dict, url: str | None, error: str, attempts: int) -> dict:
    """A dead-letter stream entry: the result's entry id, data and epoch, where it went, the last error."""
    return {"entry_id": entry_id, "data": fields.get(b"data", b""), "epoch": fields.get(b"epoch", b""),
            "url": url or "", "error": error, "attempts": attempts}  # fmt: skip


class Dispatcher:
    """The consumer-group loop; `run_forever()` until `stop` is set (SIGTERM and SIGINT set it)."""

    dead_stream = DELIVER_DEAD_STREAM  # where results given up on go (the write-back's has its own)

    def __init__(self, settings: GatewaySettings, metrics: DeliverMetrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or DeliverMetrics.build()
        self.group = settings.deliver_group
        self.consumer = self.consumer_name(settings)
        self.redis = connections.redis_client(settings.broker_url, **settings.sentinel, retries=3)
        self.http = httpx.Client(timeout=settings.deliver_timeout_s)
        self.secret = settings.deliver_secret.get_secret_value().encode() if settings.deliver_secret else None
        self.stop = threading.Event()
        self.rng = random.Random()
        self.pool = ThreadPoolExecutor(settings.deliver_concurrency, thread_name_prefix="deliver")
        self.reader = GroupReader(self.redis, settings, self.metrics, self.consumer)

    @staticmethod
    def consumer_name(settings: GatewaySettings) -> str:
        """TICKETQ_DELIVER_CONSUMER, else the host name: never the pid, so a restart is the same consumer
        and re-reads its own pending entries (two dispatchers on one host each need their own name)."""
        return settings.deliver_consumer or socket.gethostname()

    def run_forever(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop.set())
        if self.settings.deliver_metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.settings.deliver_metrics_port, self.settings.deliver_metrics_host,
                              registry=self.metrics.registry)  # fmt: skip
        log.info("delivering %s (group %s, consumer %s)", RESULTS_STREAM, self.group, self.consumer)
        last_claim = 0.0
        while not self.stop.is_set():
            try:
                self.reader.ensure_group()
                now = time.monotonic()
                batch: list[Entry] = []
                if now - last_claim >= self.settings.deliver_claim_idle_s / 2:
                    batch = self.reader.claim()
                    last_claim = 0.0 if batch else now  # a page re-claimed: look for more at once
                self.deliver(batch or self.reader.read())
            except (redis.exceptions.RedisError, OSError) as exc:
                log.warning("Redis error, asking again in %.0f s: %s", REDIS_PAUSE_S, str(exc).splitlines()[0])
                self.stop.wait(REDIS_PAUSE_S)
        self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()
        connections.close(self.redis)

    def deliver(self, entries: Sequence[Entry]) -> None:
        """POST each entry but an earlier epoch's repeats (TICKETQ_DELIVER_CONCURRENCY at once), acked by its thread."""
        for future in [self.pool.submit(self.deliver_one, *entry) for entry in self.reader.unrepeated(entries)]:
            future.result()

    def deliver_one(self, entry_id: str, fields: dict) -> bool:
        """POST one result until 2xx (acked: True) or TICKETQ_DELIVER_MAX_ATTEMPTS (dead-lettered: False).
        Stopping part way leaves it pending: a later run delivers it."""
        result = codec.loads(fields[b"data"]) if b"data" in fields else None
        url, body = self._url_for(result), self.body(entry_id, result)
        error = NO_URL if url is None else ""
        for attempt in range(1, self.settings.deliver_max_attempts + 1 if url else 0):
            if attempt > 1:
                if self.stop.wait(backoff_s(attempt - 1, self.settings.deliver_backoff_s,
                                            self.settings.deliver_backoff_max_s, self.rng)):  # fmt: skip
                    return False
                self._touch(entry_id)
            error = self._post(url, entry_id, body)
            if not error:
                self.redis.xack(RESULTS_STREAM, self.group, entry_id)
                self.metrics.deliveries.inc()
                return True
        self._dead_letter(entry_id, fields, url, error)
        return False

    # Three hooks of one request (the write-back's consumer overrides them): where, what, and sending it.

    def body(self, delivery_id: str, result: Any) -> bytes:
        """What is POSTed for one result: `{"delivery_id", "tenant", "result", "metadata"}`; the gateway's record
        of the ticket (`keys.TICKET_KEY`) gives the tenant, the id the tenant sent (the result's `id` is shown as
        that) and the metadata. Tickets sent another way: tenant and metadata null."""
        record = self._record(result)
        if "id" in record and isinstance(result, dict):
            result = {**result, "id": record["id"]}
        return json.dumps({"delivery_id": delivery_id, "tenant": record.get("tenant"), "result": result,
                           "metadata": record.get("metadata")}).encode()  # fmt: skip

    def _url_for(self, result: Any) -> str | None:
        """TICKETQ_DELIVER_URLS' `schema@tenant`, then `@tenant`, then `schema`, then TICKETQ_DELIVER_URL."""
        schema = (result.get("schema") if isinstance(result, dict) else None) or ""
        urls = self.settings.deliver_urls
        tenant = self._record(result).get("tenant") if urls_by_tenant(urls) else None  # a GET only when it matters
        if tenant:
            found = urls.get(f"{schema}@{tenant}") if schema else None
            if found or f"@{tenant}" in urls:
                return found or urls[f"@{tenant}"]
        return urls.get(schema, self.settings.deliver_url)

    def _post(self, url: str, entry_id: str, body: bytes) -> str:
        """"" when the receiver answered 2xx, else what went wrong (one line). Signed with the key of the
        tenant the body names (TICKETQ_DELIVER_SECRETS), else TICKETQ_DELIVER_SECRET."""
        stamp = str(int(time.time()))
        headers = {"Content-Type": "application/json", DELIVERY_HEADER: entry_id, TIMESTAMP_HEADER: stamp}
        secret = self._secret_for(json.loads(body).get("tenant") if self.settings.deliver_secrets else None)
        if secret is not None:
            headers[SIGNATURE_HEADER] = sign(secret, stamp, body)
        started = time.perf_counter()
        try:
            response = self.http.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            self.metrics.attempts.labels("error").inc()
            return f"POST {url} failed: {type(exc).__name__}: {exc}"
        finally:
            self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.attempts.labels("ok" if response.is_success else f"http_{response.status_code}").inc()
        return "" if response.is_success else f"POST {url} answered {response.status_code}"

    def post_once(self, delivery_id: str, result: Any) -> str:
        """One POST of a result outside the group (the repair commands): "" when 2xx, else the error."""
        url = self._url_for(result)
        return NO_URL if url is None else self._post(url, delivery_id, self.body(delivery_id, result))

    def _touch(self, entry_id: str) -> None:
        """Claim our own entry again (idle time back to 0), so no other dispatcher re-claims it now."""
        self.redis.xclaim(RESULTS_STREAM, self.group, self.consumer, 0, [entry_id], justid=True)

    def _dead_letter(self, entry_id: str, fields: dict, url: str | None, error: str) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(self.dead_stream, dead_letter(entry_id, fields, url, error, self.settings.deliver_max_attempts),
                  maxlen=self.settings.stream_maxlen, approximate=True)  # fmt: skip
        pipe.xack(RESULTS_STREAM, self.group, entry_id)
        pipe.execute()
        self.metrics.dead.inc()
        log.warning("result %s dead-lettered to %s: %s", entry_id, self.dead_stream, error)

    def _secret_for(self, tenant: str | None) -> bytes | None:
        """The tenant's own key (TICKETQ_DELIVER_SECRETS), else TICKETQ_DELIVER_SECRET."""
        own = self.settings.deliver_secrets.get(tenant or "")
        return own.get_secret_value().encode() if own is not None else self.secret

    def _record(self, result: Any) -> dict:
        """The gateway's record of the ticket ({tenant, id, metadata, ...}); {} for tickets sent another way."""
        if not isinstance(result, dict) or not isinstance(result.get("id"), str):
            return {}
        marker = self.redis.get(TICKET_KEY.format(queue=self.settings.queue, ticket_id=result["id"]))
        return json.loads(marker) if marker else {}
