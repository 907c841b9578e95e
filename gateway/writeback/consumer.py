"""`ticketq-writeback`: every answer to a ticket that came in by a helpdesk's webhook, written back
to that helpdesk's ticket through its REST API (gateway.writeback.adapters), as the config maps it
(gateway.writeback.config).

It is the results dispatcher (gateway.deliver) with another consumer group
(TICKETQ_WRITEBACK_GROUP, default `ticketq-writeback`) and another request: the group's reads,
re-claims and trimmed-range accounting, the retry schedule (TICKETQ_DELIVER_MAX_ATTEMPTS, _BACKOFF_S,
_BACKOFF_MAX_S), the ack after a 2xx and the dead letter after the last attempt are the dispatcher's
own code; the dead letters go to `keys.WRITEBACK_DEAD_STREAM` (`ticketq-writeback dead`). Running
beside `ticketq-deliver`, each result is both delivered and written back.

Which results: only tickets taken by `POST /v1/webhooks/<source>` (their gateway record names the
webhook caller and the helpdesk's ticket id, so a bearer-token caller cannot aim a write at a
helpdesk ticket through metadata), answered `ok`, from a source with a target, with a label the
target maps. Others are acked at once and counted (`ticketq_writeback_skipped_total{reason}`).

Idempotent: the same label is the same request (re-running writes the same state), and a write
whose state was already written to that ticket (`keys.WRITEBACK_WRITTEN_KEY`) is not sent again.
A `429` waits its `Retry-After` (or Intercom's `X-RateLimit-Reset`; at most TICKETQ_DELIVER_BACKOFF_MAX_S)
before the schedule's pause.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway import keys
from gateway.deliver import Dispatcher
from gateway.keys import TICKET_KEY, WRITEBACK_DEAD_STREAM, WRITEBACK_WRITTEN_KEY
from gateway.metrics import LATENCY_BUCKETS, DeliverMetrics
from gateway.writeback import intercom
from gateway.writeback.adapters import Write, headers_for, merge_tags, write_for
from gateway.writeback.config import Target, load_targets
from gateway.writeback.settings import WritebackSettings
from ticketq import codec
from ticketq.names import RESULTS_STREAM

WEBHOOK_CALLER = "webhook:"  # the gateway's caller name of a webhook source (gateway.app post_webhook)


@dataclass
class WritebackMetrics:
    """The dispatcher's series under `ticketq_writeback_*` names, and the results not written back."""

    deliver: DeliverMetrics
    skipped: Counter

    @classmethod
    def build(cls, registry: CollectorRegistry | None = None) -> WritebackMetrics:
        registry = registry if registry is not None else CollectorRegistry()
        deliver = DeliverMetrics(
            registry,
            Counter(keys.WRITEBACK_WRITES, "Labels written back (the helpdesk answered 2xx)", registry=registry),
            Counter(
                keys.WRITEBACK_REQUESTS,
                "Requests to helpdesk APIs, by outcome (ok, http_<status>, error)",
                ["outcome"],
                registry=registry,
            ),
            Counter(
                keys.WRITEBACK_DEAD,
                "Write-backs dead-lettered after TICKETQ_DELIVER_MAX_ATTEMPTS requests",
                registry=registry,
            ),
            Histogram(
                keys.WRITEBACK_SECONDS,
                "Time of one request to a helpdesk API",
                buckets=LATENCY_BUCKETS,
                registry=registry,
            ),
            Counter(
                keys.WRITEBACK_TRIMMED,
                "Results trimmed from the stream before the write-back read them",
                registry=registry,
            ),
            Gauge(
                keys.WRITEBACK_LAG,
                "Results the write-back group has not read yet, plus those pending",
                registry=registry,
            ),
            Counter(
                keys.WRITEBACK_REPEATS,
                "Results not written back: their ticket was read before Redis lost its data",
                registry=registry,
            ),
        )
        skipped = Counter(keys.WRITEBACK_SKIPPED, "Results not written back, by reason (not_webhook, no_target, "
                          "not_ok, no_label, unmapped_label, unchanged)", ["reason"], registry=registry)  # fmt: skip
        return cls(deliver, skipped)


def retry_after_s(value: str | None) -> float:
    """Seconds a `Retry-After` header asks for (a number or an HTTP date); 0 when absent or unreadable."""
    if not value:
        return 0.0
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return 0.0


def rate_limit_wait_s(headers: httpx.Headers) -> float:
    """Seconds a `429` asks to wait: its `Retry-After`, else `X-RateLimit-Reset` (Intercom: the unix time
    its window resets) less now; 0 when neither says."""
    waited = retry_after_s(headers.get("retry-after"))
    reset = headers.get("x-ratelimit-reset")
    if waited or not reset:
        return waited
    try:
        return max(0.0, float(reset) - time.time())
    except ValueError:
        return 0.0


def label_of(result: dict, field: str) -> str | None:
    """The answer's label: `label` of a single-field result, or a schema field's (`fields.<field>.label`)."""
    if field == "label" and isinstance(result.get("label"), str):
        return result["label"]
    answer = (result.get("fields") or {}).get(field)
    return answer.get("label") if isinstance(answer, dict) and isinstance(answer.get("label"), str) else None


