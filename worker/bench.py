"""`ticketq bench`: one model, one ticket list, every way of classifying it, side by side.

The model is loaded once and each mode classifies the same tickets, one mode after another in
this process (warm-up first, torch threads set once):

- `generate`      what a newcomer writes: chat template + `model.generate` (4 new tokens, greedy)
                  per ticket, the label parsed from the decoded text. Off by default (slowest).
- `sequential`    the article's baseline and everyone's reference: one ticket at a time, full
                  prompt, constrained label scoring (`Engine.reference`).
- `naive`         fixed-size batches in arrival order, padded to the batch's longest, full prompt.
- `naive-global`  the same, every batch padded to the longest ticket of all (the article's 70%).
- `sorted`        the article's method: length-sorted fixed-size batches, full prompt.
- `ticketq`       the engine: autotuned cost model, DP plan, prefix KV cache, label-only head.
- `ticketq-int8`  the same with the decoder's linear layers in dynamic int8 (inexact; opt-in).
- `ticketq-queue` the same end to end: Redis, a real worker process, the producer API.
- `llama-cpp`     the CPU peer: llama.cpp (llama-cpp-python) on the same model in GGUF f32,
                  prompt cache, one ticket at a time, label from the answer-position logits.
- `llama-cpp-q8`  the same in GGUF q8_0 (llama.cpp's 8-bit weights). Both opt-in, `worker.peers`.

Per mode: items/s, speedup over `sequential`, padding ratio (pad / tokens actually computed, so
the full-prompt modes count the prefix they re-run), agreement with `sequential`, max |Δprob|,
disagreements split into near-ties (reference margin below `--tie-tolerance`) and the rest, and
peak RSS. Output: a rich table, `--json`, `--chart`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from worker import batching
from worker.prompt import EncodedTicket, canonical_text
from worker.results import BatchReport, Prediction

MODES = (
    "generate", "sequential", "naive", "naive-global", "sorted", "ticketq", "ticketq-int8", "ticketq-queue",
    "llama-cpp", "llama-cpp-q8",
)  # fmt: skip
OPT_IN_MODES = ("generate", "ticketq-int8", "llama-cpp", "llama-cpp-q8")  # run only when listed (or 'all')
DEFAULT_MODES = tuple(m for m in MODES if m not in OPT_IN_MODES)
LLAMA_CPP_MODES = {"llama-cpp": "f32", "llama-cpp-q8": "q8_0"}  # mode -> GGUF type
FULL_PROMPT_PLANNERS: dict[str, Callable[[Sequence[int], int], batching.Plan]] = {
    "naive": lambda lengths, size: batching.plan_fixed(lengths, size),
    "naive-global": batching.plan_global_pad,
    "sorted": lambda lengths, size: batching.plan_fixed(lengths, size, sort=True),
}
GENERATE_NEW_TOKENS = 4
QUICK = {"tickets": 12, "batch_size": 4, "warmup": 1, "autotune_s": 3.0}
ROOT = Path(__file__).resolve().parent.parent
# Per-mode figures in the JSON rows (None where a mode was skipped).
FIGURES = (
    "tickets", "seconds", "items_per_s", "speedup", "padding_ratio", "pad_tokens", "computed_tokens",
    "tokens_per_ticket", "tokens_per_s", "forwards",
    "agreement", "max_abs_prob_diff", "near_ties", "disagreements_non_tie", "disagreements_near_tie", "failed",
)  # fmt: skip
STANDIN_LINE = "stand-in model (random weights): labels meaningless; speed is real"


@dataclass(frozen=True)
class Answer:
    """One ticket's answer from any mode; `probs` is None where a mode has none (generate)."""

    label: str
    probs: dict[str, float] | None = None
    new_tokens: int | None = None  # generate only: decode steps actually run


@dataclass
class ModeResult:
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


@dataclass
class Bench:
    """What every mode shares: the loaded engine, its settings, the options."""

    engine: object  # worker.engine.Engine (imported lazily: `--help` must not import torch)
    settings: object  # worker.settings.Settings
    args: argparse.Namespace
    tuning: object | None = None  # worker.autotune.Tuning
    int8_engine: object | None = None  # built on first use by ticketq-int8, sharing the model
    int8_tuning: object | None = None
    peer_scorer: object | None = None  # worker.peers.LlamaCppScorer of the llama.cpp mode running now
    load_before: tuple[float, float, float] | None = None  # os.getloadavg() when the modes start


# ----- command line -------------------------------------------------------------------------


