"""One settings object for the whole service, read from `TICKETQ_*` environment variables.

Every default lives here. Invalid values and invalid combinations are rejected when the object
is built (start-up), with a message that names the setting.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from worker.constants import DEFAULT_LABELS, QUEUE

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="auto: bfloat16 on cuda; on a CPU with native bf16 only where a bf16 GEMM measures "
        ">= 1.25x float32's speed at start-up; else float32.",
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
    broker_url: str = Field("redis://127.0.0.1:6379/0", description="Celery broker (redis://, rediss://).")
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
            raise ValueError("TICKETQ_LABELS needs at least two labels")
        if any(not name for name in names):
            raise ValueError("TICKETQ_LABELS has an empty label name")
        if len(set(names)) != len(names):
            raise ValueError(f"TICKETQ_LABELS has duplicate labels: {names}")
        return tuple(label.strip() for label in value)

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
