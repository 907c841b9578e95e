"""`ticketq`: run a worker, the demo, the offline classifier, the benchmark, or build a stand-in."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from producer.clitools import (
    CONTEXT_SETTINGS,
    EXIT_FAILED,
    EXIT_USAGE,
    command,
    error,
    exit_status,
    report,
)
from producer.tickets import OutputError, PartialResults, TicketFileError, TicketReader, check_output

cli = typer.Typer(
    help="ticketq — route support tickets with a small LLM: Redis + Celery micro-batches, length-sorted, "
    "prefix-cached, label-constrained, checked against the unbatched reference.\n\n"
    "Exit status: 0 done; 1 some tickets failed; 2 bad settings, options or input, nothing done; "
    "3 the input was read but nothing was classified.",
    no_args_is_help=True,
    add_completion=False,
    context_settings=CONTEXT_SETTINGS,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
DEFAULT_STANDIN = Path("models/qwen2.5-0.5b-standin")
DEFAULT_OUT = Path("results.jsonl")
ENGINE_FLAGS = {"model": "--model", "dtype": "--dtype", "device": "--device"}


def _settings(flags: dict[str, str] | None = None, **overrides):
    """The settings, or one line per invalid one and exit 2, before anything heavy is imported."""
    from worker.settings import SettingsError, load_settings

    try:
        return load_settings(flags, **overrides)
    except SettingsError as exc:
        _fail(f"invalid settings:\n{exc}" if "\n" in str(exc) else str(exc))


def _fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
    error(console, message)
    raise typer.Exit(status)


def _check_model(settings) -> None:
    from worker.settings import model_problem

    problem = None if settings.null_classifier else model_problem(settings.model)
    if problem:
        _fail(problem)


@cli.command()
def worker(
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
    name: Annotated[str | None, typer.Option(help="Worker node name (default ticketq-<pid>@<host>).")] = None,
) -> None:
    """Start one worker process (one model replica) consuming the ticket queue. Configure with TICKETQ_*."""
    from worker.metrics import port_problem

    settings = _settings()
    _check_model(settings)
    if problem := port_problem(settings.metrics_host, settings.metrics_port):
        _fail(problem)
    from worker.app import CannotStart, run_worker

    try:
        run_worker(settings, loglevel, name)
    except CannotStart as exc:  # Redis or the memory policy, before Celery's banner; the model's is logged
        if exc.logged:
            raise typer.Exit(EXIT_USAGE) from None
        _fail(str(exc))


@cli.command()
def standin(
    out: Annotated[Path, typer.Option(help="Directory to write.")] = DEFAULT_STANDIN,
    size: Annotated[str, typer.Option(help="full (exact Qwen2.5-0.5B architecture) or tiny.")] = "full",
    seed: Annotated[int, typer.Option(help="Weight seed: same seed, same bytes.")] = 0,
) -> None:
    """Build a Qwen2.5-0.5B-Instruct stand-in: real tokenizer and architecture, random weights (labels meaningless)."""
    from ticketq_cli.standin import STANDIN_NOTE, build

    if size not in ("full", "tiny"):
        raise typer.BadParameter("size must be 'full' or 'tiny'")
    build(size, out, seed)  # type: ignore[arg-type]
    console.print(f"stand-in written to [bold]{out}[/] — {STANDIN_NOTE}")


@cli.command()
def classify(
    path: Annotated[Path, typer.Argument(help="Tickets: JSONL ({'id','text'}) or CSV with id,text columns.")],
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help=f"Results JSONL, a row per input row \\[default: {DEFAULT_OUT}].")
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", "-f", help="Replace --out if it exists; start again over a stopped run.")
    ] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue a stopped run from OUT.partial (its rows are kept).")
    ] = False,
    fmt: Annotated[str, typer.Option("--format", help="auto (by extension, then content), jsonl or csv.")] = "auto",
    schema_path: Annotated[Path | None, typer.Option("--schema", help="Answer every field of this schema (TOML), "
                           "in the worker's result shape, instead of TICKETQ_LABELS.")] = None,
    model: Annotated[str | None, typer.Option(help="Hub id or local dir (default TICKETQ_MODEL).")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto|float32|bfloat16|float16|int8.")] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda|mps.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
) -> None:
    """Classify a ticket file in-process (no Redis): every input row gets one result row (ok or failed).

    The file is read and classified a chunk at a time; result rows go to OUT.partial as they are
    done, and it becomes OUT once every row is in. Stopped (Ctrl-C: exit status 130), a run keeps
    its rows there, and --resume continues it.
    """
    settings = _settings(ENGINE_FLAGS, model=model, dtype=dtype, device=device)
    schema = _schema_option(schema_path)
    if fmt not in ("auto", "jsonl", "csv"):
        _fail(f"--format {fmt}: must be auto, jsonl or csv")
    try:
        out = check_output(out or DEFAULT_OUT, [path], force)
        reader = TicketReader(path, fmt, settings.max_ticket_bytes)  # type: ignore[arg-type]
    except (TicketFileError, OutputError) as exc:
        _fail(str(exc))
    with reader:
        _check_model(settings)
        from ticketq_cli.offline import Summary

        summary = Summary()
        try:
            partial = PartialResults(out, path, resume=resume, force=force, on_row=summary.add)
        except OutputError as exc:
            _fail(str(exc))
        if resume:
            done = f"{partial.rows} rows of {partial.path} kept" if partial.resumed else f"no {partial.path}"
            console.print(f"resuming: {done}; classifying the rows after them", highlight=False, markup=False)
        _classify(settings, reader, partial, summary, progress, schema)
    try:
        partial.publish(overwrite=force)
    except OutputError as exc:
        _fail(f"{exc}; all {partial.rows} rows are in {partial.path}")
    _report_classified(summary, path, out)
    raise typer.Exit(exit_status(summary.ok, summary.failed))


EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


def _classify(settings, reader: TicketReader, partial: PartialResults, summary, progress: bool, schema=None) -> None:
    """Classify the rows not yet in `partial`, loading the model only if a row needs it.

    However it stops (Ctrl-C, a crash, a model that cannot load), the rows done stay in the
    partial file and one line says how many and how to go on; with no row done, no file is left.
    """
    from ticketq_cli.offline import classify_rows

    try:
        load = (lambda: _load_engine(settings)) if schema is None else (lambda: _load_engine(settings).fields(schema))
        classify_rows(load, reader, partial, summary, progress)
    except OutputError as exc:  # --resume: the partial file is not this input's; it stays as it was
        partial.close()
        _fail(str(exc))
    except BaseException as exc:
        partial.close()
        nothing = partial.rows == 0 and not partial.resumed
        if nothing:  # nothing done leaves nothing behind: the fixed rerun needs no --resume or --force
            partial.path.unlink(missing_ok=True)
        stopped = "interrupted" if isinstance(exc, KeyboardInterrupt) else "stopped"
        if not nothing:
            console.print(f"{stopped}: {partial.rows} rows are in {partial.path}; run the same command with --resume "
                          "to classify the rest", highlight=False, markup=False, soft_wrap=True)  # fmt: skip
        elif stopped == "interrupted":
            console.print("interrupted: nothing was classified", highlight=False, markup=False)
        if isinstance(exc, KeyboardInterrupt):
            raise typer.Exit(EXIT_INTERRUPTED) from None
        raise


def _load_engine(settings):
    from ticketq.process import paused_gc
    from worker.engine.loading import ModelNotFound

    _logging()
    # torch's import and the model's load, the collector paused: the objects they make live as long
    # as this command, so they are frozen rather than scanned by every later collection.
    with paused_gc(freeze=True):
        from worker.engine import Engine

        try:
            engine = Engine.from_settings(settings)
        except ModelNotFound as exc:
            _fail(str(exc))
    if engine.info.standin:
        console.print("[yellow]stand-in model: labels are meaningless; speed is real[/]")
    return engine


def _report_classified(summary, path: Path, out: Path) -> None:
    report(console, summary.failures, f"{summary.failed} rows failed:", f" (every row is in {out})")
    table = Table(title=f"{path} → {out}")
    for column in ("rows", "ok", "failed", "items/s", "padding", "labels"):
        table.add_column(column, overflow="fold")
    labels = ", ".join(f"{k}={v}" for k, v in summary.labels.most_common())
    table.add_row(str(summary.rows), str(summary.ok), str(summary.failed), f"{summary.items_per_s:.2f}",
                  f"{summary.padding_ratio:.1%}", labels)  # fmt: skip
    console.print(table)
    console.print(f"{summary.line()}; results in {out}", highlight=False, markup=False, soft_wrap=True)


@cli.command(name="eval")
def evaluate(
    path: Annotated[Path, typer.Argument(help="Labelled tickets: JSONL or CSV rows with text and expected.")],
    fmt: Annotated[str, typer.Option("--format", help="auto (by extension, then content), jsonl or csv.")] = "auto",
    thresholds: Annotated[
        str, typer.Option(help="Margin (confidence) thresholds for the coverage tables, comma-separated.")
    ] = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9",
    schema_path: Annotated[Path | None, typer.Option("--schema", help="Score every field of this schema "
                           "(TOML): `expected` is then {field: label} or {field: \\[labels]}.")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write every figure to this JSON file.")] = None,
    model: Annotated[str | None, typer.Option(help="Hub id or local dir (default TICKETQ_MODEL).")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto|float32|bfloat16|float16|int8.")] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda|mps.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
) -> None:
    """Score the model on your own labelled tickets: accuracy, per-label precision and recall, the
    confusion matrix, and accuracy against coverage per margin threshold (to choose a threshold).

    Each row needs an `expected` label (a field in JSONL, a column in CSV). Rows without one, and
    refused rows, are counted and not scored. Exit status 3 when no row could be scored.

    With --schema every field of the schema is scored on the rows whose `expected` object names it
    (in a CSV, the cell holds that object as JSON); a multi-label field by per-label precision and
    recall and exact-set accuracy. A row naming a field or label the schema lacks is refused.
    """
    settings = _settings(ENGINE_FLAGS, model=model, dtype=dtype, device=device)
    schema = _schema_option(schema_path)
    if fmt not in ("auto", "jsonl", "csv"):
        _fail(f"--format {fmt}: must be auto, jsonl or csv")
    try:
        cuts = sorted({float(part) for part in thresholds.split(",") if part.strip()})
    except ValueError:
        _fail(f"--thresholds {thresholds!r}: must be numbers between 0 and 1, comma-separated")
    if not cuts or not all(0 <= cut <= 1 for cut in cuts):
        _fail(f"--thresholds {thresholds!r}: must be numbers between 0 and 1, comma-separated")
    try:
        reader = TicketReader(path, fmt, settings.max_ticket_bytes)  # type: ignore[arg-type]
    except TicketFileError as exc:
        _fail(str(exc))
    with reader:
        _check_model(settings)
        engine = _load_engine(settings)
        from tqdm import tqdm

        from ticketq_cli.evaluate import evaluate as run_eval
        from ticketq_cli.evaluate import evaluate_fields

        with tqdm(desc="scoring", unit="row", disable=not progress, file=None) as bar:
            if schema is None:
                evaluation = run_eval(engine, reader, on_chunk=bar.update)
            else:
                evaluation = evaluate_fields(engine.fields(schema), reader, on_chunk=bar.update)
    _report_evaluation(evaluation, cuts, engine.info.standin, json_out)
    if evaluation.scored == 0:
        raise typer.Exit(3)


def _schema_option(path: Path | None):
    """`--schema`: the schema, or one line per problem and exit 2, before the model loads."""
    if path is None:
        return None
    from ticketq.schema import SchemaError, load_schema

    try:
        return load_schema(path)
    except SchemaError as exc:
        _fail(f"--schema {path}:\n{exc}" if len(exc.problems) > 1 else f"--schema {exc}")


def _report_evaluation(evaluation, cuts: list[float], standin: bool, json_out: Path | None) -> None:
    from ticketq_cli.evaluate import FieldsEvaluation, print_fields, print_scores

    out = Console()
    report(console, evaluation.refused, f"{len(evaluation.refused)} rows refused (not scored):")
    if isinstance(evaluation, FieldsEvaluation):
        print_fields(out, evaluation, cuts)
        figures = evaluation.as_dict(cuts)
    else:
        scores = evaluation.scores
        if scores.unknown:
            unknown = ", ".join(f"{label!r} x{count}" for label, count in scores.unknown.most_common())
            console.print(f"not scored: expected labels the model does not have: {unknown} (labels: "
                          f"{', '.join(scores.labels)})", highlight=False, markup=False, soft_wrap=True)  # fmt: skip
        out.print(f"scored {scores.scored} of {evaluation.rows} rows ({evaluation.unlabelled} without `expected`); "
                  f"accuracy {scores.accuracy:.1%}", highlight=False)  # fmt: skip
        print_scores(out, scores, cuts)
        figures = {**scores.as_dict(cuts), "rows": evaluation.rows, "unlabelled": evaluation.unlabelled,
                   "refused": len(evaluation.refused)}  # fmt: skip
    if standin:
        console.print("[yellow]stand-in model (random weights): these figures mean nothing about a real model[/]")
    if json_out is not None:
        json_out.write_text(json.dumps({**figures, "standin": standin}, indent=2) + "\n", encoding="utf-8")


@cli.command()
def demo(
    tickets: Annotated[int, typer.Option(help="Synthetic tickets to send.")] = 600,
    seed: Annotated[int, typer.Option(help="Synthetic ticket seed.")] = 0,
) -> None:
    """End to end: model (or the full stand-in), a worker on local Redis, N tickets, figures."""
    from ticketq_cli.demo import run_demo

    _logging()
    raise typer.Exit(run_demo(tickets, seed, console))


@cli.command()
def config(
    fmt: Annotated[str | None, typer.Option("--format", help="table, env (NAME=value lines, for grep and shells) or "
                   "json. Default: table on a terminal, env when piped.")] = None,
    markdown: Annotated[bool, typer.Option(help="Print a Markdown table (for docs).")] = False,
) -> None:
    """Show every TICKETQ_* setting: its effective value, default and meaning (passwords masked).
    Invalid ones are marked, with what is allowed, and the exit status is then 2."""
    if markdown:
        from ticketq_cli.docgen import settings_table

        print(settings_table())
        return
    import sys

    fmt = fmt or ("table" if sys.stdout.isatty() else "env")
    if fmt not in ("table", "env", "json"):
        _fail(f"--format {fmt}: must be table, env or json")
    current, problems = _settings_marking_invalid()
    rows = _setting_rows(current, problems)
    if fmt == "json":
        print(json.dumps({env: {"value": value, "default": default, "invalid": problems.get(env)}
                          for env, value, default, _ in rows}, indent=2))  # fmt: skip
    elif fmt == "env":
        for env, value, _, _ in rows:
            print(f"# {env}: INVALID {problems[env]}" if env in problems else f"{env}={value}")
    else:
        table = Table(title="ticketq settings (environment)")
        for column in ("setting", "value", "default", "meaning"):
            table.add_column(column, overflow="fold")  # wrap long values, never cut them with "…"
        for env, value, default, meaning in rows:
            shown = f"[red]INVALID[/] {problems[env].split(': ', 1)[-1]}" if env in problems else value
            table.add_row(env, shown, default, meaning)
        Console().print(table)
    if problems:  # and the usual one line per problem on stderr, exit 2
        lines = [f"{env}={why}" for env, why in problems.items()]
        _fail("invalid settings:\n" + "\n".join(lines) if len(lines) > 1 else lines[0])


def _setting_rows(current, problems: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """(variable, effective value, default, meaning) of every setting, URLs' passwords masked."""
    from ticketq.config import mask_url
    from worker.settings import Settings

    rows = []
    for name, field in Settings.model_fields.items():
        value = getattr(current, name)
        shown = mask_url(value) if isinstance(value, str) and "://" in value else value
        shown = ",".join(shown) if isinstance(shown, tuple) else str(shown)
        default = ",".join(field.default) if isinstance(field.default, tuple) else field.default
        rows.append((f"TICKETQ_{name.upper()}", shown, str(default), field.description or ""))
    return rows