MODE_HELP = """\
modes (run in this order, one after another, on the same tickets):
  generate       chat template + model.generate (4 new tokens, greedy) per ticket, label parsed from the text
  sequential     one ticket at a time, full prompt, constrained label scoring (Engine.reference) = reference
  naive          fixed-size batches in arrival order, padded to the batch's longest, full prompt per row
  naive-global   the same, every batch padded to the longest ticket of all
  sorted         length-sorted fixed-size batches, full prompt per row (the article's method)
  ticketq        the engine: autotuned cost model, DP plan, prefix KV cache, label-only head
  ticketq-int8   the same, decoder linear layers in dynamic int8 (inexact, CPU; TICKETQ_DTYPE=int8)
  ticketq-queue  the same through Redis and a real `ticketq worker` process (skipped if Redis is down)
  llama-cpp      llama.cpp on the same model in GGUF f32: prompt cache, one ticket at a time, the engine's
                 token ids, label from the answer-position logits (needs pip install 'ticketq[peers]')
  llama-cpp-q8   the same in GGUF q8_0

Default: every mode but generate, ticketq-int8, llama-cpp, llama-cpp-q8 (list them, or --modes all).
sequential always runs: it is the reference for agreement and the baseline for speedup.
--quick = {tickets} tickets, batch size {batch_size}, {warmup} warm-up ticket, a {autotune_s:.0f} s autotune,
no generate; explicit options still win.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ticketq bench",
        description=textwrap.fill(
            "Load one model once and classify the same tickets in every mode below. Per mode: items/s, speedup "
            "over sequential, padding ratio (pad / tokens computed), tokens computed per ticket and tokens/s (where "
            "the time goes: fewer tokens, or faster tokens), agreement and max |delta prob| against "
            "sequential, disagreements on near-ties and on the rest, peak RSS. A rich table on stdout, "
            "optionally JSON and a PNG chart.",
            100,
        ),
        epilog=MODE_HELP.format(**QUICK),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = parser.add_argument_group("model (defaults come from the TICKETQ_* settings)")
    model.add_argument("--model", metavar="ID|DIR", help="hub id or local directory (default: TICKETQ_MODEL)")
    model.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16", "int8"), help="(default: TICKETQ_DTYPE)"
    )
    model.add_argument("--device", choices=("auto", "cpu", "cuda", "mps"), help="(default: TICKETQ_DEVICE)")
    model.add_argument("--threads", metavar="N", type=_positive_int, help="torch threads, set once for every mode")
    data = parser.add_argument_group("tickets")
    data.add_argument("--tickets", metavar="N", type=_positive_int, help="how many (default: 600; with a file: all)")
    data.add_argument(
        "--tickets-file",
        metavar="PATH",
        type=Path,
        help="JSONL {id, text} (or CSV) instead of synthetic long-tail tickets",
    )
    data.add_argument("--seed", type=int, default=0, help="synthetic ticket seed (default: 0)")
    run = parser.add_argument_group("run")
    run.add_argument(
        "--modes",
        metavar="LIST",
        default=",".join(DEFAULT_MODES),
        help="comma-separated modes, or 'all' (default: all but generate)",
    )
    run.add_argument(
        "--batch-size",
        metavar="N",
        type=_positive_int,
        help="rows per batch in naive, naive-global, sorted (default: 16)",
    )
    run.add_argument(
        "--max-batch-tokens",
        metavar="N",
        type=_positive_int,
        help="ticketq's padded-token budget; given, autotune is skipped",
    )
    run.add_argument("--no-autotune", action="store_true", help="plan with the TICKETQ_COST_* model as configured")
    run.add_argument("--autotune-s", metavar="S", type=float, help="autotune measuring budget (default: 20)")
    run.add_argument("--warmup", metavar="N", type=int, help="warm-up tickets per mode, the shortest (default: 4)")
    run.add_argument(
        "--tie-tolerance",
        metavar="P",
        type=float,
        default=0.01,
        help="a reference margin below this is a near-tie (default: 0.01)",
    )
    run.add_argument(
        "--llama-cpp-src",
        metavar="DIR",
        type=Path,
        help="llama.cpp source tree with convert_hf_to_gguf.py (default: from the llama-cpp-python sdist)",
    )
    run.add_argument("--quick", action="store_true", help="a short run for a slow machine (see below)")
    run.add_argument("--strict", action="store_true", help="exit 1 on any disagreement that is not a near-tie")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", type=Path, help="write [header, one object per mode] as JSON")
    out.add_argument("--chart", metavar="PATH", type=Path, help="write a PNG: items/s and padding ratio per mode")
    out.add_argument("--markdown", metavar="PATH", type=Path, help="write the table as Markdown (for a README)")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    if wanted == ["all"]:
        wanted = list(MODES)
    unknown = [m for m in wanted if m not in MODES]
    if unknown or not wanted:
        parser.error(f"--modes: unknown {unknown or 'empty list'}; choose from {', '.join(MODES)} or 'all'")
    explicit = any(a == "--modes" or a.startswith("--modes=") for a in argv)
    if args.quick and not explicit:
        wanted = [m for m in wanted if m != "generate"]
    args.requested_modes = wanted
    args.mode_list = [m for m in MODES if m in wanted or m == "sequential"]  # canonical order
    defaults = {"batch_size": 16, "warmup": 4, "autotune_s": 20.0}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, QUICK[name] if args.quick else default)
    if args.tickets is None and args.tickets_file is None:
        args.tickets = QUICK["tickets"] if args.quick else 600
    if args.warmup < 0 or args.tie_tolerance < 0:
        parser.error("--warmup and --tie-tolerance must be >= 0")
    args.command = shlex.join(["ticketq", "bench", *argv])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status (0 ok, 1 --strict failure, 2 bad setup)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console()
    if not console.is_terminal:  # files and pipes: wide enough for the whole table
        console.width = max(console.width, 120)
    tickets = load_tickets(args, console)
    if tickets is None:
        return 2
    bench = setup(args, console)
    if bench is None:
        return 2
    results = run_modes(bench, tickets, console)
    rows = [summarise(result, results, args.tie_tolerance) for result in results]
    header = make_header(bench, tickets, rows)
    print_report(console, header, rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([header, *rows], indent=2, ensure_ascii=False) + "\n")
        console.print(f"JSON written to {args.json}")
    if args.chart:
        write_chart(args.chart, header, rows)
        console.print(f"chart written to {args.chart}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_table(header, rows))
        console.print(f"Markdown table written to {args.markdown}")
    if args.strict and any(row["disagreements_non_tie"] for row in rows if row["status"] == "ok"):
        return 1
    return 0


# ----- set-up -------------------------------------------------------------------------------


def load_tickets(args: argparse.Namespace, console: Console) -> list[dict] | None:
    """`[{"id", "text"}]`: synthetic long-tail tickets, or the good rows of `--tickets-file`."""
    if args.tickets_file is None:
        from producer.synthetic import generate_tickets

        return generate_tickets(args.tickets, seed=args.seed)
    from producer.tickets import TicketFileError, read_tickets

    try:
        source = read_tickets(args.tickets_file)
    except TicketFileError as exc:
        console.print(f"[red]{exc}[/]")
        return None
    for error in source.errors[:20]:
        console.print(f"[yellow]skipped[/] {error}")
    tickets = source.tickets[: args.tickets] if args.tickets else source.tickets
    if not tickets:
        console.print(f"[red]{args.tickets_file}: no usable tickets[/]")
        return None
    return tickets


def setup(args: argparse.Namespace, console: Console) -> Bench | None:
    """Settings from TICKETQ_* plus the options, the engine (loaded once), and the autotune."""
    from pydantic import ValidationError

    from worker.engine import Engine, ModelNotFound
    from worker.settings import Settings

    overrides = {
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "max_batch_tokens": args.max_batch_tokens,
    }
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        console.print(f"[red]invalid settings:[/] {exc}")
        return None
    if Path(settings.model).is_dir():  # the worker subprocess may resolve paths elsewhere
        settings = settings.model_copy(update={"model": str(Path(settings.model).resolve())})
    with console.status(f"loading {settings.model}…"):
        try:
            engine = Engine.from_settings(settings)
        except ModelNotFound as exc:
            console.print(f"[red]{exc}[/]")
            return None
    bench = Bench(engine, settings, args)
    if args.no_autotune or args.max_batch_tokens:
        reason = "--max-batch-tokens given" if args.max_batch_tokens else "--no-autotune"
        console.print(f"autotune skipped ({reason}): {_describe_cost(engine)}")
        return bench
    from worker.autotune import autotune

    with console.status(f"autotuning the cost model ({args.autotune_s:.0f} s budget)…"):
        bench.tuning = autotune(engine, budget_s=args.autotune_s)
    console.print(f"autotune on {engine.info.device}/{engine.info.dtype}: {bench.tuning.describe()}")
    return bench


def _describe_cost(engine) -> str:
    """The planner's cost model and budget as the engine holds them (autotuned or configured)."""
    from worker.autotune import Tuning

    return Tuning(engine.cost, engine.max_batch_tokens, ()).describe()


