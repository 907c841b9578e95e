"""How the benchmark runs: the tickets and the model loaded once, then every mode in turn on the same tickets.

`setup` builds the settings, the engine and (unless told not to) the autotuned cost model;
`run_modes` runs each mode after a warm-up on the shortest tickets, timing it and reading its
peak RSS. The modes: the baselines (`worker.tools.bench.baselines`), the engine as served (`ticketq`,
`ticketq-int8`), the llama.cpp peer (`worker.tools.peers`), and `ticketq-queue`, which sends the
tickets through Redis to a real worker process (`worker.tools.procs`) started with the bench's own
model, precision, threads and cost model.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from rich.console import Console
from tqdm import tqdm

from worker.results import BatchReport
from worker.tools.bench import baselines
from worker.tools.bench.records import Answer, ModeResult, Options
from worker.tools.bench.report import describe_cost, load_average
from worker.tools.procs import ROOT, free_port, running_worker

LLAMA_CPP_MODES = {"llama-cpp": "f32", "llama-cpp-q8": "q8_0"}  # mode -> GGUF type


@dataclass
class Bench:
    """What every mode shares: the loaded engine, its settings, the options."""

    engine: object  # worker.engine.Engine (imported lazily: `--help` must not import torch)
    settings: object  # worker.settings.Settings
    options: Options
    tuning: object | None = None  # worker.engine.autotune.Tuning
    int8_engine: object | None = None  # built on first use by ticketq-int8, sharing the model
    int8_tuning: object | None = None
    load_before: tuple[float, float, float] | None = None  # os.getloadavg() when the modes start


# (bench, texts, progress bar or None) -> (answers in ticket order, one report per forward)
Runner = Callable[[Bench, list[str], tqdm | None], tuple[list[Answer], list[BatchReport]]]


# ----- set-up -------------------------------------------------------------------------------


def load_tickets(options: Options, console: Console) -> list[dict] | None:
    """`[{"id", "text"}]`: synthetic long-tail tickets, or the good rows of `--tickets-file`."""
    if options.tickets_file is None:
        from producer.synthetic import generate_tickets

        return generate_tickets(options.tickets, seed=options.seed)
    from producer.tickets import TicketFileError, read_tickets

    try:
        source = read_tickets(options.tickets_file)
    except TicketFileError as exc:
        console.print(f"[red]{exc}[/]")
        return None
    for error in source.errors[:20]:
        console.print(f"[yellow]skipped[/] {error}")
    tickets = source.tickets[: options.tickets] if options.tickets else source.tickets
    if not tickets:
        console.print(f"[red]{options.tickets_file}: no usable tickets[/]")
        return None
    return tickets


def setup(options: Options, console: Console) -> Bench | None:
    """Settings from TICKETQ_* plus the options, the engine (loaded once), and the autotune."""
    from worker.engine import Engine, ModelNotFound

    settings = _settings(options, console)
    if settings is None:
        return None
    with console.status(f"loading {settings.model}…"):
        try:
            engine = Engine.from_settings(settings)
        except ModelNotFound as exc:
            console.print(f"[red]{exc}[/]")
            return None
    bench = Bench(engine, settings, options)
    if options.no_autotune or options.max_batch_tokens:
        reason = "--max-batch-tokens given" if options.max_batch_tokens else "--no-autotune"
        console.print(f"autotune skipped ({reason}): {describe_cost(engine)}")
        return bench
    from worker.engine.autotune import autotune

    with console.status(f"autotuning the cost model ({options.autotune_s:.0f} s budget)…"):
        bench.tuning = autotune(engine, budget_s=options.autotune_s)
    console.print(f"autotune on {engine.info.device}/{engine.info.dtype}: {bench.tuning.describe()}")
    return bench


def _settings(options: Options, console: Console):
    """TICKETQ_* with the command line's model options on top, or None (printed why)."""
    from pydantic import ValidationError

    from worker.settings import Settings

    overrides = {
        "model": options.model,
        "dtype": options.dtype,
        "device": options.device,
        "threads": options.threads,
        "max_batch_tokens": options.max_batch_tokens,
    }
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        console.print(f"[red]invalid settings:[/] {exc}")
        return None
    if Path(settings.model).is_dir():  # the worker subprocess may resolve paths elsewhere
        settings = settings.model_copy(update={"model": str(Path(settings.model).resolve())})
    return settings


# ----- running the modes --------------------------------------------------------------------


