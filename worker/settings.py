"""The worker's settings: the client settings (ticketq.config) plus the model, engine and queue
service, every one read from `TICKETQ_*`.

Every default lives here or in `ticketq.config.ClientSettings`. Invalid values and invalid
combinations are rejected when the object is built (start-up), with a message that names the
setting.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from ticketq.config import ClientSettings, SettingsError  # noqa: F401 -- what load_settings raises
from ticketq.schema import Schema, SchemaError, load_schema

DEFAULT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
DEFAULT_SYSTEM_PROMPT = (
    "You are a support ticket router. Read the customer's ticket and answer with exactly one "
    "word: the team that should handle it."
)


log = logging.getLogger(__name__)


class ModelSettings(BaseModel):
    """The model a worker serves and the prompt it reads tickets in."""

    model: str = Field(DEFAULT_MODEL, description="Hub id or local directory of the causal LM.")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="auto: cuda, then mps, then cpu."
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads (default: torch's choice).")
    system_prompt: str = Field(
        DEFAULT_SYSTEM_PROMPT, description="System instructions before the label list."
    )
    max_ticket_tokens: int = Field(512, ge=8, description="Longer tickets are truncated and flagged.")
    head: str | None = Field(None, description="A label head fitted by `ticketq fit` (a file): it scores the labels "
                             "from the answer position's hidden state, not the LM head's label rows; refused at "
                             "start-up when fitted for another model or prompt (docs/learning.md).")  # fmt: skip
    truncation: Literal["head", "tail", "head+tail"] = Field(
        "head", description="How a ticket over TICKETQ_MAX_TICKET_TOKENS is cut: keep its start, its end (where a "
        "reply thread puts the newest message) or half of each; a schema may set its own.",
    )
    schemas: str | None = Field(
        None, description="Triage schemas (TOML, see docs/schemas.md): one or more files, "
        "comma-separated, or a directory of *.toml. A ticket names one by its `schema`; one naming none gets the "
        "first. `default` always names the single field of TICKETQ_LABELS, which is what every ticket gets "
        "when this is unset.",
    )
    schema_cache: int = Field(
        8, ge=1, description="Schemas whose prefix KV cache a worker keeps (least recently used dropped first)."
    )

    @field_validator("schemas")
    @classmethod
    def _check_schemas(cls, value: str | None) -> str | None:
        _read_schemas(value)  # every problem of every schema file, one line each
        return value

    def load_schemas(self) -> tuple[Schema, ...]:
        """The schemas TICKETQ_SCHEMAS names, in order (none when unset)."""
        return _read_schemas(self.schemas)


class PrecisionSettings(BaseModel):
    """The precision batches run in, the float32 re-check, and the CPU kernels."""

    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto",
        description="The precision batches run in. auto: the fastest this machine has: bfloat16 on cuda, and on a "
        "CPU with native bf16 where a bf16 GEMM measures >= 1.25x float32's; else int8 (x86 CPUs) where its GEMM "
        "measures >= 1.3x float32's; else float32 (measured at the first start on a machine, cached in "
        "~/.cache/ticketq/kernels). With TICKETQ_RECHECK (the default) a fast precision's labels are float32's; "
        "without it, auto never picks int8. int8: the decoder's linear layers in dynamic int8 (per-channel "
        "weights, the MLP down projection kept float32, 8-bit activations on AVX512-VNNI).",
    )
    recheck: Literal["auto", "always", "never"] = Field(
        "auto",
        description="With a fast precision (bfloat16, float16, int8): compute again in float32 every ticket whose "
        "answer could differ from float32's (a decision gap within the error bound measured at the first start on "
        "a machine, cached in ~/.cache/ticketq/precision), so every label is float32's. auto: only where that "
        "calibration predicts the checked answers >= 1.1x float32's speed, and while the live re-check share keeps "
        "them faster; else float32. always: whatever either predicts. never: the fast precision's answers as they come "
        "(inexact). The float32 copy of the model costs memory (none more for int8). true/false mean auto/never.",
    )
    matmul: Literal["auto", "torch", "onednn"] = Field(
        "auto",
        description="On a CPU: the decoder's linear layers through torch's default GEMM (MKL for float32) or "
        "oneDNN's matmul on weights prepacked at start-up. float32: exact, faster than MKL on some AMD CPUs; auto: "
        "oneDNN where it measures >= 1.15x torch's (measured and cached as for TICKETQ_DTYPE=auto). bfloat16 on a "
        "CPU with native bf16: the same kernel torch runs, the same bits, faster; auto packs there.",
    )
    fuse: bool = Field(
        True,
        description="With the weights prepacked for oneDNN (TICKETQ_MATMUL): run batches through ticketq's own "
        "layer loop, float32 with the MLP's SiLU and product and the residual adds inside oneDNN's GEMMs (the same "
        "arithmetic up to rounding), attention as two float32 matmuls, the last layer for the answer positions "
        "only. Off: transformers' layers.",
    )

    @field_validator("recheck", mode="before")
    @classmethod
    def _recheck_words(cls, value: Any) -> Any:
        """true/false (and 1/0, yes/no, on/off) as a switch is written: auto and never."""
        words = {"true": "auto", "1": "auto", "yes": "auto", "on": "auto",
                 "false": "never", "0": "never", "no": "never", "off": "never"}  # fmt: skip
        if isinstance(value, bool):
            return "auto" if value else "never"
        return words.get(value.strip().lower(), value) if isinstance(value, str) else value


class BatchingSettings(BaseModel):
    """How tickets are planned into forward passes: the budgets, the cost model, duplicates."""

    max_batch_tokens: int = Field(1024, ge=16, description="Padded-token budget of one forward pass.")
    max_batch_size: int = Field(64, ge=1, description="Rows in one forward pass.")
    cost_fixed_ms: float = Field(25.0, ge=0, description="Planner: fixed cost of one forward pass.")
    cost_token_ms: float = Field(0.8, ge=0, description="Planner: cost of one computed token.")
    cost_quad_ms: float = Field(0.0, ge=0, description="Planner: attention term, per row x width^2.")
    autotune: bool = Field(False, description="Measure the planner's cost model on this device at start-up.")
    autotune_s: float = Field(20.0, gt=0, description="Seconds of timed forward passes for autotune.")
    live_cost: bool = Field(
        True, description="Refit the planner's cost model from the forwards the worker serves, and start from the "
        "fit cached for this machine (~/.cache/ticketq/cost) when there is one; off: the TICKETQ_COST_* values.",
    )
    dedup: bool = Field(
        True,
        description="Tickets encoded alike (the same token ids, the same schema) in one run are computed once "
        "and each gets the answer, under its own id.",
    )


class ServiceSettings(BaseModel):
    """The queue service around the engine: buffering, retries, the answer cache, the lease, metrics."""

    batch_window: int = Field(64, ge=1, description="Messages drained into one micro-batch at most.")
    max_wait_ms: int = Field(50, ge=1, description="Wait at most this long after the first buffered message.")
    prefetch_multiplier: int | None = Field(
        None, ge=1, description="Celery prefetch (default: 2 x batch_window so the window can fill)."
    )
    worst_batch_s: float = Field(
        30.0, gt=0, description="Expected worst batch time; visibility must exceed 4x. A worker whose classifying "
        "loop holds work without progress for longer stops renewing its lease (live workers take its messages "
        "over) and is not ready until it moves again.",
    )
    max_retries: int = Field(3, ge=0, le=10, description="Retries of a ticket whose batch failed.")
    shadow_rate: float = Field(0.0, ge=0.0, le=1.0, description="Fraction re-checked on the reference path.")
    null_classifier: bool = Field(False, description="Zero-cost classifier, only to measure queue overhead.")
    answer_cache_s: float = Field(
        0.0, ge=0, description="Keep each computed answer in Redis this many seconds, keyed by a hash of the "
        "ticket's canonical text, its schema and the model as run: a re-sent duplicate is answered from it, not "
        "computed. 0: off.",
    )
    answer_cache_entries: int = Field(
        100_000, ge=1, description="The answer cache's bound: past it the oldest entries are deleted (an entry is a "
        "few hundred bytes, more for a schema's answer).",
    )
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
    allow_eviction: bool = Field(
        False, description="Start on a Redis whose maxmemory-policy evicts keys (it can drop queued tickets, "
        "unacked messages and results without a word); the safe policy is noeviction."
    )

    @property
    def effective_prefetch(self) -> int:
        return self.prefetch_multiplier or 2 * self.batch_window


class Settings(ServiceSettings, BatchingSettings, PrecisionSettings, ModelSettings, ClientSettings):
    """ticketq worker configuration. Every field is `TICKETQ_<FIELD>` in the environment; the
    broker, queue, labels and ticket size limit come from `ClientSettings`, the rest from one group
    per area (bases listed last come first in `ticketq config`). A reader names `settings.<field>`."""

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


def _read_schemas(value: str | None) -> tuple[Schema, ...]:
    """The schema files `value` names (comma-separated files or directories of *.toml), read and
    checked; ValueError with every problem of every file, one line each."""
    if not value:
        return ()
    paths: list[Path] = []
    for part in (part.strip() for part in value.split(",")):
        path = Path(part).expanduser()
        paths += sorted(path.glob("*.toml")) if path.is_dir() else [path] if part else []
    if not paths:
        raise ValueError("names no schema file (*.toml)")
    schemas, problems = [], []
    for path in paths:
        try:
            schemas.append(load_schema(path))
        except SchemaError as exc:
            problems += exc.problems
    names = [schema.name for schema in schemas]
    problems += [f"two schemas are named {name!r}" for name in sorted({n for n in names if names.count(n) > 1})]
    if problems:
        raise ValueError("\n  ".join(problems))
    return tuple(schemas)


def load_settings(flags: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """`Settings()` from the environment plus `overrides` (None = not given), or `SettingsError`
    with one line per problem (see `ClientSettings.from_env`). A TICKETQ_* variable that is no
    setting is warned about once per process, with the closest setting's name."""
    settings = Settings.from_env(flags, **overrides)
    for line in Settings.unknown_names(os.environ):
        if line not in _warned:
            _warned.add(line)
            log.warning("%s", line)
    return settings


