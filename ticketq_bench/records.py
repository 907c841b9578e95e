"""The benchmark's plain records: its modes, the options of one run, what each mode answered, and
`Bench`, what every mode reads (the loaded engine, its settings, the options; no torch)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from worker.results import BatchReport, Prediction

# a schema's fields (ticketq_bench.multifield): one field, every field in one pass, a full prompt per field
FIELD_MODES = ("one-field", "fields", "full-prompts")
# one worker serving one schema, and three at once (ticketq_bench.multifield)
SCHEMA_MODES = ("one-schema", "schemas")
MODES = (
    "generate", "sequential", "naive", "naive-global", "sorted", "ticketq", "ticketq-checked", "ticketq-bf16",
    "ticketq-int8", "ticketq-nodedup", "ticketq-queue",
    "llama-cpp", "llama-cpp-q8", "openvino", "openvino-bf16", "openvino-int8", *FIELD_MODES, *SCHEMA_MODES,
)  # fmt: skip
# each runs in a process of its own (ticketq_bench.peer_process)
PEER_MODES = ("llama-cpp", "llama-cpp-q8", "openvino", "openvino-bf16", "openvino-int8")
OPT_IN_MODES = ("generate", "ticketq-bf16", "ticketq-int8", "ticketq-nodedup", *PEER_MODES, *FIELD_MODES,
                *SCHEMA_MODES)  # fmt: skip  # run only when listed (or 'all')
DEFAULT_MODES = tuple(m for m in MODES if m not in OPT_IN_MODES)
REFERENCE = "sequential"  # the single-field modes' reference for agreement and baseline for speedup


def baseline_of(mode: str) -> str:
    """The mode a mode's speedup is over, which runs whenever it does: `sequential` for the
    single-field modes, `one-field` for the multi-field ones, `one-schema` for `schemas`."""
    return "one-field" if mode in FIELD_MODES else "one-schema" if mode in SCHEMA_MODES else REFERENCE
# --quick: a short run on a slow machine. rounds: how often every mode runs, interleaved (one round
# where only the reference runs).
QUICK = {"tickets": 12, "batch_size": 4, "warmup": 1, "autotune_s": 3.0, "rounds": 1}
DEFAULTS = {"tickets": 600, "batch_size": 16, "warmup": 4, "autotune_s": 20.0, "rounds": 3}


@dataclass(frozen=True)
class Options:
    """One run as the command line asked for it, every default resolved (`ticketq_bench.cli` builds it)."""

    model: str | None = None  # None: the TICKETQ_* settings decide
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None
    tickets: int | None = DEFAULTS["tickets"]  # None with a tickets file: all of its rows
    tickets_file: Path | None = None
    seed: int = 0
    duplicates: float = 0.0  # the share of tickets that repeat another ticket's text exactly
    requested_modes: tuple[str, ...] = DEFAULT_MODES
    batch_size: int = DEFAULTS["batch_size"]
    max_batch_tokens: int | None = None
    no_autotune: bool = False
    autotune_s: float = DEFAULTS["autotune_s"]
    warmup: int = DEFAULTS["warmup"]
    rounds: int = 1
    tie_tolerance: float = 0.01
    schema: Path | None = None  # the multi-field and schemas modes' schema (TOML)
    reference_tickets: int = 20  # tickets those modes are checked on against their per-field reference
    llama_cpp_src: Path | None = None
    quick: bool = False
    strict: bool = False
    json: Path | None = None
    chart: Path | None = None
    markdown: Path | None = None
    command: str = "ticketq bench"  # as typed, for the JSON header and under the Markdown table

    @property
    def mode_list(self) -> list[str]:
        """The modes to run, in their canonical order, each one's baseline among them."""
        wanted = {*self.requested_modes, *map(baseline_of, self.requested_modes)}
        return [m for m in MODES if m in wanted]


@dataclass(frozen=True)
class Answer:
    """One ticket's answer from any mode; `probs` is None where a mode has none (generate)."""

    label: str
    probs: dict[str, float] | None = None
    new_tokens: int | None = None  # generate only: decode steps actually run
    rechecked: bool = False  # a fast precision's answer computed again in float32 (ticketq-checked)

    @classmethod
    def of(cls, prediction: Prediction) -> Answer:
        return cls(prediction.label, dict(prediction.probs), rechecked=prediction.rechecked)


@dataclass
class ModeResult:
    """One mode's run: its first round's answers in ticket order, every round's time, or why it did not run.

    `answers`, `reports`, `padding` and `forwards` are the first round's; `round_seconds` and
    `round_loads` hold one entry per finished round; `seconds` is their median.
    `changed_tickets` are those whose label in a later round differs from the first round's.
    """

    mode: str
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0
    reports: list[BatchReport] = field(default_factory=list)
    padding: tuple[int, int] | None = None  # (pad, computed) where not from `reports` (queue mode)
    forwards: int | None = None
    peak_rss_mb: float | None = None
    rss_of: str = "bench process"
    skipped: str | None = None  # never ran: the reason
    crashed: str | None = None  # its process died (a peer) or it failed: the reason, rounds so far kept
    notes: list[str] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    round_loads: list[tuple[float, float, float] | None] = field(default_factory=list)  # os.getloadavg() at start
    changed_tickets: set[int] = field(default_factory=set)  # indices whose label changed in some round
    round_max_abs_prob_diff: float | None = None
    # a mode checked against a reference of its own (the multi-field ones, on the first tickets):
    # agreement, max_abs_prob_diff, near_ties, disagreements (as `report.compare`), answers compared
    reference_check: dict | None = None
    figures: dict = field(default_factory=dict)  # the mode's own figures, added to its row (schema, prefixes)

    @property
    def round_label_changes(self) -> int:
        return len(self.changed_tickets)

    def add_round(self, answers: list[Answer], seconds: float, load: tuple[float, float, float] | None) -> None:
        """Record one more round: the first keeps its answers, later ones are checked against them."""
        if not self.round_seconds:
            self.answers = answers
        else:
            self.changed_tickets |= {
                i for i, (a, b) in enumerate(zip(self.answers, answers, strict=True)) if a.label != b.label
            }
            diffs = [
                abs(a.probs[k] - b.probs[k])
                for a, b in zip(self.answers, answers, strict=True)
                if a.probs is not None and b.probs is not None
                for k in a.probs
            ]
            if diffs:
                self.round_max_abs_prob_diff = max(self.round_max_abs_prob_diff or 0.0, *diffs)
        self.round_seconds.append(seconds)
        self.round_loads.append(load)
        self.seconds = statistics.median(self.round_seconds)


Load = tuple[float, float, float] | None  # os.getloadavg() where the platform has it


@dataclass
class Bench:
    """What every mode shares: the loaded engine, its settings, the options."""

    engine: object  # worker.engine.Engine (imported lazily: `--help` must not import torch)
    settings: object  # worker.settings.Settings
    options: Options
    tuning: object | None = None  # worker.engine.autotune.Tuning
    int8_engine: object | None = None  # built on first use by ticketq-int8, sharing the model
    fast_engines: dict = field(default_factory=dict)  # mode -> its engine (ticketq-checked, ticketq-bf16), built once
    nodedup_engine: object | None = None  # ticketq-nodedup's: the engine's sibling with dedup off, built once
    schema: object | None = None  # ticketq.schema.Schema of the multi-field and schemas modes (--schema)
    int8_tuning: object | None = None
    load_before: Load = None  # os.getloadavg() when the modes start
    round_loads: list[Load] = field(default_factory=list)  # os.getloadavg() at the start of each round
    ticket_lengths: list[int] = field(default_factory=list)  # ticket tokens per ticket, for the header