def _settings_marking_invalid():
    """The settings with every invalid TICKETQ_* variable left out, and {variable: what is wrong}."""
    import os

    from worker.settings import Settings, SettingsError, load_settings

    problems: dict[str, str] = {}
    saved = dict(os.environ)
    try:
        for _ in Settings.model_fields:  # each round drops the variables named invalid
            try:
                return load_settings(), problems
            except SettingsError as exc:
                lines = str(exc).splitlines()
                named = {line.split("=", 1)[0]: line.split("=", 1)[1]
                         for line in lines if line.startswith("TICKETQ_")}  # fmt: skip
                if not named.keys() - problems.keys() or not named.keys() <= os.environ.keys():
                    _fail(f"invalid settings:\n{exc}" if len(lines) > 1 else str(exc))  # a combination: say it
                problems.update(named)
                for env in named:
                    os.environ.pop(env, None)
        _fail("invalid settings")
    finally:
        os.environ.clear()
        os.environ.update(saved)


@cli.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def bench(ctx: typer.Context) -> None:
    """The benchmark table: every mode side by side on the same tickets (`ticketq bench --help`)."""
    from ticketq_bench.cli import main as bench_main  # its own typer command: options and help live there

    raise typer.Exit(bench_main(ctx.args))


@cli.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def loadtest(ctx: typer.Context) -> None:
    """Open-loop load test: Poisson arrivals at fractions of capacity, latency vs load (`ticketq loadtest --help`)."""
    from ticketq_bench.loadtest import main as loadtest_main

    raise typer.Exit(loadtest_main(ctx.args))


