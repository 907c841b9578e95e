"""The client-side settings (what a producer needs to reach the workers), their one-line errors,
and URL masking.

`ClientSettings` reads `TICKETQ_*`; the worker's `worker.settings.Settings` extends it, so a
producer and a worker given the same environment agree on the broker (a Redis URL, or a Sentinel
list and its master name), the queue, the labels, the ticket size limit and the replica acks.
`from_env` and `with_overrides` turn pydantic's errors into one line per problem
(`TICKETQ_X=value: what is allowed`), with any password masked by `mask_url`.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ticketq.contract import MAX_TICKET_BYTES
from ticketq.errors import TicketqError
from ticketq.names import DEFAULT_LABELS, QUEUE

BROKER_SCHEMES = ("redis", "rediss", "sentinel")
SENTINEL_SCHEME = "sentinel"  # kombu's and Celery's spelling: sentinel://h1:26379;sentinel://h2:26379

S = TypeVar("S", bound="ClientSettings")


class SettingsError(TicketqError, ValueError):
    """Invalid settings; `str()` has one line per problem: `TICKETQ_X=value: what is allowed`."""


# The settings only a worker reads (`worker.settings.Settings` adds them): named here so that a
# producer or an operator command, which never loads them, does not take them for misspellings.
# tests/integration/test_exit_codes.py checks that this is exactly what the worker adds.
WORKER_SETTINGS = frozenset({
    "allow_eviction", "answer_cache_entries", "answer_cache_s", "autotune", "autotune_s", "batch_window",
    "cost_fixed_ms", "cost_quad_ms", "cost_token_ms", "dedup", "device", "dtype", "fetch", "fuse", "head", "lease_s",
    "live_cost", "matmul", "max_batch_size", "max_batch_tokens", "max_retries", "max_ticket_tokens", "max_wait_ms",
    "metrics_host", "metrics_port", "model", "null_classifier", "prefetch_multiplier", "recheck", "schema_cache",
    "schemas", "shadow_rate", "system_prompt", "threads", "truncation", "worst_batch_s",
})  # fmt: skip
# The settings only the HTTP gateway and the results dispatcher read (`gateway.settings`): the
# same reason, the same check (tests/integration/test_exit_codes.py).
GATEWAY_PREFIXES = ("gateway_", "deliver_", "writeback_")


class TicketSettings(BaseModel):
    """What a ticket may be: the closed label set (with optional hints) and the size limit."""

    labels: Annotated[tuple[str, ...], NoDecode] = Field(
        DEFAULT_LABELS, description="Closed label set, comma separated; `name=description` adds a hint."
    )
    max_ticket_bytes: int = Field(
        MAX_TICKET_BYTES, ge=64, description="Raw text above this is rejected (dead-lettered)."
    )

    @field_validator("labels", mode="before")
    @classmethod
    def _split_labels(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",")]
        return value

    @field_validator("labels")
    @classmethod
    def _check_labels(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        names = [label.split("=", 1)[0].strip() for label in value]
        if len(names) < 2:
            raise ValueError("needs at least two labels, comma separated (billing,technical,account)")
        if any(not name for name in names):
            raise ValueError("has an empty label name; labels are comma separated, each non-empty")
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            shown = ", ".join(map(repr, duplicates))
            raise ValueError(f"label {shown} appears more than once; each label must be unique")
        return tuple(label.strip() for label in value)

    @property
    def label_names(self) -> tuple[str, ...]:
        return tuple(label.split("=", 1)[0].strip() for label in self.labels)

    @property
    def label_descriptions(self) -> dict[str, str]:
        return {
            name.strip(): desc.strip()
            for name, _, desc in (label.partition("=") for label in self.labels)
            if desc.strip()
        }


class RedisSettings(BaseModel):
    """Where the Redis is and how its writes are confirmed: the broker (a Redis URL, or a Sentinel
    list and its master's name), the result backend, the replica acks."""

    broker_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Celery broker: redis://, rediss:// (TLS), or Sentinel as sentinel://h1:26379;sentinel://h2:26379 "
        "(with TICKETQ_SENTINEL_MASTER); the results and dead-letter streams live there too.",
    )
    result_backend: str | None = Field(None, description="Celery result backend (default: broker_url).")
    sentinel_master: str | None = Field(
        None,
        description="The master's name the sentinels monitor (`sentinel monitor NAME ...`); sentinel:// URLs need it.",
    )
    sentinel_password: SecretStr | None = Field(
        None,
        description="Password of the sentinels themselves (`requirepass` in sentinel.conf); the master's goes in "
        "the URL.",
    )
    replica_acks: int = Field(
        0,
        ge=0,
        description="Replicas that must hold an enqueued ticket (producer) or a result (worker, before its ack): "
        "WAIT after the write; 0 = off.",
    )
    replica_timeout_s: float = Field(
        1.0, gt=0, description="How long one WAIT waits for TICKETQ_REPLICA_ACKS replicas."
    )

    @field_validator("broker_url")
    @classmethod
    def _check_broker_url(cls, value: str) -> str:
        # ticketq reads and writes Redis streams on the broker itself, so only Redis will do.
        scheme = _url_scheme(value)
        if scheme not in BROKER_SCHEMES:
            raise ValueError(
                "must be a Redis URL: redis://[:password@]host:6379/0, rediss://… (TLS) or "
                "sentinel://host:26379;sentinel://host2:26379, "
                f"not {scheme + '://' if scheme else 'a URL without a scheme'}"
            )
        return with_tls_default(value)

    @field_validator("result_backend")
    @classmethod
    def _check_backend_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from celery.app.backends import BACKEND_ALIASES  # lazy: only this check needs celery

        scheme = _url_scheme(value)
        if scheme.partition("+")[0] not in BACKEND_ALIASES:
            raise ValueError(
                f"must be a Celery result backend URL such as redis://host:6379/0 (unset: the broker), "
                f"not {scheme + '://' if scheme else 'a URL without a scheme'}"
            )
        return with_tls_default(value)

    @model_validator(mode="after")
    def _check_sentinel(self) -> RedisSettings:
        urls = {"TICKETQ_BROKER_URL": self.broker_url, "TICKETQ_RESULT_BACKEND": self.result_backend or ""}
        named = [env for env, url in urls.items() if is_sentinel_url(url)]
        if named and not self.sentinel_master:
            raise ValueError(
                f"{' and '.join(named)} {'name' if len(named) > 1 else 'names'} Redis Sentinel: set "
                "TICKETQ_SENTINEL_MASTER to the master's name the "
                "sentinels monitor (`sentinel monitor NAME host port quorum` in sentinel.conf)"
            )
        return self

    @property
    def sentinel(self) -> dict[str, str | None]:
        """What `ticketq.connections` needs besides a URL to reach a Sentinel-managed master."""
        password = self.sentinel_password.get_secret_value() if self.sentinel_password else None
        return {"master_name": self.sentinel_master, "sentinel_password": password}

    @property
    def backend_url(self) -> str:
        return self.result_backend or self.broker_url