def run_modes(bench: Bench, tickets: list[dict], console: Console) -> list[ModeResult]:
    """Every mode of the options, in order, on the same tickets; each warmed up on the shortest first."""
    texts = [t["text"] for t in tickets]
    encoded = bench.engine.encode(texts)
    by_length = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids))
    warm = [texts[i] for i in by_length[: bench.options.warmup]]  # shortest: warms kernels, costs little
    results = []
    bench.load_before = load_average()
    for mode in bench.options.mode_list:
        console.rule(mode)
        if mode == "ticketq-queue":
            result = run_queue_mode(bench, tickets, warm)
        elif mode in LLAMA_CPP_MODES:
            result = run_llama_cpp_mode(bench, mode, texts, warm, console)
        elif mode == "ticketq-int8" and (reason := prepare_int8(bench, console)):
            result = ModeResult(mode, skipped=reason)
        else:
            result = run_in_process(bench, mode, texts, warm)
        results.append(result)
    return results


def run_in_process(
    bench: Bench, mode: str, texts: list[str], warm: list[str], runner: Runner | None = None
) -> ModeResult:
    """One mode in this process: a warm-up, then every ticket timed under a progress bar, then peak RSS."""
    runner = runner or RUNNERS[mode]
    result = ModeResult(mode)
    if warm:
        runner(bench, warm, None)
    fresh_peak = _reset_peak_rss()
    with tqdm(total=len(texts), desc=mode, unit="ticket") as bar:
        start = time.perf_counter()
        result.answers, result.reports = runner(bench, texts, bar)
        result.seconds = time.perf_counter() - start
    result.peak_rss_mb = _peak_rss_mb("self")
    if not fresh_peak:
        result.rss_of = "bench process, peak so far"
    if mode == "generate":
        result.notes += baselines.generate_notes(result.answers, bench.engine.info.standin)
    return result


def _classify(engine, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    """The engine as served: encode, DP plan under the (autotuned) cost model, cached label-only forwards."""
    predictions, reports = engine.classify(texts, on_batch=(lambda r: bar.update(r.rows)) if bar else None)
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
}


def prepare_int8(bench: Bench, console: Console) -> str | None:
    """Build (once) the int8 engine on the loaded model and tune it like `ticketq`; a skip reason or None."""
    if bench.int8_engine is not None:
        return None
    engine = bench.engine
    if engine.int8:
        bench.int8_engine, bench.int8_tuning = engine, bench.tuning
        return None
    try:
        bench.int8_engine = engine.with_int8()
    except (ValueError, RuntimeError) as exc:
        return f"ticketq-int8 skipped: {exc}"
    if bench.tuning is not None:  # int8 changes the cost per token: plan with its own measurements
        from worker.engine.autotune import autotune

        with console.status(f"autotuning the int8 cost model ({bench.options.autotune_s:.0f} s budget)…"):
            bench.int8_tuning = autotune(bench.int8_engine, budget_s=bench.options.autotune_s)
        console.print(f"autotune on {engine.info.device}/int8: {bench.int8_tuning.describe()}")
    return None


# ----- the llama.cpp peer -------------------------------------------------------------------


def run_llama_cpp_mode(bench: Bench, mode: str, texts: list[str], warm: list[str], console: Console) -> ModeResult:
    """llama.cpp on the same tickets, the same token ids; skipped with a one-line reason where it cannot run."""
    import torch

    from worker.tools.peers import LlamaCppScorer, PeerUnavailable, gguf_model, llama_cpp_version

    outtype = LLAMA_CPP_MODES[mode]
    engine = bench.engine
    try:
        version = llama_cpp_version()
        with console.status(f"GGUF {outtype} of {bench.settings.model} (converted once, cached under out/gguf)…"):
            path = gguf_model(Path(bench.settings.model), outtype, ROOT / "out", bench.options.llama_cpp_src)
    except PeerUnavailable as exc:
        return ModeResult(mode, skipped=f"{mode} skipped: {exc}")
    n_ctx = engine.prefix_len + engine.prompt.max_ticket_tokens + len(engine.prompt.suffix_ids) + 16
    threads = torch.get_num_threads()
    scorer = LlamaCppScorer(path, engine.prompt, threads=threads, n_ctx=n_ctx)  # one context per mode
    result = run_in_process(bench, mode, texts, warm, partial(_score_with_peer, scorer))
    result.notes.append(
        f"{mode}: llama-cpp-python {version}, {path.name}, {threads} threads, prompt cache of "
        f"{scorer.prefix_len} tokens, one ticket per decode call"
    )
    return result


def _score_with_peer(
    scorer, bench: Bench, texts: list[str], bar: tqdm | None
) -> tuple[list[Answer], list[BatchReport]]:
    answers, reports = [], []
    for encoded in bench.engine.encode(texts):
        prediction, ticket_reports = scorer.score(encoded)
        answers.append(Answer.of(prediction))
        reports += ticket_reports
        if bar is not None:
            bar.update(1)
    return answers, reports


