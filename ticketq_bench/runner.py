"""How the benchmark runs: the tickets and the model loaded once, then every mode in rounds on the same tickets.

`setup` builds the settings, the engine and (unless told not to) the autotuned cost model;
`run_modes` runs the modes interleaved, round after round (A B C A B C …), each after a warm-up
on the shortest tickets, timing it and reading its peak RSS, and calls back after every mode so
that the outputs on disk always hold what has finished. Each mode is a `ModeRun`
(`ticketq_bench.modes`; the schema modes' `FieldsRun` in `ticketq_bench.multifield`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ticketq_bench.header import describe_cost, load_average
from ticketq_bench.modes import InProcessRun, ModeRun, PeerRun, RunContext
from ticketq_bench.multifield import FieldsRun
from ticketq_bench.queue_mode import QueueRun
from ticketq_bench.records import FIELD_MODES, PEER_MODES, SCHEMA_MODES, Bench, ModeResult, Options

# ----- set-up -------------------------------------------------------------------------------


def load_tickets(options: Options, console: Console) -> list[dict] | None:
    """`[{"id", "text"}]`: synthetic long-tail tickets, or the good rows of `--tickets-file`."""
    if options.tickets_file is None:
        from producer.synthetic import generate_tickets

        tickets = generate_tickets(options.tickets, seed=options.seed)
        return with_duplicates(tickets, options.duplicates, options.seed) if options.duplicates else tickets
    from producer.ticketfile import read_tickets
    from producer.ticketrows import TicketFileError

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


def with_duplicates(tickets: list[dict], share: float, seed: int) -> list[dict]:
    """`tickets` with `share` of them replaced by exact copies of the others' texts (each keeps its
    own id), in a seeded random order: an outage's flood, a customer who sends twice."""
    import random

    rng = random.Random(seed)
    unique = tickets[: max(1, round(len(tickets) * (1 - share)))]
    copies = [{"id": ticket["id"], "text": rng.choice(unique)["text"]} for ticket in tickets[len(unique):]]
    mixed = unique + copies
    rng.shuffle(mixed)
    return mixed


def setup(options: Options, console: Console) -> Bench | None:
    """Settings from TICKETQ_* plus the options, the engine (loaded once), and the autotune."""
    from worker.engine import ModelNotFound
    from worker.engine.replicas import load_engine

    settings = _settings(options, console)
    schema = _schema(options, console)
    if settings is None or schema is False:
        return None
    with console.status(f"loading {settings.model}…"):
        try:
            engine = load_engine(settings)
        except ModelNotFound as exc:
            console.print(f"[red]{exc}[/]")
            return None
    bench = Bench(engine, settings, options, schema=schema)
    if options.no_autotune or options.max_batch_tokens:
        reason = "--max-batch-tokens given" if options.max_batch_tokens else "--no-autotune"
        console.print(f"autotune skipped ({reason}): {describe_cost(engine)}")
        return bench
    from worker.engine.autotune import autotune

    with console.status(f"autotuning the cost model ({options.autotune_s:.0f} s budget)…"):
        bench.tuning = autotune(engine, budget_s=options.autotune_s)
    console.print(f"autotune on {engine.info.device}/{engine.info.dtype}: {bench.tuning.describe()}")
    return bench


def _schema(options: Options, console: Console):
    """The schema of `--schema` (None without one), or False where it cannot be used (printed why)."""
    if options.schema is None:
        return None
    from ticketq.schema import SchemaError, load_schema

    try:
        return load_schema(options.schema)
    except SchemaError as exc:
        console.print(f"[red]--schema {options.schema}:[/]\n{escape(str(exc))}", soft_wrap=True)
        return False


def _settings(options: Options, console: Console):
    """TICKETQ_* with the command line's model options on top, or None (printed why)."""
    from pydantic import ValidationError

    from worker.settings import Settings

    # the engine every mode builds on runs float32 unless told otherwise (`ticketq` is the exact row;
    # ticketq-checked adds the fast precision), and answers unchecked in what it was told
    overrides = {
        "model": options.model,
        "dtype": options.dtype or "float32",
        "recheck": "never",
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


def run_modes(
    bench: Bench, tickets: list[dict], console: Console, after_mode: Callable[[list[ModeResult]], None] | None = None
) -> list[ModeResult]:
    """Every mode of the options on the same tickets, interleaved in `options.rounds` rounds.

    Each mode starts on its first round (a peer's process, the queue's worker) and stays up to the
    last; a mode that was skipped or crashed is left out of the rounds after. `after_mode(results)`
    is called after every mode of every round with the results so far, in mode order.
    """
    texts = [t["text"] for t in tickets]
    encoded = bench.engine.encode(texts)
    bench.ticket_lengths = [e.ticket_tokens for e in encoded]
    by_length = sorted(range(len(texts)), key=lambda i: len(encoded[i].ids))
    warm = [by_length[i] for i in range(min(bench.options.warmup, len(texts)))]  # shortest: warms kernels, costs little
    context = RunContext(bench, tickets, texts, encoded, warm, console)
    runs = [_mode_run(context, mode) for mode in bench.options.mode_list]
    bench.load_before = load_average()
    rounds = bench.options.rounds
    try:
        for number in range(1, rounds + 1):
            bench.round_loads.append(load_average())
            for run in runs:
                if run.result.skipped or run.result.crashed:
                    continue
                console.rule(f"{run.result.mode} — round {number}/{rounds}" if rounds > 1 else run.result.mode)
                run.run_round(number, load_average())
                if after_mode:
                    after_mode([r.result for r in runs if r.started])
    finally:
        for run in runs:
            run.close()
    return [run.result for run in runs]


def _mode_run(context: RunContext, mode: str) -> ModeRun:
    if mode == "ticketq-queue":
        return QueueRun(context, mode)
    if mode in PEER_MODES:
        return PeerRun(context, mode)
    if mode in FIELD_MODES or mode in SCHEMA_MODES:
        return FieldsRun(context, mode)
    return InProcessRun(context, mode)
