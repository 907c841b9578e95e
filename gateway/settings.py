"""The gateway's and the dispatcher's settings: `ClientSettings` (broker, queue, ticket limits,
replica acks) plus the front door's own, all read from `TICKETQ_*`.

Bearer tokens are stored hashed: TICKETQ_GATEWAY_TOKENS is a comma-separated list of
`name:sha256hex` (or bare hex) of each token, as `printf %s TOKEN | sha256sum` prints it; a name
`name@tenant` puts the token in a tenant (`gateway.auth.tenant_of`), one without `@` is in the
tenant `default`. TICKETQ_GATEWAY_ADMIN_TOKENS, in the same form, open /metrics, /docs and
/openapi.json (without one they are off).
Webhook secrets are `source=secret` pairs; the sources' field mappings are built in for
`zendesk` and `intercom` (see `gateway.webhooks`) and may be replaced by a TOML mapping file.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from gateway.auth import DEFAULT_TENANT, TENANT_NAME, tenant_of
from gateway.review.settings import ReviewSettings
from ticketq.config import ClientSettings

SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def _pairs(value: object, sep: str) -> object:
    """`a<sep>b,c<sep>d` from the environment as a dict; a dict passes through."""
    if not isinstance(value, str):
        return value
    pairs = {}
    for part in filter(None, (item.strip() for item in value.split(","))):
        key, found, rest = part.partition(sep)
        if not found:
            key, rest = "", key  # a bare value: unnamed
        pairs[key.strip() or f"token{len(pairs) + 1}"] = rest.strip()
    return pairs


def _check_tenants(named: dict) -> dict:
    """`named` (keys `name` or `name@tenant`) unchanged, or ValueError naming the bad tenant names."""
    bad = sorted({tenant for tenant in map(tenant_of, named) if not TENANT_NAME.fullmatch(tenant)})
    if bad:
        raise ValueError(f"tenant name(s) {', '.join(map(repr, bad))} are not 1-64 of A-Z a-z 0-9 _ -")
    return named


class GatewaySettings(ClientSettings, ReviewSettings):
    """`ticketq-gateway` and `ticketq-deliver`: every field is `TICKETQ_<FIELD>` in the environment."""

    gateway_host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    gateway_port: int = Field(8080, ge=1, le=65535, description="Port the gateway listens on.")
    gateway_tokens: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Bearer tokens, hashed: comma-separated `name:sha256hex` (`printf %s TOKEN | sha256sum`); "
        "`name@tenant:sha256hex` puts a token in a tenant (default: the tenant `default`).",
    )
    gateway_admin_tokens: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Tokens of /metrics, /docs and /openapi.json, hashed like TICKETQ_GATEWAY_TOKENS; "
        "none: those are off (404).",
    )
    gateway_anonymous: bool = Field(
        False, description="Accept POST/GET without a token (only behind an ingress that authenticates)."
    )
    gateway_rate: float = Field(200.0, gt=0, description="Requests per second each token may make (token bucket).")
    gateway_burst: int = Field(400, ge=1, description="Requests a token may make at once (bucket size).")
    gateway_max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Request bodies above this are refused with 413."
    )
    gateway_max_tickets: int = Field(1000, ge=1, description="Tickets one POST may carry.")
    gateway_max_queue_depth: int = Field(
        100_000, ge=1, description="A POST whose new tickets would take the queue past this many waiting tickets "
        "(another producer's message counted as one) is answered 429 with Retry-After."
    )
    gateway_retry_after_s: int = Field(5, ge=1, description="Retry-After of a 429/503 for a full queue or Redis.")
    gateway_idempotency_ttl_s: int = Field(86400, ge=60, description="How long an Idempotency-Key is remembered.")
    gateway_send_retry_s: float = Field(
        2.0, ge=0, description="How long one POST rides out a Redis that went away before answering 503."
    )
    gateway_max_header_bytes: int = Field(
        16_384, ge=1024, description="A request whose head (request line and headers) is above this is refused (h11)."
    )
    gateway_header_timeout_s: float = Field(
        10.0, gt=0, description="A request's head not complete this long after the connection opened "
        "(or the previous response) closes the connection.",
    )
    gateway_keep_alive_s: float = Field(5.0, gt=0, description="An idle keep-alive connection is closed after this.")
    gateway_body_timeout_s: float = Field(
        30.0, gt=0, description="A request body not fully received this long after its headers is answered 408."
    )
    gateway_max_connections: int = Field(
        1000, ge=1, description="Connections and requests served at once; above it a request is answered 503 "
        "`too_many_connections` with Retry-After."
    )
    gateway_schemas: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Schema names a ticket may name (the workers' TICKETQ_SCHEMAS); empty: any."
    )
    gateway_webhook_secrets: Annotated[dict[str, SecretStr], NoDecode] = Field(
        default_factory=dict, description="Webhook sources and their shared secrets: `zendesk=SECRET,intercom=SECRET`; "
        "`zendesk@tenant=SECRET` is a tenant's own (POST /v1/webhooks/zendesk@tenant).",
    )
    gateway_webhook_mapping: str | None = Field(
        None, description="TOML file of webhook sources (signature kind, JSON paths of id, subject, body)."
    )
    gateway_webhook_window_s: int = Field(
        300, ge=1, description="A signed webhook whose timestamp is further from now than this is refused."
    )
    deliver_url: str | None = Field(None, description="Where ticketq-deliver POSTs each result.")
    deliver_urls: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict, description="Per-schema and per-tenant delivery URLs: `schema=url`, `@tenant=url`, "
        "`schema@tenant=url`, comma-separated (default: TICKETQ_DELIVER_URL).",
    )
    deliver_secret: SecretStr | None = Field(None, description="HMAC-SHA256 key of the X-Ticketq-Signature header.")
    deliver_secrets: Annotated[dict[str, SecretStr], NoDecode] = Field(
        default_factory=dict, description="Per-tenant signing keys: `@tenant=SECRET,...` "
        "(default: TICKETQ_DELIVER_SECRET).",
    )
    deliver_group: str = Field("ticketq-deliver", description="Consumer group on the results stream.")
    deliver_consumer: str | None = Field(
        None, description="This dispatcher's consumer name, the same across restarts (default: the host name)."
    )
    deliver_max_attempts: int = Field(
        30, ge=1, description="POSTs of one result before it is dead-lettered (defaults ride out 11+ minutes)."
    )
    deliver_backoff_s: float = Field(0.5, gt=0, description="First pause after a failed POST; doubles per attempt.")
    deliver_backoff_max_s: float = Field(60.0, gt=0, description="Longest pause between POSTs of one result.")
    deliver_timeout_s: float = Field(10.0, gt=0, description="Timeout of one POST to the receiver.")
    deliver_claim_idle_s: float = Field(
        120.0, gt=0, description="Pending results unacked this long are re-claimed (a dispatcher that died)."
    )
    deliver_concurrency: int = Field(8, ge=1, description="Results POSTed at once.")
    deliver_metrics_port: int = Field(9108, ge=0, le=65535, description="Port of the dispatcher's /metrics; 0: off.")
    deliver_metrics_host: str = Field(
        "127.0.0.1", description="Address the dispatcher's /metrics listens on (0.0.0.0 where Prometheus scrapes it "
        "from another host or container).",
    )

    @field_validator("gateway_tokens", "gateway_admin_tokens", mode="before")
    @classmethod
    def _split_tokens(cls, value: object) -> object:
        return _pairs(value, ":")

    @field_validator("deliver_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: object) -> object:
        return _pairs(value, "=")

    @field_validator("gateway_webhook_secrets", "deliver_secrets", mode="before")
    @classmethod
    def _split_secrets(cls, value: object) -> object:
        return _pairs(value, "=")

    @field_validator("gateway_schemas", mode="before")
    @classmethod
    def _split_schemas(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("gateway_tokens", "gateway_admin_tokens")
    @classmethod
    def _check_hashes(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [name for name, digest in value.items() if not SHA256_HEX.fullmatch(digest.lower())]
        if bad:
            raise ValueError(f"token(s) {', '.join(bad)} are not sha256 hex digests (printf %s TOKEN | sha256sum)")
        return {name: digest.lower() for name, digest in _check_tenants(value).items()}

    @field_validator("gateway_webhook_secrets", "deliver_urls")
    @classmethod
    def _check_source_tenants(cls, value: dict) -> dict:
        return _check_tenants(value)

    @field_validator("deliver_secrets")
    @classmethod
    def _check_deliver_secrets(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        """Keys `@tenant` (as in TICKETQ_DELIVER_URLS) or a bare tenant name: stored by tenant name."""
        return {tenant_of(f"@{name.lstrip('@')}"): secret for name, secret in _check_tenants(
            {f"@{name.lstrip('@')}": secret for name, secret in value.items()}).items()}  # fmt: skip

    @property
    def multi_tenant(self) -> bool:
        """True when a token or webhook source names a tenant other than `default`: then every tenant's ticket ids are
        sent as `tenant:id` (see `gateway.intake`); with one tenant they are sent as given."""
        names = (*self.gateway_tokens, *self.gateway_webhook_secrets)
        return any(tenant_of(name) != DEFAULT_TENANT for name in names)

    @model_validator(mode="after")
    def _check_claim_idle(self) -> GatewaySettings:
        # An entry in work is touched before each retry; it must not look abandoned in between.
        least = self.deliver_timeout_s + self.deliver_backoff_max_s
        if self.deliver_claim_idle_s <= least:
            raise ValueError(f"TICKETQ_DELIVER_CLAIM_IDLE_S={self.deliver_claim_idle_s:g} must exceed "
                             f"TICKETQ_DELIVER_TIMEOUT_S + TICKETQ_DELIVER_BACKOFF_MAX_S = {least:g}: otherwise a "
                             "result still being retried is re-claimed and POSTed twice at once")  # fmt: skip
        return self