# ----- running the modes --------------------------------------------------------------------


def run_modes(bench: Bench, tickets: list[dict], console: Console) -> list[ModeResult]:
    texts = [t["text"] for t in tickets]
    encoded = bench.engine.encode(texts)
    by_length = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids))
    warm = [texts[i] for i in by_length[: bench.args.warmup]]  # shortest: warms kernels, costs little
    results = []
    bench.load_before = _load_average()
    for mode in bench.args.mode_list:
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


def run_in_process(bench: Bench, mode: str, texts: list[str], warm: list[str]) -> ModeResult:
    runner = RUNNERS[mode]
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
        result.notes += _generate_notes(bench, result)
    return result


def run_sequential(bench: Bench, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    """The article's baseline: one ticket, full prompt, constrained scoring (`Engine.reference`)."""
    engine = bench.engine
    plan = batching.plan_sequential([len(e.ids) for e in engine.encode(texts)])  # arrival order, one row each
    answers, reports = [], []
    for batch in plan.batches:
        start = time.perf_counter()
        answers.append(_answer(engine.reference(texts[batch.indices[0]])))
        seconds = time.perf_counter() - start
        for path in engine.prompt.trie.branches:  # the reference runs one full-prompt forward per branch
            width = engine.prefix_len + batch.width + len(path)
            reports.append(BatchReport(1, width, width, seconds))
            seconds = 0.0
        if bar is not None:
            bar.update(1)
    return answers, reports


def run_full_prompt(
    bench: Bench, texts: list[str], bar: tqdm | None, *, planner: Callable[[Sequence[int], int], batching.Plan]
) -> tuple[list[Answer], list[BatchReport]]:
    """Batches from `planner`, each row the FULL prompt (no prefix cache), right-padded."""
    engine = bench.engine
    encoded = engine.encode(texts)
    plan = planner([len(e.ids) for e in encoded], bench.args.batch_size)
    answers: list[Answer | None] = [None] * len(texts)
    reports = []
    for batch in plan.batches:
        predictions, batch_reports = full_prompt_batch(engine, [encoded[i] for i in batch.indices], batch.width)
        for index, prediction in zip(batch.indices, predictions, strict=True):
            answers[index] = _answer(prediction)
        reports += batch_reports
        if bar is not None:
            bar.update(batch.rows)
    return answers, reports  # type: ignore[return-value]


def run_ticketq(bench: Bench, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    """The engine as served: encode, DP plan under the (autotuned) cost model, cached label-only forwards."""
    predictions, reports = bench.engine.classify(texts, on_batch=(lambda r: bar.update(r.rows)) if bar else None)
    return [_answer(p) for p in predictions], reports


def run_ticketq_int8(bench: Bench, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    """The engine with int8 decoder linears; the same plan procedure, its own (autotuned) cost model."""
    predictions, reports = bench.int8_engine.classify(texts, on_batch=(lambda r: bar.update(r.rows)) if bar else None)
    return [_answer(p) for p in predictions], reports


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
        from worker.autotune import autotune

        with console.status(f"autotuning the int8 cost model ({bench.args.autotune_s:.0f} s budget)…"):
            bench.int8_tuning = autotune(bench.int8_engine, budget_s=bench.args.autotune_s)
        console.print(f"autotune on {engine.info.device}/int8: {bench.int8_tuning.describe()}")
    return None


def run_generate(bench: Bench, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    """What a newcomer writes: render the chat, `generate` a few tokens greedily, look for a label."""
    answers, reports = [], []
    for text in texts:
        start = time.perf_counter()
        decoded, prompt_tokens, new_tokens = generate_one(bench.engine, text)
        computed = prompt_tokens + max(0, new_tokens - 1)  # the last new token is never fed back
        reports.append(BatchReport(1, computed, computed, time.perf_counter() - start))
        answers.append(Answer(parse_label(decoded, bench.engine.labels), new_tokens=new_tokens))
        if bar is not None:
            bar.update(1)
    return answers, reports


RUNNERS: dict[str, Callable[[Bench, list[str], tqdm | None], tuple[list[Answer], list[BatchReport]]]] = {
    "generate": run_generate,
    "sequential": run_sequential,
    **{mode: partial(run_full_prompt, planner=planner) for mode, planner in FULL_PROMPT_PLANNERS.items()},
    "ticketq": run_ticketq,
    "ticketq-int8": run_ticketq_int8,
}


def _answer(prediction: Prediction) -> Answer:
    return Answer(prediction.label, dict(prediction.probs))


# ----- model calls (the only tensor code outside the engine: baselines the engine is not) ---


def full_prompt_batch(engine, rows: Sequence[EncodedTicket], width: int) -> tuple[list[Prediction], list[BatchReport]]:
    """Score `rows` as full prompts (prefix + ticket + suffix, nothing cached) right-padded to prefix+`width`.

    Mirrors `Engine.reference` row by row: at each label-trie branch the full-vocabulary
    log-softmax at the row's last real token, restricted to the branch's children and
    renormalised. A label set whose first tokens are distinct has one branch (the root), so one
    forward decides; deeper branches append the branch path to each row and run again.
    """

    prefix = engine.prompt.prefix_ids
    branch_logprobs, reports = {}, []
    for path, kids in engine.prompt.trie.branches.items():
        sequences = [[*prefix, *row.ids, *path] for row in rows]
        start = time.perf_counter()
        branch_logprobs[path] = _branch_logprobs(engine, sequences, len(prefix) + width + len(path), kids)
        real = sum(len(s) for s in sequences)
        reports.append(BatchReport(len(rows), len(prefix) + width + len(path), real, time.perf_counter() - start))
    predictions = []
    for i, row in enumerate(rows):
        logprobs = {
            name: sum(float(branch_logprobs[path][i, child]) for path, child in engine.prompt.trie.decisions(name))
            for name in engine.labels
        }
        predictions.append(_prediction(logprobs, row))
    return predictions, reports


def _branch_logprobs(engine, sequences: list[list[int]], width: int, kids: tuple[int, ...]):
    import torch

    with torch.inference_mode():
        device = engine.device
        lengths = torch.tensor([len(s) for s in sequences], device=device)  # (B,)
        ids = torch.full((len(sequences), width), engine.pad_id, dtype=torch.long, device=device)  # (B, T)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq, device=device)
        mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()  # (B, T), 1 = real
        hidden = engine.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (B, T, H)
        last = hidden[torch.arange(len(sequences), device=device), lengths - 1]  # (B, H)
        logits = engine.label_head(last).float()  # (B, V): full vocabulary, last real token only
        allowed = torch.log_softmax(logits, dim=-1)[:, list(kids)]  # (B, C)
        return torch.log_softmax(allowed, dim=-1).cpu()  # (B, C) renormalised over the choices


def _prediction(logprobs: dict[str, float], encoded: EncodedTicket) -> Prediction:
    probs = {name: math.exp(lp) for name, lp in logprobs.items()}
    ranked = sorted(probs, key=probs.__getitem__, reverse=True)
    return Prediction(ranked[0], probs, probs[ranked[0]] - probs[ranked[1]], encoded.truncated, encoded.ticket_tokens)


def generate_one(engine, text: str) -> tuple[str, int, int]:
    """Greedy `generate` on the rendered chat prompt: (decoded new text, prompt tokens, new tokens)."""
    import torch

    rendered = engine.prompt.render(canonical_text(text))
    ids = engine.tokenizer(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"].to(engine.device)
    with torch.inference_mode():
        out = engine.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=GENERATE_NEW_TOKENS,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=engine.pad_id,
        )  # (1, T + new)
    new = out[0, ids.shape[1] :]
    return engine.tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], int(new.shape[0])


def parse_label(decoded: str, labels: Sequence[str]) -> str:
    """The label named first in `decoded` (case-insensitive), else "unparsed"."""
    lowered = decoded.lower()
    found = [(lowered.find(name.lower()), name) for name in labels if name.lower() in lowered]
    return min(found)[1] if found else "unparsed"


def _generate_notes(bench: Bench, result: ModeResult) -> list[str]:
    full = sum((a.new_tokens or 0) >= GENERATE_NEW_TOKENS for a in result.answers)
    unparsed = sum(a.label == "unparsed" for a in result.answers)
    notes = [
        f"generate: {full}/{len(result.answers)} tickets ran all {GENERATE_NEW_TOKENS} new tokens "
        f"(no early end-of-turn); {unparsed} unparsed"
    ]
    if bench.engine.info.standin:
        notes.append("generate: stand-in weights never stop early, so it always pays every decode step")
    return notes


# ----- the llama.cpp peer -------------------------------------------------------------------


def run_llama_cpp_mode(bench: Bench, mode: str, texts: list[str], warm: list[str], console: Console) -> ModeResult:
    """llama.cpp on the same tickets, the same token ids; skipped with a one-line reason where it cannot run."""
    import torch

    from worker.peers import LlamaCppScorer, PeerUnavailable, gguf_model, llama_cpp_version

    outtype = LLAMA_CPP_MODES[mode]
    engine = bench.engine
    try:
        version = llama_cpp_version()
        with console.status(f"GGUF {outtype} of {bench.settings.model} (converted once, cached under out/gguf)…"):
            path = gguf_model(Path(bench.settings.model), outtype, ROOT / "out", bench.args.llama_cpp_src)
    except PeerUnavailable as exc:
        return ModeResult(mode, skipped=f"{mode} skipped: {exc}")
    n_ctx = engine.prefix_len + engine.prompt.max_ticket_tokens + len(engine.prompt.suffix_ids) + 16
    threads = torch.get_num_threads()
    scorer = LlamaCppScorer(path, engine.prompt, threads=threads, n_ctx=n_ctx)
    bench.peer_scorer = scorer  # the runner reads it; one context per mode
    try:
        result = run_in_process(bench, mode, texts, warm)
    finally:
        bench.peer_scorer = None
    result.notes.append(
        f"{mode}: llama-cpp-python {version}, {path.name}, {threads} threads, prompt cache of "
        f"{scorer.prefix_len} tokens, one ticket per decode call"
    )
    return result


def run_llama_cpp(bench: Bench, texts: list[str], bar: tqdm | None) -> tuple[list[Answer], list[BatchReport]]:
    answers, reports = [], []
    for encoded in bench.engine.encode(texts):
        prediction, ticket_reports = bench.peer_scorer.score(encoded)
        answers.append(_answer(prediction))
        reports += ticket_reports
        if bar is not None:
            bar.update(1)
    return answers, reports


RUNNERS |= dict.fromkeys(LLAMA_CPP_MODES, run_llama_cpp)


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
    port = _free_port()
    proc = _start_worker(_worker_env(bench, queue, port), log_path)
    try:
        _drive_queue(producer, proc, port, log_path, tickets, warm, result)
    except (RuntimeError, OSError) as exc:  # worker died or never got ready, Redis went away
        result.skipped = f"ticketq-queue failed: {exc} (worker log: {log_path})"
    finally:
        _stop(proc)
        producer.close()
    return result


def _drive_queue(producer, proc, port: int, log_path: Path, tickets, warm, result: ModeResult) -> None:
    from worker.demo import scrape, wait_ready

    url = f"http://127.0.0.1:{port}/metrics"
    wait_ready(proc, url, log_path)
    # A warm-up round trip: kernels warmed, and proof that the consumer takes messages.
    warm_sent = producer.submit_many([{"id": f"warmup-{i}", "text": t} for i, t in enumerate(warm or ["hello"])])
    producer.wait(warm_sent, timeout=600)
    before = scrape(url)
    start = time.perf_counter()
    sent = producer.submit_many([{"id": t["id"], "text": t["text"]} for t in tickets], progress=True)
    replies = producer.wait(sent, timeout=max(600.0, 10.0 * len(tickets)), progress=True)
    result.seconds = time.perf_counter() - start
    after = scrape(url)
    by_id = {r["id"]: r for r in replies}
    for ticket in tickets:
        reply = by_id.get(ticket["id"], {"status": "missing"})
        ok = reply.get("status") == "ok"
        result.answers.append(Answer(reply["label"], reply["probs"]) if ok else Answer(f"<{reply['status']}>"))
    failed = sum(a.probs is None for a in result.answers)
    if failed:
        result.notes.append(f"ticketq-queue: {failed} tickets failed or timed out (worker log: {log_path})")
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    result.padding = (
        int(delta.get("ticketq_tokens_padded_total{}", 0)),
        int(delta.get("ticketq_tokens_computed_total{}", 0)),
    )
    result.forwards = int(delta.get("ticketq_batch_size_count{}", 0))
    result.peak_rss_mb = _peak_rss_mb(proc.pid)


def _worker_env(bench: Bench, queue: str, port: int) -> dict[str, str]:
    """The bench's own settings for the worker: same model, dtype, device, threads and planner."""
    import torch

    engine, cost = bench.engine, bench.engine.cost
    env = {
        **os.environ,
        "TICKETQ_MODEL": bench.settings.model,
        "TICKETQ_DTYPE": engine.info.dtype,
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
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def _start_worker(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with log_path.open("wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "worker", "--loglevel", "INFO"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (Celery requeues anything unacked at once), then kill if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _free_port() -> int:
    from worker.demo import free_port

    return free_port(0)


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


# ----- figures ------------------------------------------------------------------------------


def summarise(result: ModeResult, results: list[ModeResult], tie_tolerance: float) -> dict:
    """One JSON-ready row: speed, padding, agreement with `sequential`, memory."""
    row = {"kind": "mode", "mode": result.mode, "status": "skipped" if result.skipped else "ok"}
    row |= dict.fromkeys(FIGURES) | {"peak_rss_mb": result.peak_rss_mb, "rss_of": result.rss_of, "notes": result.notes}
    if result.skipped:
        row["notes"] = [result.skipped, *result.notes]
        return row
    reference = next(r for r in results if r.mode == "sequential")
    baseline = len(reference.answers) / reference.seconds if reference.seconds else None
    n = len(result.answers)
    pad, computed = result.padding or (
        sum(r.pad_tokens for r in result.reports),
        sum(r.computed_tokens for r in result.reports),
    )
    row |= {
        "tickets": n,
        "seconds": result.seconds,
        "items_per_s": n / result.seconds if result.seconds else None,
        "padding_ratio": pad / computed if computed else 0.0,
        "pad_tokens": pad,
        "computed_tokens": computed,
        **token_rates(computed, n, result.seconds),
        "forwards": result.forwards if result.forwards is not None else len(result.reports),
        "failed": sum(a.label.startswith("<") for a in result.answers),
    }
    row["speedup"] = row["items_per_s"] / baseline if baseline and row["items_per_s"] else None
    row |= compare(result.answers, reference.answers, tie_tolerance)
    return row


def token_rates(computed: int | None, tickets: int | None, seconds: float | None) -> dict:
    """Where the time goes: fewer tokens per ticket (prefix cache, padding) or more tokens/s (batching)."""
    return {
        "tokens_per_ticket": computed / tickets if computed is not None and tickets else None,
        "tokens_per_s": computed / seconds if computed is not None and seconds else None,
    }


def compare(answers: list[Answer], reference: list[Answer], tie_tolerance: float) -> dict:
    """Agreement with the reference; disagreements split into near-ties and real ones."""
    margins = [_margin(r.probs) for r in reference]
    ties = [m < tie_tolerance for m in margins]
    differs = [a.label != r.label for a, r in zip(answers, reference, strict=True)]
    diffs = [
        abs(a.probs[k] - p)
        for a, r in zip(answers, reference, strict=True)
        if a.probs is not None
        for k, p in r.probs.items()
    ]
    return {
        "agreement": 1 - sum(differs) / len(reference) if reference else None,
        "max_abs_prob_diff": max(diffs) if diffs else None,
        "near_ties": sum(ties),
        "disagreements_non_tie": sum(d and not t for d, t in zip(differs, ties, strict=True)),
        "disagreements_near_tie": sum(d and t for d, t in zip(differs, ties, strict=True)),
    }


def _margin(probs: dict[str, float]) -> float:
    ranked = sorted(probs.values(), reverse=True)
    return ranked[0] - ranked[1]


def make_header(bench: Bench, tickets: list[dict], rows: list[dict]) -> dict:
    import torch
    import transformers

    engine, args = bench.engine, bench.args
    lengths = [e.ticket_tokens for e in engine.encode([t["text"] for t in tickets])]
    tuning = bench.tuning
    notes = _notes(bench, rows)
    return {
        "kind": "header",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": args.command,
        "machine": _machine(),
        "load_average": {"start": bench.load_before, "end": _load_average()},
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": engine.info.name,
        "standin": engine.info.standin,
        "dtype": engine.info.dtype,
        "device": engine.info.device,
        "tickets": len(tickets),
        "ticket_source": str(args.tickets_file) if args.tickets_file else f"synthetic long-tail, seed {args.seed}",
        "ticket_tokens": {
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "mean": statistics.fmean(lengths),
        },
        "prefix_tokens": engine.prefix_len,
        "suffix_tokens": len(engine.prompt.suffix_ids),
        "labels": list(engine.labels),
        "batch_size": args.batch_size,
        "warmup_tickets": args.warmup,
        "tie_tolerance": args.tie_tolerance,
        "quick": args.quick,
        "modes": args.mode_list,
        "autotune": {
            "applied": tuning is not None,
            "description": tuning.describe() if tuning else _describe_cost(engine),
            "cost": {
                "fixed_ms": engine.cost.fixed_ms,
                "token_ms": engine.cost.token_ms,
                "quad_ms": engine.cost.quad_ms,
            },
            "max_batch_tokens": engine.max_batch_tokens,
            "samples": [list(s) for s in tuning.samples] if tuning else [],
        },
        "notes": notes,
    }


def _notes(bench: Bench, rows: list[dict]) -> list[str]:
    engine = bench.engine
    notes = []
    if engine.info.standin:
        notes.append(STANDIN_LINE)
    if bench.int8_engine is not None:
        tuned = f" planner: {bench.int8_tuning.describe()}" if bench.int8_tuning else ""
        notes.append(
            "ticketq-int8: decoder linear layers in dynamic int8 (torch quantize_dynamic), prefix cache and "
            f"reference in float32; inexact, so near-ties may flip (counted separately).{tuned}"
        )
    if engine.info.dtype != "float32":
        notes.append(
            f"{engine.info.dtype}: batch shape changes rounding, so probabilities differ slightly between "
            "modes; near-ties may flip (counted separately)"
        )
    if "sequential" not in bench.args.requested_modes:
        notes.append("sequential ran although not listed: it is the reference and the speedup baseline")
    for row in rows:
        notes += [n for n in row["notes"] if n not in notes]
    return notes


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = match.group(1).strip() if match else cpu
    except OSError:
        pass
    machine = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "cpu_flags": _cpu_flags()}
    if hasattr(os, "sched_getaffinity"):
        machine["usable_cores"] = len(os.sched_getaffinity(0))
    return machine


def _cpu_flags() -> list[str]:
    """The SIMD features that decide float32 / bf16 / int8 speed on a CPU (Linux only)."""
    try:
        match = re.search(r"^flags\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        return []
    flags = set(match.group(1).split()) if match else set()
    wanted = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return [f for f in wanted if f in flags]


def _load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


# (heading, JSON key, format) of the figure columns shared by the stdout and Markdown tables.
COLUMNS = (
    ("items/s", "items_per_s", "{:.2f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("padding", "padding_ratio", "{:.1%}"),
    ("tokens/ticket", "tokens_per_ticket", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("forwards", "forwards", "{}"),
    ("agreement", "agreement", "{:.1%}"),
    ("max |Δp|", "max_abs_prob_diff", "{:.1e}"),
)


def _cells(row: dict, markdown: bool = False) -> list[str]:
    """One mode's figures as table cells (Markdown: × for speedup, no RSS owner)."""
    cells = [_fmt(row[key], spec.replace("x", "×") if markdown else spec) for _, key, spec in COLUMNS]
    rss = _fmt(row["peak_rss_mb"], "{:.0f}")
    if not markdown and row["rss_of"] == "worker process":
        rss += " (worker)"
    return [*cells, f"{row['disagreements_non_tie']} / {row['disagreements_near_tie']}", rss]


def print_report(console: Console, header: dict, rows: list[dict]) -> None:
    title = (
        f"ticketq bench — {header['model']} ({header['dtype']}, {header['device']}, "
        f"{header['torch_threads']} threads), {header['tickets']} tickets"
    )
    table = Table(
        title=title,
        caption=f"reference = sequential; near-tie = reference margin < "
        f"{header['tie_tolerance']:g} ({rows[0]['near_ties'] if rows else 0} tickets)",
    )
    for column in ("mode", *(name for name, _, _ in COLUMNS), "disagree (real / near-tie)", "peak RSS MB"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in rows:
        table.add_row(row["mode"], *(_cells(row) if row["status"] == "ok" else ["—"] * (len(COLUMNS) + 2)))
    console.print(table)
    console.print(f"planner: {header['autotune']['description']}")
    for note in header["notes"]:
        console.print(f"[yellow]note:[/] {note}")


def markdown_table(header: dict, rows: list[dict]) -> str:
    """The stdout table as GitHub Markdown, with the run's command and machine underneath."""
    names = [name.replace("|", "\\|") for name, _, _ in COLUMNS]
    lines = [
        "| mode | " + " | ".join(names) + " | disagreements (real / near-tie) | peak RSS MB |",
        "|---" * (len(names) + 3) + "|",
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| `{row['mode']}` | " + " | ".join(["—"] * (len(names) + 2)) + " |")
            continue
        row = token_rates(row["computed_tokens"], row["tickets"], row["seconds"]) | row  # older JSON lacks them
        lines.append(f"| `{row['mode']}` | " + " | ".join(_cells(row, markdown=True)) + " |")
    machine = header["machine"]
    flags = f", {' '.join(machine['cpu_flags'])}" if machine.get("cpu_flags") else ""
    load = header.get("load_average") or {}
    loads = (
        ", load average " + " → ".join(f"{value[0]:.2f}" for value in (load.get("start"), load.get("end")) if value)
        if any(load.values())
        else ""
    )
    lines += [
        "",
        f"{header['tickets']} tickets ({header['ticket_source']}), {header['dtype']} on {header['device']} "
        f"({machine['cpu']}{flags}, {machine.get('usable_cores', machine['cores'])} cores, {header['torch_threads']} "
        f"torch threads{loads}), torch {header['torch']}, transformers {header['transformers']}, "
        f"{header['date'][:10]}; planner: {header['autotune']['description']}.",
        "",
        f"`{header['command']}`",
        "",
    ]
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else spec.format(value)


def write_chart(path: Path, header: dict, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if r["status"] == "ok"]
    modes = [r["mode"] for r in done]
    fig, (speed, pad) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = speed.bar(modes, [r["items_per_s"] or 0 for r in done], color="tab:blue")
    speed.bar_label(bars, labels=[_fmt(r["speedup"], "{:.2f}x") for r in done])
    speed.set_ylabel("items / s")
    speed.set_title("throughput (label: speedup vs sequential)")
    bars = pad.bar(modes, [100 * (r["padding_ratio"] or 0) for r in done], color="tab:orange")
    pad.bar_label(bars, fmt="%.1f%%")
    pad.set_ylabel("padding (% of computed tokens)")
    pad.set_title("padding ratio")
    for ax in (speed, pad):
        ax.tick_params(axis="x", rotation=30)
    standin = " — STAND-IN: labels meaningless, speed real" if header["standin"] else ""
    fig.suptitle(
        f"{header['model']} {header['dtype']}/{header['device']}, {header['tickets']} tickets{standin}", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