class ClientSettings(RedisSettings, TicketSettings, BaseSettings):
    """What producers and workers share. Every field is `TICKETQ_<FIELD>` in the environment; the
    tickets' and the Redis ones come from `TicketSettings` and `RedisSettings` (listed first)."""

    model_config = SettingsConfigDict(env_prefix="TICKETQ_", extra="ignore", validate_default=True)

    queue: str = Field(QUEUE, description="Celery queue the worker consumes.")
    # A client sets it too: kombu's Redis transport must use the worker's value.
    visibility_timeout_s: int = Field(300, ge=1, description="Redis redelivers unacked messages after this.")
    result_expires_s: int = Field(86400, ge=60, description="How long results stay in the backend.")
    stream_maxlen: int = Field(100_000, ge=100, description="Approximate cap of the results/dead-letter streams.")

    @classmethod
    def from_env(cls: type[S], flags: Mapping[str, str] | None = None, **overrides: Any) -> S:
        """The settings from the environment plus `overrides` (None = not given), or `SettingsError`.

        `flags` names the command-line option behind an override (`{"broker_url": "--broker-url"}`),
        so the message points at what the user typed.
        """
        given = {name: value for name, value in overrides.items() if value is not None}
        try:
            return cls(**given)
        except ValidationError as exc:
            typed = {name: flag for name, flag in (flags or {}).items() if name in given}
            raise SettingsError("\n".join(_describe(error, typed) for error in exc.errors())) from None

    @classmethod
    def unknown_names(cls, environ: Mapping[str, str]) -> list[str]:
        """One line per TICKETQ_* variable in `environ` that is no ticketq setting (neither this
        class's nor a worker's), with the closest setting's name: a misspelt setting would
        otherwise be ignored in silence; and one per `_misnamed` variable. TICKETQ_TEST_* belong to
        the test suite, TICKETQ_GATEWAY_* and TICKETQ_DELIVER_* to the gateway."""
        known = {f"TICKETQ_{name.upper()}" for name in (*cls.model_fields, *WORKER_SETTINGS)}
        lines = []
        for name in sorted(environ):
            others = name.startswith("TICKETQ_TEST_") or name[8:].lower().startswith(GATEWAY_PREFIXES)
            if name.startswith("TICKETQ_") and name not in known and not others:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
                hint = f"did you mean {close[0]}?" if close else "see `ticketq config` for every setting"
                lines.append(f"{name} is not a ticketq setting and is ignored; {hint}")
        return lines + [line for name in sorted(environ) if (line := _misnamed(name, known))]

    def with_overrides(self: S, **overrides: Any) -> S:
        """A copy with `overrides` (None = not given), validated as from the environment, or `SettingsError`
        naming each value as the caller passed it (`broker_url=...`)."""
        given = {name: value for name, value in overrides.items() if value is not None}
        if not given:
            return self
        try:
            return self.model_validate({**dict(self), **given})
        except ValidationError as exc:
            flags = {name: f"{name}=" for name in given}
            raise SettingsError("\n".join(_describe(error, flags) for error in exc.errors())) from None


