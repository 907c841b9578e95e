"""The bench's mode runs: each mode across the rounds, in this process or beside it.

`ModeRun` is one mode: `start` on its first round, `round` each round, `close` at the end.
`InProcessRun` times the baselines (`ticketq_bench.baselines`) and the engine as served (`ticketq`,
`ticketq-int8`) in this process; `PeerRun` runs a peer (llama.cpp: `ticketq_bench.llama_cpp_peer`;
OpenVINO: `ticketq_bench.peers`) in a process of its own (`ticketq_bench.peer_process`) so that a
crash there is that mode's row. The queue mode (`ticketq_bench.queue_mode`) and the schema modes
(`ticketq_bench.multifield`) build on these.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from rich.console import Console
from tqdm import tqdm

from ticketq_bench import baselines
from ticketq_bench.ceiling import linear_ceiling
from ticketq_bench.checked import describe_fast, recheck_figures
from ticketq_bench.memory import peak_rss_mb, reset_peak_rss
from ticketq_bench.procs import ROOT
from ticketq_bench.records import Answer, Bench, Load, ModeResult
from worker.engine.kernels import int8_available, resolve_precision
from worker.engine.replicas import check_with, sibling, with_int8, with_precision
from worker.results import BatchReport

# (bench, texts, progress bar or None) -> (answers in ticket order, one report per forward)
Runner = Callable[[Bench, list[str], tqdm | None], tuple[list[Answer], list[BatchReport]]]


@dataclass
class RunContext:
    """What every mode's run reads: the bench, the tickets (texts and the engine's token ids), the warm-up."""

    bench: Bench
    tickets: list[dict]
    texts: list[str]
    encoded: list  # EncodedTicket per ticket
    warm: list[int]  # indices of the warm-up tickets
    console: Console

    @property
    def warm_texts(self) -> list[str]:
        return [self.texts[i] for i in self.warm]


class ModeRun(ABC):
    """One mode across the rounds: `start` on its first round, `run_round` each round, `close` at the end."""

    def __init__(self, context: RunContext, mode: str) -> None:
        self.context = context
        self.result = ModeResult(mode)
        self.started = False

    def run_round(self, number: int, load: Load) -> None:
        if not self.started:
            self.started = True
            self.start()
            if self.result.skipped or self.result.crashed:
                return
        self.round(number, load)

    def start(self) -> None:
        """Set up what the rounds share; set `result.skipped` (or `crashed`) where the mode cannot run."""
        return  # a hook: nothing to do unless a mode needs it

    @abstractmethod
    def round(self, number: int, load: Load) -> None:
        """Time one round of the mode into `result` (each subclass runs its own kind of mode)."""

    def close(self) -> None:
        """Release what `start` set up."""
        return  # a hook: nothing to do unless a mode needs it

    def crash(self, reason: str, number: int) -> None:
        """The mode died in round `number`: the reason is its row's, the rounds before it are kept."""
        self.result.crashed = reason
        done = len(self.result.round_seconds)
        where = f"in round {number}" if number else "while starting"
        kept = f"figures from the {done} round{'s' * (done != 1)} before" if done else "no round finished"
        self.result.notes.append(f"{self.result.mode} {reason} {where} ({kept})")