# ----- the queue mode -----------------------------------------------------------------------


def run_queue_mode(bench: Bench, tickets: list[dict], warm: list[str]) -> ModeResult:
    """All tickets through Redis and a real `ticketq worker` process, timed first send to last result."""
    from producer.api import BrokerUnavailable, Producer

    result = ModeResult("ticketq-queue", rss_of="worker process")
    queue = f"ticketq-bench-{os.getpid()}"
    producer = Producer(bench.settings.model_copy(update={"queue": queue}))
    try:
        producer.check_connection()
    except BrokerUnavailable as exc:
        producer.close()
        result.skipped = f"Redis unreachable, mode skipped: {exc}"
        return result
    log_path = Path(tempfile.gettempdir(), f"ticketq-bench-worker-{os.getpid()}.log")
    try:
        with running_worker(_worker_env(bench, queue, free_port()), log_path) as worker:
            _drive_queue(producer, worker, tickets, warm, result)
    except (RuntimeError, OSError) as exc:  # worker died or never got ready, Redis went away
        result.skipped = f"ticketq-queue failed: {exc} (worker log: {log_path})"
    finally:
        producer.close()
    return result


def _drive_queue(producer, worker, tickets: list[dict], warm: list[str], result: ModeResult) -> None:
    # A warm-up round trip: kernels warmed, and proof that the consumer takes messages.
    warm_sent = producer.submit_many([{"id": f"warmup-{i}", "text": t} for i, t in enumerate(warm or ["hello"])])
    producer.wait(warm_sent, timeout=600)
    before = worker.metrics()
    start = time.perf_counter()
    sent = producer.submit_many([{"id": t["id"], "text": t["text"]} for t in tickets], progress=True)
    replies = producer.wait(sent, timeout=max(600.0, 10.0 * len(tickets)), progress=True)
    result.seconds = time.perf_counter() - start
    after = worker.metrics()
    by_id = {r["id"]: r for r in replies}
    for ticket in tickets:
        reply = by_id.get(ticket["id"], {"status": "missing"})
        ok = reply.get("status") == "ok"
        result.answers.append(Answer(reply["label"], reply["probs"]) if ok else Answer(f"<{reply['status']}>"))
    failed = sum(a.probs is None for a in result.answers)
    if failed:
        result.notes.append(f"ticketq-queue: {failed} tickets failed or timed out (worker log: {worker.log_path})")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result.padding = (
        int(delta.get("ticketq_tokens_padded_total{}", 0)),
        int(delta.get("ticketq_tokens_computed_total{}", 0)),
    )
    result.forwards = int(delta.get("ticketq_batch_size_count{}", 0))
    result.peak_rss_mb = _peak_rss_mb(worker.pid)


def _worker_env(bench: Bench, queue: str, port: int) -> dict[str, str]:
    """The bench's own settings for the worker: same model, dtype, device, threads and planner."""
    import torch

    engine, cost = bench.engine, bench.engine.cost
    return {
        **os.environ,
        "TICKETQ_MODEL": bench.settings.model,
        "TICKETQ_DTYPE": engine.info.dtype,
        "TICKETQ_MATMUL": engine.info.matmul,
        "TICKETQ_DEVICE": engine.info.device.split(":")[0],
        "TICKETQ_THREADS": str(torch.get_num_threads()),
        "TICKETQ_QUEUE": queue,
        "TICKETQ_METRICS_HOST": "127.0.0.1",
        "TICKETQ_METRICS_PORT": str(port),
        "TICKETQ_MAX_BATCH_TOKENS": str(engine.max_batch_tokens),
        # the worker plans with exactly the cost model the in-process mode used
        "TICKETQ_COST_FIXED_MS": repr(cost.fixed_ms),
        "TICKETQ_COST_TOKEN_MS": repr(cost.token_ms),
        "TICKETQ_COST_QUAD_MS": repr(cost.quad_ms),
        "TICKETQ_AUTOTUNE": "false",
        "TICKETQ_NULL_CLASSIFIER": "false",
        "PYTHONUNBUFFERED": "1",
    }


# ----- memory -------------------------------------------------------------------------------


def _reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: clear_refs 5), so each mode reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mb(pid: int | str) -> float | None:
    """Peak RSS in MiB: VmHWM from /proc, else getrusage (self) or current RSS via psutil."""
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
        if match:
            return int(match.group(1)) / 1024
    except OSError:
        pass
    if pid == "self":
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB elsewhere
    import psutil

    try:
        return psutil.Process(int(pid)).memory_info().rss / 2**20
    except psutil.Error:
        return None