schema_cli = typer.Typer(help="Triage schemas (TOML): check a file before a worker serves it.",
                         no_args_is_help=True, context_settings=CONTEXT_SETTINGS)  # fmt: skip
cli.add_typer(schema_cli, name="schema")


@schema_cli.command("check")
def schema_check(paths: Annotated[list[Path], typer.Argument(help="Schema files (TOML).")]) -> None:
    """Load each schema as the worker does: one line per schema that is good (its fields and
    labels), one line per problem of one that is not (exit status 2)."""
    from ticketq.schema import SchemaError, load_schema

    bad = False
    for path in paths:
        try:
            schema = load_schema(path)
        except SchemaError as exc:
            bad = True
            for problem in exc.problems:
                error(console, problem)
            continue
        fields = ", ".join(f"{spec.name} ({'multi-label, ' if spec.multi else ''}{len(spec.labels)} labels)"
                           for spec in schema.fields)  # fmt: skip
        print(f"{path}: schema {schema.name!r}, {len(schema.fields)} field(s): {fields}")
    if bad:
        raise typer.Exit(EXIT_USAGE)


dead = typer.Typer(help="Dead letters (stream ticketq:dead): list, show, requeue once the cause is fixed.",
                   no_args_is_help=True, context_settings=CONTEXT_SETTINGS)  # fmt: skip