class InProcessRun(ModeRun):
    """A mode in this process: a warm-up, then every ticket timed under a progress bar, then peak RSS."""

    def start(self) -> None:
        bench, console, mode = self.context.bench, self.context.console, self.result.mode
        if mode == "ticketq-int8" and (reason := prepare_int8(bench, console)):
            self.result.skipped = reason
        if mode == "ticketq-nodedup":
            prepare_nodedup(bench)
        if mode in FAST_MODES and (reason := prepare_fast(bench, mode, console)):
            self.result.skipped = reason
        elif mode in FAST_MODES:
            self.result.notes.append(describe_fast(mode, bench.fast_engines[mode]))

    def round(self, number: int, load: Load) -> None:
        bench, result = self.context.bench, self.result
        runner = RUNNERS[result.mode]
        (answers, reports), seconds = self.timed(lambda texts, bar: runner(bench, texts, bar))
        if number == 1:
            result.reports = reports
            if result.mode == "generate":
                result.notes += baselines.generate_notes(answers, bench.engine.info.standin)
        result.add_round(answers, seconds, load)
        if result.mode in ("ticketq", "ticketq-int8") and reports:
            self.ceiling(bench.int8_engine if result.mode == "ticketq-int8" else bench.engine, reports, seconds)
        if result.mode == "ticketq-checked":
            self.rechecks(bench.fast_engines[result.mode], answers, reports)
        if result.mode.startswith("ticketq") and answers:  # rows computed: what dedup and re-checks change
            result.figures.setdefault("computed_tickets", []).append(sum(r.rows for r in reports))
        if number == 1 and result.mode in ("ticketq", "ticketq-nodedup"):  # compared ticket for ticket
            result.figures["labels"] = [a.label for a in answers]

    def rechecks(self, engine, answers: list[Answer], reports: list[BatchReport]) -> None:
        """The round's re-check share and the bound it was cut at (the report's notes read them from the row)."""
        recheck_figures(self.result.figures, engine, answers, reports)

    def ceiling(self, engine, reports: list[BatchReport], seconds: float) -> None:
        """The round's tokens/s against its linear layers' ceiling at its mean forward (see `ceiling`)."""
        computed = sum(r.rows * r.width for r in reports)
        entry = self.result.figures.setdefault(
            "linear_ceiling", {"rows": max(1, round(computed / len(reports))), "tokens_per_s": [], "share": []}
        )
        tokens_per_s = linear_ceiling(engine, entry["rows"])
        if tokens_per_s is None:
            return
        entry["tokens_per_s"].append(tokens_per_s)
        entry["share"].append(computed / seconds / tokens_per_s)  # the report's notes read it from the row

    def timed(self, runner: Callable[[list[str], tqdm | None], object]) -> tuple[object, float]:
        """`runner(texts, bar)` on the warm-up tickets, then timed on every ticket (peak RSS read):
        what it returned, and the seconds it took."""
        texts, result = self.context.texts, self.result
        if self.context.warm:
            runner(self.context.warm_texts, None)
        fresh_peak = reset_peak_rss()
        with tqdm(total=len(texts), desc=result.mode, unit="ticket") as bar:
            start = time.perf_counter()
            done = runner(texts, bar)
            seconds = time.perf_counter() - start
        result.peak_rss_mb = _max(result.peak_rss_mb, peak_rss_mb("self"))
        if not fresh_peak:
            result.rss_of = "bench process, peak so far"
        return done, seconds