class Writeback(Dispatcher):
    """The dispatcher whose request is a helpdesk API write (module docstring)."""

    dead_stream = WRITEBACK_DEAD_STREAM

    def __init__(self, settings: WritebackSettings, metrics: WritebackMetrics | None = None) -> None:
        if not settings.writeback_config:
            raise ValueError("no write-back targets: set TICKETQ_WRITEBACK_CONFIG to a TOML file (docs/helpdesks.md)")
        self.targets = load_targets(settings.writeback_config)
        missing = sorted(set(self.targets) - set(settings.writeback_secrets))
        if missing:
            raise ValueError(f"no API secret for target(s) {', '.join(missing)} in TICKETQ_WRITEBACK_SECRETS")
        self.secrets = {name: secret.get_secret_value() for name, secret in settings.writeback_secrets.items()}
        self.writeback_metrics = metrics or WritebackMetrics.build()
        self.tag_ids: dict[str, dict[str, str]] = {name: {} for name in self.targets}  # Intercom's, by tag name
        super().__init__(settings.for_dispatcher(), self.writeback_metrics.deliver)

    def plan(self, result: Any) -> Write | str:
        """The write of this result, or why there is none (a `skipped` reason)."""
        if not isinstance(result, dict) or not isinstance(result.get("id"), str):
            return "not_webhook"
        marker = self.redis.get(TICKET_KEY.format(queue=self.settings.queue, ticket_id=result["id"]))
        record = json.loads(marker) if marker else {}
        caller, metadata = str(record.get("token") or ""), record.get("metadata") or {}
        if not caller.startswith(WEBHOOK_CALLER) or metadata.get("source_id") is None:
            return "not_webhook"
        target = self.targets.get(caller[len(WEBHOOK_CALLER) :])  # `zendesk`, or `zendesk@acme` for a tenant's
        if target is None:
            return "no_target"
        if result.get("status") != "ok":
            return "not_ok"
        label = label_of(result, target.field)
        if label is None:
            return "no_label"
        return write_for(target, str(metadata["source_id"]), label) or "unmapped_label"

    def deliver_one(self, entry_id: str, fields: dict) -> bool:
        """Write one result back (the dispatcher's retries and dead letter), or ack it as skipped."""
        write = self.plan(codec.loads(fields[b"data"]) if b"data" in fields else None)
        if isinstance(write, Write):
            written = WRITEBACK_WRITTEN_KEY.format(target=write.target, ticket=write.ticket)
            if self.redis.get(written) != write.digest.encode():
                if not super().deliver_one(entry_id, fields):
                    return False
                self.redis.set(written, write.digest, ex=self.settings.result_expires_s)
                return True
            write = "unchanged"
        self.redis.xack(RESULTS_STREAM, self.group, entry_id)
        self.writeback_metrics.skipped.labels(write).inc()
        return True

    # The dispatcher's three hooks of one request: where, what, and sending it.

    def _url_for(self, result: Any) -> str | None:
        write = self.plan(result)
        return write.url if isinstance(write, Write) else None

    def body(self, delivery_id: str, result: Any) -> bytes:
        write = self.plan(result)
        return json.dumps({"target": write.target, "payload": write.payload} if isinstance(write, Write) else {}
                          ).encode()  # fmt: skip

    def _post(self, url: str, entry_id: str, body: bytes) -> str:
        """One write to the helpdesk: "" when 2xx, else what went wrong. Freshdesk's tags are set whole,
        so its ticket's tags are read first and only the labels' own are replaced (`adapters.merge_tags`);
        Intercom's write is a few requests (gateway.writeback.intercom)."""
        planned = json.loads(body)
        target, payload = self.targets[planned["target"]], planned["payload"]
        if target.kind == "intercom":
            request = functools.partial(self._request, entry_id=entry_id, target=target)
            return intercom.write(request, target, url, payload, self.tag_ids[target.name])
        if target.kind == "freshdesk" and "tags" in payload:
            current = self._request("GET", url, None, entry_id=entry_id, target=target)
            if isinstance(current, str):
                return current
            payload["tags"] = merge_tags(target, current.json().get("tags") or [], payload["tags"])
        answered = self._request("PUT", url, payload, entry_id=entry_id, target=target)
        return answered if isinstance(answered, str) else ""

    def _request(self, method: str, url: str, payload: dict | None, *, entry_id: str, target: Target
                 ) -> httpx.Response | str:  # fmt: skip
        """The 2xx response of one request, else what went wrong; a 429 first waits (`rate_limit_wait_s`)."""
        headers = headers_for(target, self.secrets[target.name])
        body = None if payload is None else json.dumps(payload).encode()
        try:
            with self.metrics.latency.time():
                response = self.http.request(method, url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            self.metrics.attempts.labels("error").inc()
            return f"{method} {url} failed: {type(exc).__name__}: {exc}"
        self.metrics.attempts.labels("ok" if response.is_success else f"http_{response.status_code}").inc()
        if response.status_code == 429:
            wait_s = min(rate_limit_wait_s(response.headers), self.settings.deliver_backoff_max_s)
            if wait_s and not self.stop.wait(wait_s):
                self._touch(entry_id)  # its idle time restarts: no other consumer takes a write that waits
        if response.is_success:
            return response
        return f"{method} {url} answered {response.status_code}: {' '.join(response.text[:200].split())}"