cli.add_typer(dead, name="dead")


@contextmanager
def _ops():
    """The operator commands' Ops on a broker that answers (else one line naming it), closed after."""
    from producer.api import BrokerUnavailable
    from ticketq_cli.ops import Ops

    ops = Ops(_settings())
    try:
        ops.redis.ping()
    except Exception as exc:  # redis-py and socket errors alike: report the broker, not a traceback
        ops.close()
        _fail(str(BrokerUnavailable(ops.settings.broker_url, exc)))
    try:
        yield ops
    finally:
        ops.close()


@cli.command()
def exporter(
    port: Annotated[int, typer.Option(help="Port to serve /metrics on.")] = 9809,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0 in a container).")] = "127.0.0.1",
    queues: Annotated[
        list[str] | None,
        typer.Option("--queue", metavar="QUEUE", help="A queue to watch; repeat for several (default: TICKETQ_QUEUE)."),
    ] = None,
) -> None:
    """Export each queue's depth (`ticketq_queue_depth{queue}`), the dead-letter and results streams'
    lengths and the live consumers from Redis alone, for Prometheus: the backlog stays visible with
    every worker down."""
    from ticketq.connections import RedisUnavailable, connect
    from ticketq_cli.exporter import exporter_server
    from worker.metrics import MetricsPortInUse

    settings = _settings()
    try:
        client = connect(settings.broker_url, **settings.sentinel, retries=3)
        server = exporter_server(client, queues or [settings.queue], host, port)
    except RedisUnavailable as exc:
        _fail(str(exc))
    except MetricsPortInUse:
        _fail(f"--port {port}: cannot listen on {host}:{port} (in use, or not allowed); pass another --port")
    _logging()
    watched = ", ".join(queues or [settings.queue])
    logging.getLogger(__name__).info("exporting queues %s on http://%s:%d/metrics", watched, host, port)
    with suppress(KeyboardInterrupt):
        server.serve_forever()