def _max(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


def _classify(engine, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    """The engine as served: encode, DP plan under the (autotuned) cost model, cached label-only forwards
    (duplicates computed once, a fast precision's unsettled answers re-checked, as the engine is set)."""
    progress = (lambda indices, _: bar.update(len(indices))) if bar else None
    predictions, reports = engine.classify(texts, on_answers=progress)
    return [Answer.of(p) for p in predictions], reports



def _full_prompt(bench: Bench, texts: list[str], bar: tqdm | None, *, planner: baselines.Planner):
    return baselines.full_prompt(bench.engine, texts, planner, bench.options.batch_size, bar)


RUNNERS: dict[str, Runner] = {
    "generate": lambda bench, texts, bar: baselines.generate(bench.engine, texts, bar),
    "sequential": lambda bench, texts, bar: baselines.sequential(bench.engine, texts, bar),
    **{mode: partial(_full_prompt, planner=planner) for mode, planner in baselines.FULL_PROMPT_PLANNERS.items()},
    "ticketq": lambda bench, texts, bar: _classify(bench.engine, texts, bar),
    # the same plan procedure with int8 decoder linears and its own (autotuned) cost model
    "ticketq-int8": lambda bench, texts, bar: _classify(bench.int8_engine, texts, bar),
    "ticketq-checked": lambda bench, texts, bar: _classify(bench.fast_engines["ticketq-checked"], texts, bar),
    "ticketq-bf16": lambda bench, texts, bar: _classify(bench.fast_engines["ticketq-bf16"], texts, bar),
    "ticketq-nodedup": lambda bench, texts, bar: _classify(bench.nodedup_engine, texts, bar),
}
FAST_MODES = ("ticketq-checked", "ticketq-bf16")


def prepare_fast(bench: Bench, mode: str, console: Console) -> str | None:
    """Build (once) `mode`'s engine on the float32 one: ticketq-checked in the precision TICKETQ_DTYPE=auto
    chooses here, re-checked in float32; ticketq-bf16 in bfloat16, unchecked. A skip reason or None."""
    if mode in bench.fast_engines:
        return None
    engine = bench.engine
    if engine.precision != "float32":
        return f"{mode} skipped: it is built on a float32 engine (--dtype float32), this one runs {engine.precision}"
    if mode == "ticketq-checked":
        precision, checked = resolve_precision("auto", engine.device, engine.info.matmul, recheck=True)
        if not checked and engine.device.type == "cpu" and int8_available():
            precision = "int8"  # the candidate where auto finds nothing faster: shown, its note says a worker's choice
        elif not checked:
            return (f"ticketq-checked skipped: no precision measures faster than float32 on this {engine.device.type} "
                    "(TICKETQ_DTYPE=auto runs float32 here)")  # fmt: skip
    else:
        precision = "bfloat16"
    same = next((e for e in bench.fast_engines.values() if e.precision == precision), None)
    try:
        fast = sibling(same, same.model, same.info) if same is not None else with_precision(engine, precision)
    except (ValueError, RuntimeError) as exc:
        return f"{mode} skipped: {exc}"
    if bench.tuning is not None:  # another precision, another cost per token: plan with its own measurements
        from worker.engine.autotune import autotune

        with console.status(f"autotuning the {precision} cost model ({bench.options.autotune_s:.0f} s budget)…"):
            tuning = autotune(fast, budget_s=bench.options.autotune_s)
        console.print(f"autotune on {engine.info.device}/{precision}: {tuning.describe()}")
    if mode == "ticketq-checked":  # shown even where a worker would answer in float32 (the note says so)
        with console.status(f"measuring {precision}'s error bound against float32 (cached per machine)…"):
            check_with(fast, engine, force=True)
    bench.fast_engines[mode] = fast
    return None


def prepare_nodedup(bench: Bench) -> None:
    """Build (once) ticketq-nodedup's engine: the same model, prompt, plan and cost model, dedup off."""
    if bench.nodedup_engine is None:
        bench.nodedup_engine = sibling(bench.engine, bench.engine.model, bench.engine.info)
        bench.nodedup_engine.dedup = False


def prepare_int8(bench: Bench, console: Console) -> str | None:
    """Build (once) the int8 engine on the loaded model and tune it like `ticketq`; a skip reason or None."""
    if bench.int8_engine is not None:
        return None
    engine = bench.engine
    if engine.int8:
        bench.int8_engine, bench.int8_tuning = engine, bench.tuning
        return None
    try:
        bench.int8_engine = with_int8(engine)
    except (ValueError, RuntimeError) as exc:
        return f"ticketq-int8 skipped: {exc}"
    if bench.tuning is not None:  # int8 changes the cost per token: plan with its own measurements
        from worker.engine.autotune import autotune

        with console.status(f"autotuning the int8 cost model ({bench.options.autotune_s:.0f} s budget)…"):
            bench.int8_tuning = autotune(bench.int8_engine, budget_s=bench.options.autotune_s)
        console.print(f"autotune on {engine.info.device}/int8: {bench.int8_tuning.describe()}")
    return None


# ----- the peers, each in its own process ---------------------------------------------------


class PeerRun(ModeRun):
    """A peer (llama.cpp, OpenVINO) in a child process: the same tickets as the engine's token ids."""

    process = None

    def start(self) -> None:
        import torch

        from ticketq_bench.peer_process import PeerCrashed, PeerFailed, PeerJob, PeerProcess
        from ticketq_bench.peers import PeerPrompt, PeerUnavailable

        bench, context, mode = self.context.bench, self.context, self.result.mode
        self.result.rss_of = "peer process"
        job = PeerJob(
            mode=mode,
            model_dir=str(bench.settings.model),
            cache_dir=str(ROOT / "out"),
            threads=torch.get_num_threads(),
            prompt=PeerPrompt.of(bench.engine.prompt),
            tickets=tuple(context.encoded),
            warm=tuple(context.encoded[i] for i in context.warm),
            batch_size=bench.options.batch_size,
            llama_cpp_src=str(bench.options.llama_cpp_src) if bench.options.llama_cpp_src else None,
        )
        self.process = PeerProcess(job)
        try:
            with context.console.status(f"starting {mode} in its own process (a model not yet converted is "
                                        "converted once, cached under out/)…"):  # fmt: skip
                self.result.notes += self.process.ready()
        except PeerUnavailable as exc:
            self.result.skipped = str(exc)
        except (PeerCrashed, PeerFailed) as exc:
            self.crash(str(exc), 0)

    def round(self, number: int, load: Load) -> None:
        from ticketq_bench.peer_process import PeerCrashed, PeerFailed

        result = self.result
        with tqdm(total=len(self.context.texts), desc=result.mode, unit="ticket") as bar:
            try:
                done = self.process.run_round(bar.update)
            except (PeerCrashed, PeerFailed) as exc:
                self.crash(str(exc), number)
                return
        if number == 1:
            result.reports = done.reports
        result.peak_rss_mb = _max(result.peak_rss_mb, done.peak_rss_mb)
        result.add_round(done.answers, done.seconds, load)

    def close(self) -> None:
        if self.process is not None:
            self.process.close()
