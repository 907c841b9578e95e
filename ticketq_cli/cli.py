"""`ticketq`: run a worker, the demo, the offline classifier, the benchmark, the gateway and its
dispatcher (`ticketq gateway`, `ticketq deliver`: the `gateway.cli` programs), or build a stand-in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ticketq.cli import CONTEXT_SETTINGS, command, error
from ticketq.exits import EXIT_USAGE
from ticketq_cli import classify_commands, fit, ops_commands
from ticketq_cli.common import (
    DEFAULT_STANDIN,
    check_model,
    cli,
    console,
    fail,
    log_to_stderr,
    read_settings,
)


@cli.command()
def worker(
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
    name: Annotated[str | None, typer.Option(help="Worker node name (default ticketq-<pid>@<host>).")] = None,
) -> None:
    """Start one worker process (one model replica) consuming the ticket queue. Configure with TICKETQ_*."""
    from worker.httpserver import port_problem

    settings = read_settings()
    check_model(settings, hub=True)  # before Celery's and the kernel probes' start-up lines
    if problem := port_problem(settings.metrics_host, settings.metrics_port):
        fail(problem)
    from worker.app import CannotStart, run_worker

    try:
        status = run_worker(settings, loglevel, name)
    except CannotStart as exc:  # Redis or the memory policy, before Celery's banner; the model's is logged
        if exc.logged:
            raise typer.Exit(EXIT_USAGE) from None
        fail(str(exc))
    if status:  # an unrecoverable error (logged by Celery): never exit 0, or a supervisor leaves it down
        raise typer.Exit(status)


@cli.command()
def standin(
    out: Annotated[Path, typer.Option(help="Directory to write.")] = DEFAULT_STANDIN,
    size: Annotated[str, typer.Option(help="full (exact Qwen2.5-0.5B architecture) or tiny.")] = "full",
    seed: Annotated[int, typer.Option(help="Weight seed: same seed, same bytes.")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Overwrite a non-empty directory that is not a stand-in.")]
    = False,
) -> None:
    """Build a Qwen2.5-0.5B-Instruct stand-in: real tokenizer and architecture, random weights (labels meaningless).
    A non-empty --out that is not a stand-in (a real model, say) is refused unless --force."""
    from ticketq_cli.standin import STANDIN_NOTE, build, overwrite_problem

    if size not in ("full", "tiny"):
        raise typer.BadParameter("size must be 'full' or 'tiny'")
    if not force and (problem := overwrite_problem(out)):
        fail(problem)
    build(size, out, seed)  # type: ignore[arg-type]
    console.print(f"stand-in written to [bold]{out}[/] — {STANDIN_NOTE}")


cli.command()(classify_commands.classify)
cli.command(name="eval")(classify_commands.evaluate)
cli.command()(fit.fit)
cli.command()(fit.synthetic)


@cli.command()
def demo(
    tickets: Annotated[int, typer.Option(help="Synthetic tickets to send.")] = 600,
    seed: Annotated[int, typer.Option(help="Synthetic ticket seed.")] = 0,
    fit: Annotated[int, typer.Option(help="First fit a label head on this many synthetic labelled tickets of "
                                     "another seed and serve it (0: zero-shot).")] = 0,
) -> None:
    """End to end: model (or the full stand-in), a worker on local Redis, N tickets, figures."""
    from ticketq_cli.demo import run_demo

    log_to_stderr()
    raise typer.Exit(run_demo(tickets, seed, console, fit))


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
        fail(f"--format {fmt}: must be table, env or json")
    current, problems = _settings_marking_invalid()
    rows = _setting_rows(current, problems)
    if fmt == "json":
        print(json.dumps({env: {"value": value, "default": default, "invalid": problems.get(env)}
                          for env, value, default, _ in rows}, indent=2))  # fmt: skip
    elif fmt == "env":
        for env, value, _, _ in rows:
            print(_env_line(env, value, problems.get(env)))
    else:
        table = Table(title="ticketq settings (environment)")
        for column in ("setting", "value", "default", "meaning"):
            table.add_column(column, overflow="fold")  # wrap long values, never cut them with "…"
        for env, value, default, meaning in rows:
            shown = f"[red]INVALID[/] {problems[env].split(': ', 1)[-1]}" if env in problems else str(value)
            table.add_row(env, shown, default, meaning)
        Console().print(table)
    if problems:  # and the usual one line per problem on stderr, exit 2
        lines = [f"{env}={why}" for env, why in problems.items()]
        fail("invalid settings:\n" + "\n".join(lines) if len(lines) > 1 else lines[0])


def _env_line(env: str, value: str | None, problem: str | None) -> str:
    """`NAME=value` quoted for a POSIX shell (`set -a; . ./env` reads it back as it was); an unset
    or invalid setting as a comment, so that feeding the lines back never sets `None` or a bad value."""
    import shlex

    if problem is not None:
        return f"# {env}: INVALID {problem}"
    return f"# {env}= (unset)" if value is None else f"{env}={shlex.quote(value)}"


def _setting_rows(current, problems: dict[str, str]) -> list[tuple[str, str | None, str, str]]:
    """(variable, effective value or None where unset, default, meaning) of every setting, URLs'
    passwords masked."""
    from ticketq.config import mask_url
    from worker.settings import Settings

    rows = []
    for name, field in Settings.model_fields.items():
        value = getattr(current, name)
        shown = mask_url(value) if isinstance(value, str) and "://" in value else value
        shown = ",".join(shown) if isinstance(shown, tuple) else None if shown is None else str(shown)
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
                    fail(f"invalid settings:\n{exc}" if len(lines) > 1 else str(exc))  # a combination: say it
                problems.update(named)
                for env in named:
                    os.environ.pop(env, None)
        fail("invalid settings")
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


@cli.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def gateway(ctx: typer.Context) -> None:
    """The HTTP gateway, as `ticketq-gateway`: the same options and exit codes (`ticketq gateway --help`)."""
    from gateway.cli import gateway_main  # its own argparse command: options and help live there

    gateway_main(ctx.args, prog="ticketq gateway")


@cli.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def deliver(ctx: typer.Context) -> None:
    """Results by webhook, as `ticketq-deliver`: the same options, repair commands and exit codes (`--help`)."""
    from gateway.cli import deliver_main

    deliver_main(ctx.args, prog="ticketq deliver")


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


cli.add_typer(ops_commands.dead, name="dead")
cli.add_typer(ops_commands.reviews, name="reviews")
for _command in (ops_commands.exporter, ops_commands.status, ops_commands.result):
    cli.command()(_command)


def main() -> None:
    command(cli, "ticketq")(prog_name="ticketq")


if __name__ == "__main__":
    main()