@cli.command()
def status(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Queue depth, in-flight messages, live workers (Celery ping), dead letters by reason, results
    stream, Redis's memory and whether it kept its data. Exit status 1 when no worker answered the
    ping (or none could be asked: a full Redis refuses the ping's writes), 2 when Redis is
    unreachable; with --json, 0 whenever Redis answered."""
    from ticketq_cli.ops import redis_data_line

    with _ops() as ops:
        state = ops.status()
    if as_json:
        print(json.dumps(state))
        return
    shown_state = {**state, "redis_data": redis_data_line(state["redis_data"])}
    if "workers_unknown" in shown_state:
        shown_state["workers"] = f"unknown, {shown_state.pop('workers_unknown')}"
    for key, value in shown_state.items():
        shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
        shown = ", ".join(shown) if isinstance(shown, list) else shown
        print(f"{key.replace('_', ' ')}: {shown if shown not in ('', None) else 'none'}")
    if not state["workers"]:
        raise typer.Exit(EXIT_FAILED)  # nothing is consuming the queue (or nobody could ask): worth a non-zero status


@dead.command("list")
def dead_list(reason: Annotated[str | None, typer.Option(help="Only this reason.")] = None) -> None:
    """One line per dead letter: entry id, reason, task id, error; a requeued one awaiting its
    result says so (a letter leaves the list once its re-sent task is answered)."""
    with _ops() as ops:
        for letter in ops.dead_letters(reason):
            requeued = f"  [requeued as {letter.requeued_as}, awaiting its result]" if letter.requeued_as else ""
            cut = "  [payload truncated: not requeueable]" if letter.truncated else ""
            error_text = letter.fields.get("error", "")
            print(f"{letter.entry_id}  {letter.reason}  {letter.task_id}  {error_text}{requeued}{cut}")


@dead.command("show")
def dead_show(key: Annotated[str, typer.Argument(help="Stream entry id or task id.")]) -> None:
    """Every field of a dead letter, its payload decoded."""
    with _ops() as ops:
        letters = ops.find_dead(key)
    if not letters:
        _fail(f"no dead letter with entry id or task id {key}", EXIT_FAILED)
    for letter in letters:
        fields = {k: v for k, v in letter.fields.items() if k not in ("payload", "payload_b64")}
        fields.update({"requeued_as": letter.requeued_as} if letter.requeued_as else {})
        payload = letter.payload
        shown = payload.decode("utf-8", "backslashreplace") if isinstance(payload, bytes) else payload
        print(json.dumps({"entry_id": letter.entry_id, **fields, "payload": shown}, indent=2, ensure_ascii=False))


@dead.command("requeue")
def dead_requeue(
    keys: Annotated[list[str] | None, typer.Argument(help="Stream entry ids or task ids.")] = None,
    reason: Annotated[str | None, typer.Option(help="Every dead letter with this reason.")] = None,
) -> None:
    """Re-send dead letters with their original task id (a ticket of a pack: <task id>:<slot>).

    A letter stays listed until its re-sent task has a result (then any dead-letter command drops
    it). Nothing is sent for a ticket that already has a result, for a payload cut when it was
    dead-lettered, nor for a ticket that can never succeed (empty text, a wrong type); each says so
    (exit status 1, or 3 when nothing was re-sent, also when nothing matched)."""
    from ticketq_cli.ops import NotRequeueable

    if not keys and not reason:
        _fail("name dead letters to requeue (entry or task ids) or pass --reason")
    failed = 0
    with _ops() as ops:
        letters = ops.dead_letters(reason) if reason else [x for key in keys or [] for x in ops.find_dead(key)]
        if not letters:
            wanted = f"with reason {reason}" if reason else "with entry id or task id " + ", ".join(keys or [])
            error(console, f"no dead letter {wanted}: nothing re-sent (`ticketq dead list` shows them)")
        for letter in letters:
            try:
                print(f"requeued {letter.entry_id} as task {ops.requeue(letter)} (listed until it is answered)")
            except NotRequeueable as exc:
                failed += 1
                error(console, f"{letter.entry_id}: {exc}")
    raise typer.Exit(exit_status(len(letters) - failed, failed))


@cli.command()
def result(key: Annotated[str, typer.Argument(help="Task id or ticket id.")]) -> None:
    """Look up results by task id or ticket id (results stream, then the Celery result backend)."""
    with _ops() as ops:
        found = ops.result(key)
    if not found:
        _fail(f"no result for {key} (not in the results stream, pending or expired in the backend)", EXIT_FAILED)
    for row in found:
        print(json.dumps(row, ensure_ascii=False))


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main() -> None:
    command(cli, "ticketq")(prog_name="ticketq")


if __name__ == "__main__":
    main()
