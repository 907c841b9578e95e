"""The benchmark's plain records: its modes, the options of one run, and what each mode answered (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.results import BatchReport, Prediction

MODES = (
    "generate", "sequential", "naive", "naive-global", "sorted", "ticketq", "ticketq-int8", "ticketq-queue",
    "llama-cpp", "llama-cpp-q8",
)  # fmt: skip
OPT_IN_MODES = ("generate", "ticketq-int8", "llama-cpp", "llama-cpp-q8")  # run only when listed (or 'all')
DEFAULT_MODES = tuple(m for m in MODES if m not in OPT_IN_MODES)
REFERENCE = "sequential"  # always runs: the reference for agreement and the baseline for speedup
QUICK = {"tickets": 12, "batch_size": 4, "warmup": 1, "autotune_s": 3.0}  # --quick: a short run on a slow machine
DEFAULTS = {"tickets": 600, "batch_size": 16, "warmup": 4, "autotune_s": 20.0}


@dataclass(frozen=True)
class Options:
    """One run as the command line asked for it, every default resolved (`worker.tools.bench.cli` builds it)."""

    model: str | None = None  # None: the TICKETQ_* settings decide
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None
    tickets: int | None = DEFAULTS["tickets"]  # None with a tickets file: all of its rows
    tickets_file: Path | None = None
    seed: int = 0
    requested_modes: tuple[str, ...] = DEFAULT_MODES
    batch_size: int = DEFAULTS["batch_size"]
    max_batch_tokens: int | None = None
    no_autotune: bool = False
    autotune_s: float = DEFAULTS["autotune_s"]
    warmup: int = DEFAULTS["warmup"]
    tie_tolerance: float = 0.01
    llama_cpp_src: Path | None = None
    quick: bool = False
    strict: bool = False
    json: Path | None = None
    chart: Path | None = None
    markdown: Path | None = None
    command: str = "ticketq bench"  # as typed, for the JSON header and under the Markdown table

    @property
    def mode_list(self) -> list[str]:
        """The modes to run, in their canonical order, the reference always among them."""
        return [m for m in MODES if m in self.requested_modes or m == REFERENCE]


@dataclass(frozen=True)
class Answer:
    """One ticket's answer from any mode; `probs` is None where a mode has none (generate)."""

    label: str
    probs: dict[str, float] | None = None
    new_tokens: int | None = None  # generate only: decode steps actually run

    @classmethod
    def of(cls, prediction: Prediction) -> Answer:
        return cls(prediction.label, dict(prediction.probs))


@dataclass
class ModeResult:
    """One mode's run: its answers in ticket order, its time and forwards, or why it was skipped."""

    mode: str
    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0
    reports: list[BatchReport] = field(default_factory=list)
    padding: tuple[int, int] | None = None  # (pad, computed) where not from `reports` (queue mode)
    forwards: int | None = None
    peak_rss_mb: float | None = None
    rss_of: str = "bench process"
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)