# scheme://user:PASSWORD@host: the user has no ':', the password runs to the last '@' before the
# next URL (a Sentinel list) or a space, whatever it holds: a '#', '/' or '?' typed unencoded too.
_USERINFO_PASSWORD = re.compile(r"(://[^/?#@:\s]*:)(?:(?!://)\S)*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&\s]*")  # redis-py also takes ?password=


# Celery's own environment variables that a Celery user may expect ticketq to read; it reads its own.
_CELERY_VARIABLES = {"CELERY_BROKER_URL": "TICKETQ_BROKER_URL", "CELERY_RESULT_BACKEND": "TICKETQ_RESULT_BACKEND"}


def _misnamed(name: str, known: set[str]) -> str | None:
    """The notice for `name` when it is a setting in the wrong case (used all the same: the
    environment is read case-insensitively) or a Celery variable ticketq does not read; else None."""
    if name != name.upper() and name.upper() in known:
        return f"{name} is read as {name.upper()} (setting names are upper case); write it {name.upper()}"
    if name in _CELERY_VARIABLES:
        return f"{name} is a Celery variable that ticketq does not read; set {_CELERY_VARIABLES[name]}"
    return None


def mask_url(text: str) -> str:
    """`text` with any URL password replaced by `**`, safe to print and log; nothing else changes.

    Works on any text (a setting's value, a message) and never raises, unlike parsing it as a URL.
    """
    return _QUERY_PASSWORD.sub(r"\1**", _USERINFO_PASSWORD.sub(r"\1**@", text))


def with_tls_default(url: str) -> str:
    """A `rediss://` URL that names no `ssl_cert_reqs` (the bare form managed Redis hands out) with
    `ssl_cert_reqs=CERT_REQUIRED` added: the server's certificate is verified against `ssl_ca_certs`
    when the URL names one, else against the system's CA store. Celery refuses a rediss:// URL
    without the parameter; every other URL is returned as it is."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() != "rediss" or "ssl_cert_reqs=" in rest:
        return url
    return f"{url}{'&' if '?' in rest else '?'}ssl_cert_reqs=CERT_REQUIRED"


def _describe(error: Mapping[str, Any], flags: Mapping[str, str]) -> str:
    """One line for one pydantic error: the setting, the value given, what is allowed."""
    allowed = _allowed(error)
    if not error["loc"]:  # a combination check (model validator): its message names every setting
        return allowed
    name = str(error["loc"][0])
    env = f"TICKETQ_{name.upper()}"
    if name in flags:
        separator = "" if flags[name].endswith("=") else " "
        return f"{flags[name]}{separator}{_shown(error['input'])}: {allowed}"
    raw = os.environ.get(env, error["input"])
    return f"{env}={_shown(raw)}: {allowed}"


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_KINDS = {
    "int_parsing": "must be a whole number", "int_from_float": "must be a whole number",
    "float_parsing": "must be a number", "bool_parsing": "must be true or false (1/0, yes/no, on/off)",
    "string_type": "must be text", "missing": "is required",
}  # fmt: skip


def _allowed(error: Mapping[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {bound}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}"
    if kind in _KINDS:
        return _KINDS[kind]
    return str(error["msg"]).removeprefix("Value error, ").replace("Input should be", "must be")


def _shown(value: object) -> str:
    """The value as typed, with any URL password masked (it ends up in terminals and logs)."""
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return mask_url(text) if text else "''"


def is_redis_url(url: str) -> bool:
    """`url` names a Redis ticketq can use as its broker: redis://, rediss:// or a sentinel:// list."""
    return url.partition("://")[0].lower() in BROKER_SCHEMES


def is_sentinel_url(url: str) -> bool:
    """`url` names Redis Sentinel (`sentinel://h1:26379;sentinel://h2:26379`, as kombu and Celery spell it)."""
    return url.partition("://")[0].lower() == SENTINEL_SCHEME


def _url_scheme(url: str) -> str:
    """The scheme of a URL, or of every part of a `;`-separated Sentinel list (which must all be sentinel://)."""
    if "://" not in url:
        return ""
    if "#" in url:  # urllib would cut the URL there, and name whatever follows in the password as the port
        raise ValueError("has a '#': a password (or anything else) holding '#' must write it %23 "
                         "(percent-encode '@' as %40, '/' as %2F, '?' as %3F, '#' as %23)")  # fmt: skip
    parts = [part for part in url.split(";") if part.strip()] if is_sentinel_url(url) else [url]
    schemes = set()
    for part in parts:
        split = urlsplit(part.strip())
        try:
            split.port  # noqa: B018 -- urllib checks the port only when asked
        except ValueError:
            raise ValueError("the port is not a number (host:6379)") from None
        if len(parts) > 1 and not split.hostname:
            raise ValueError(f"{mask_url(part)!r} names no host: each sentinel is sentinel://host:26379")
        schemes.add(split.scheme.lower())
    if len(schemes) > 1:
        raise ValueError("mixes schemes: a Sentinel list is sentinel://h1:26379;sentinel://h2:26379, nothing else")
    return schemes.pop()