_warned: set[str] = set()


# A Hugging Face Hub id: `name` or `org/name`, letters, digits, `-`, `_`, `.`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# How a checkpoint's `architectures` names a decoder-only language model's head class.
_CAUSAL_HEADS = ("ForCausalLM", "LMHeadModel")


def decoder_only_problem(name_or_path: str, config: Mapping) -> str | None:
    """Why the model of `config` (config.json's keys) is not a decoder-only language model (a BERT
    or T5 checkpoint), or None. transformers would load a BERT as `BertLMHeadModel` with fresh
    weights, and the engine, which runs a cached prefix through a decoder, would fail far from the
    cause; this is checked before any weight is read."""
    architectures = [str(name) for name in config.get("architectures") or ()]
    model_type = config.get("model_type", "?")
    causal = any(name.endswith(_CAUSAL_HEADS) for name in architectures) or not architectures
    if causal and not config.get("is_encoder_decoder"):
        return None
    kind = ", ".join(architectures) or str(model_type)
    return (f"TICKETQ_MODEL={name_or_path}: {kind} (model_type {model_type}) is not a decoder-only language "
            "model; ticketq serves causal chat models such as Qwen2, Llama or Mistral (a *ForCausalLM "
            "checkpoint with a chat template)")


def _directory_problem(model: str, path: Path) -> str | None:
    """A model directory whose config.json names no decoder-only language model (read as JSON:
    nothing heavy is imported); a missing or unreadable one is left to the load's own message."""
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return decoder_only_problem(model, config) if isinstance(config, dict) else None


def model_problem(model: str) -> str | None:
    """Why TICKETQ_MODEL cannot be loaded, when that is clear without loading it; else None.

    A value that can only be a path (absolute, `./`, `~`, deeper than `org/name`, or under an
    existing local directory) must exist; anything else is left to the Hub.
    """
    path = Path(model).expanduser()
    if path.exists():
        return _directory_problem(model, path) if path.is_dir() else \
            f"TICKETQ_MODEL={model}: is a file; it must be a model directory or a Hub id"  # fmt: skip
    first = Path(model.split("/", 1)[0]).expanduser()
    if _HUB_ID.match(model) and not (("/" in model) and first.is_dir()):
        return None
    return (f"TICKETQ_MODEL={model}: no such directory; build a stand-in there with "
            f"`ticketq standin --out {model}`, or give a Hugging Face Hub id such as {DEFAULT_MODEL}")
