"""One settings object for the whole service, read from `TICKETQ_*` environment variables.

Every default lives here. Invalid values and invalid combinations are rejected when the object
is built (start-up), with a message that names the setting.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from worker.constants import DEFAULT_LABELS, QUEUE

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
BROKER_SCHEMES = ("redis", "rediss")
DEFAULT_SYSTEM_PROMPT = (
    "You are a support ticket router. Read the customer's ticket and answer with exactly one "
    "word: the team that should handle it."
)


class Settings(BaseSettings):
    """ticketq configuration. Every field is `TICKETQ_<FIELD>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="TICKETQ_", extra="ignore", validate_default=True)

    # --- model and engine ---
    model: str = Field(DEFAULT_MODEL, description="Hub id or local directory of the causal LM.")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="auto: cuda, then mps, then cpu."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto",
        description="auto: bfloat16 on cuda; on a CPU with native bf16 only where a bf16 GEMM measures "
        ">= 1.25x float32's speed at start-up; else float32. int8 (CPU, opt-in, inexact): the batched "
        "path's decoder linear layers in dynamic int8; the reference and shadow checks stay float32.",
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice).")
    labels: Annotated[tuple[str, ...], NoDecode] = Field(
        DEFAULT_LABELS, description="Closed label set, comma separated; `name=description` adds a hint."
    )
    system_prompt: str = Field(
        DEFAULT_SYSTEM_PROMPT, description="System instructions before the label list."
    )
    max_ticket_tokens: int = Field(512, ge=8, description="Longer tickets are truncated and flagged.")
    max_ticket_bytes: int = Field(
        65536, ge=64, description="Raw text above this is rejected (dead-lettered)."
    )
    max_batch_tokens: int = Field(1024, ge=16, description="Padded-token budget of one forward pass.")
    max_batch_size: int = Field(64, ge=1, description="Rows in one forward pass.")
    cost_fixed_ms: float = Field(25.0, ge=0, description="Planner: fixed cost of one forward pass.")
    cost_token_ms: float = Field(0.8, ge=0, description="Planner: cost of one computed token.")
    cost_quad_ms: float = Field(0.0, ge=0, description="Planner: attention term, per row x width^2.")
    autotune: bool = Field(False, description="Measure the planner's cost model on this device at start-up.")
    autotune_s: float = Field(20.0, gt=0, description="Seconds of timed forward passes for autotune.")

    # --- queue service ---
    broker_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Celery broker: redis:// or rediss:// (TLS); the results and dead-letter streams live there too.",
    )
    result_backend: str | None = Field(None, description="Celery result backend (default: broker_url).")
    queue: str = Field(QUEUE, description="Celery queue the worker consumes.")
    batch_window: int = Field(64, ge=1, description="Messages drained into one micro-batch at most.")
    max_wait_ms: int = Field(50, ge=1, description="Wait at most this long after the first buffered message.")
    prefetch_multiplier: int | None = Field(
        None, ge=1, description="Celery prefetch (default: 2 x batch_window so the window can fill)."
    )
    visibility_timeout_s: int = Field(300, ge=1, description="Redis redelivers unacked messages after this.")
    worst_batch_s: float = Field(
        30.0, gt=0, description="Expected worst batch time; visibility must exceed 4x."
    )
    result_expires_s: int = Field(86400, ge=60, description="How long results stay in the backend.")
    stream_maxlen: int = Field(
        100_000, ge=100, description="Approximate cap of the results/dead-letter streams."
    )
    max_retries: int = Field(3, ge=0, le=10, description="Retries of a ticket whose batch failed.")
    shadow_rate: float = Field(0.0, ge=0.0, le=1.0, description="Fraction re-checked on the reference path.")
    null_classifier: bool = Field(False, description="Zero-cost classifier, only to measure queue overhead.")
    metrics_host: str = Field("127.0.0.1", description="Prometheus exporter bind address.")
    metrics_port: int = Field(9808, ge=0, le=65535, description="Prometheus exporter port (0 = disabled).")
    fetch: Literal["atomic", "kombu"] = Field(
        "atomic",
        description="atomic: pop and record in one Redis step (BLMOVE, Redis >= 6.2), a dead worker's "
        "messages recovered after TICKETQ_LEASE_S; kombu: stock BRPOP (can lose a message on kill -9).",
    )
    lease_s: float = Field(
        10.0, ge=1, description="A worker silent this long is dead: live workers requeue its messages."
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

    @field_validator("broker_url")
    @classmethod
    def _check_broker_url(cls, value: str) -> str:
        # ticketq reads and writes Redis streams on the broker itself, so only Redis will do.
        scheme = _url_scheme(value)
        if scheme not in BROKER_SCHEMES:
            raise ValueError(f"must be a Redis URL: redis://[:password@]host:6379/0 or rediss://… (TLS), "
                             f"not {scheme + '://' if scheme else 'a URL without a scheme'}")
        return value

    @field_validator("result_backend")
    @classmethod
    def _check_backend_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from celery.app.backends import BACKEND_ALIASES  # lazy: only this check needs celery

        scheme = _url_scheme(value)
        if scheme.partition("+")[0] not in BACKEND_ALIASES:
            raise ValueError(f"must be a Celery result backend URL such as redis://host:6379/0 (unset: the broker), "
                             f"not {scheme + '://' if scheme else 'a URL without a scheme'}")
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> Settings:
        if self.max_batch_tokens < self.max_ticket_tokens:
            raise ValueError(
                f"TICKETQ_MAX_BATCH_TOKENS ({self.max_batch_tokens}) must be >= TICKETQ_MAX_TICKET_TOKENS "
                f"({self.max_ticket_tokens}) plus the prompt suffix, or a long ticket fits no batch"
            )
        if self.prefetch_multiplier is not None and self.prefetch_multiplier < self.batch_window:
            raise ValueError(
                f"TICKETQ_PREFETCH_MULTIPLIER ({self.prefetch_multiplier}) is below TICKETQ_BATCH_WINDOW "
                f"({self.batch_window}): the worker could never buffer a full window"
            )
        if self.visibility_timeout_s < 4 * self.worst_batch_s:
            raise ValueError(
                f"TICKETQ_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}) must be at least 4x "
                f"TICKETQ_WORST_BATCH_S ({self.worst_batch_s}); otherwise Redis redelivers tickets "
                "that are still being classified"
            )
        return self

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

    @property
    def backend_url(self) -> str:
        return self.result_backend or self.broker_url

    @property
    def effective_prefetch(self) -> int:
        return self.prefetch_multiplier or 2 * self.batch_window


class SettingsError(ValueError):
    """Invalid settings; `str()` has one line per problem: `TICKETQ_X=value: what is allowed`."""


def load_settings(flags: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """`Settings()` from the environment plus `overrides` (None = not given), or `SettingsError`.

    `flags` names the command-line option behind an override (`{"dtype": "--dtype"}`), so the
    message points at what the user typed.
    """
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        lines = [_describe(error, {name: flag for name, flag in (flags or {}).items() if name in given})
                 for error in exc.errors()]  # fmt: skip
        raise SettingsError("\n".join(lines)) from None


def _describe(error: Mapping[str, Any], flags: Mapping[str, str]) -> str:
    """One line for one pydantic error: the setting, the value given, what is allowed."""
    allowed = _allowed(error)
    if not error["loc"]:  # a combination check (model validator): its message names every setting
        return allowed
    name = str(error["loc"][0])
    env = f"TICKETQ_{name.upper()}"
    if name in flags:
        return f"{flags[name]} {_shown(error['input'])}: {allowed}"
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


_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@")  # the password of scheme://user:password@host


def _shown(value: object) -> str:
    """The value as typed, with any URL password masked (it ends up in terminals and logs)."""
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return _PASSWORD.sub(r"\1**@", text) if text else "''"


def _url_scheme(url: str) -> str:
    if "://" not in url:
        return ""
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 -- urllib checks the port only when asked
    except ValueError:
        raise ValueError("the port is not a number (host:6379)") from None
    return parts.scheme


# A Hugging Face Hub id: `name` or `org/name`, letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def model_problem(model: str) -> str | None:
    """Why TICKETQ_MODEL cannot be loaded, when that is clear without loading it; else None.

    A value that can only be a path (absolute, `./`, `~`, deeper than `org/name`, or under an
    existing local directory) must exist; anything else is left to the Hub.
    """
    path = Path(model).expanduser()
    if path.exists():
        return None if path.is_dir() else f"TICKETQ_MODEL={model}: is a file; it must be a model directory or a Hub id"
    first = Path(model.split("/", 1)[0]).expanduser()
    if _HUB_ID.match(model) and not (("/" in model) and first.is_dir()):
        return None
    return (f"TICKETQ_MODEL={model}: no such directory; build a stand-in there with "
            f"`ticketq standin --out {model}`, or give a Hugging Face Hub id such as {DEFAULT_MODEL}")
