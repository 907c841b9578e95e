"""`ticketq`: run a worker, the demo, the offline classifier, the benchmark, or build a stand-in."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

cli = typer.Typer(
    help="ticketq — route support tickets with a small LLM: Redis + Celery micro-batches, length-sorted, "
    "prefix-cached, label-constrained, checked against the unbatched reference.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console(stderr=True)
DEFAULT_STANDIN = Path("models/qwen2.5-0.5b-standin")


def _settings(**overrides):
    from worker.settings import Settings

    return Settings(**{k: v for k, v in overrides.items() if v is not None})


@cli.command()
def worker(
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
    name: Annotated[str | None, typer.Option(help="Worker node name (default ticketq-<pid>@<host>).")] = None,
) -> None:
    """Start one worker process (one model replica) consuming the ticket queue. Configure with TICKETQ_*."""
    from pydantic import ValidationError

    try:
        from worker.app import app, preflight, settings
    except ValidationError as exc:
        console.print(f"[red]invalid settings, the worker refuses to start:[/]\n{_errors(exc)}")
        raise typer.Exit(2) from None

    preflight(settings)
    argv = [
        "worker",
        f"--loglevel={loglevel}",
        "--pool=threads",
        "--concurrency=1",
        f"--queues={settings.queue}",
        f"--hostname={name or f'ticketq-{os.getpid()}@%h'}",
        "--without-gossip",
        "--without-mingle",
    ]
    app.worker_main(argv)


@cli.command()
def standin(
    out: Annotated[Path, typer.Option(help="Directory to write.")] = DEFAULT_STANDIN,
    size: Annotated[str, typer.Option(help="full (exact Qwen2.5-0.5B architecture) or tiny.")] = "full",
    seed: Annotated[int, typer.Option(help="Weight seed: same seed, same bytes.")] = 0,
) -> None:
    """Build a Qwen2.5-0.5B-Instruct stand-in: real tokenizer and architecture, random weights (labels meaningless)."""
    from worker.standin import STANDIN_NOTE, build

    if size not in ("full", "tiny"):
        raise typer.BadParameter("size must be 'full' or 'tiny'")
    build(size, out, seed)  # type: ignore[arg-type]
    console.print(f"stand-in written to [bold]{out}[/] — {STANDIN_NOTE}")


@cli.command()
def classify(
    path: Annotated[Path, typer.Argument(help="Tickets: JSONL ({'id','text'}) or CSV with id,text columns.")],
    out: Annotated[Path, typer.Option(help="Results JSONL.")] = Path("results.jsonl"),
    model: Annotated[str | None, typer.Option(help="Hub id or local dir (default TICKETQ_MODEL).")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto|float32|bfloat16|float16.")] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda|mps.")] = None,
) -> None:
    """Classify a ticket file in-process (no Redis): progress bar, results JSONL, summary."""
    from worker.engine import Engine, ModelNotFound
    from worker.offline import classify_file

    _logging()
    settings = _settings(model=model, dtype=dtype, device=device)
    try:
        engine = Engine.from_settings(settings)
    except ModelNotFound as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2) from None
    summary, errors = classify_file(engine, path, out)
    for error in errors[:20]:
        console.print(f"[yellow]skipped[/] {error}")
    table = Table(title=f"{path} → {out}")
    for column in ("tickets", "failed", "items/s", "padding", "labels"):
        table.add_column(column)
    labels = ", ".join(f"{k}={v}" for k, v in summary.labels.most_common())
    table.add_row(
        str(summary.tickets), str(summary.failed), f"{summary.items_per_s:.2f}", f"{summary.padding_ratio:.1%}", labels
    )
    console.print(table)
    if engine.info.standin:
        console.print("[yellow]stand-in model: labels are meaningless; speed is real[/]")


@cli.command()
def demo(
    tickets: Annotated[int, typer.Option(help="Synthetic tickets to send.")] = 600,
    seed: Annotated[int, typer.Option(help="Synthetic ticket seed.")] = 0,
) -> None:
    """End to end: model (or the full stand-in), a worker on local Redis, N tickets, figures."""
    from worker.demo import run_demo

    _logging()
    raise typer.Exit(run_demo(tickets, seed, console))


@cli.command()
def config(markdown: Annotated[bool, typer.Option(help="Print a Markdown table (for docs).")] = False) -> None:
    """Show every TICKETQ_* setting: its effective value, default and meaning (passwords masked)."""
    from kombu.utils.url import maybe_sanitize_url

    from worker.settings import Settings

    try:
        current = Settings()
    except ValueError as exc:
        console.print(f"[red]invalid settings:[/] {exc}")
        raise typer.Exit(2) from None
    rows = []
    for name, field in Settings.model_fields.items():
        value = getattr(current, name)
        shown = maybe_sanitize_url(value) if isinstance(value, str) and "://" in value else value
        if isinstance(shown, tuple):
            shown = ",".join(shown)
        default = ",".join(field.default) if isinstance(field.default, tuple) else field.default
        rows.append((f"TICKETQ_{name.upper()}", str(default), str(shown), field.description or ""))
    if markdown:
        print("| setting | default | meaning |\n|---|---|---|")
        for env, default, _, meaning in rows:
            print(f"| `{env}` | `{default}` | {meaning} |")
        return
    table = Table(title="ticketq settings (environment)")
    for column in ("setting", "value", "default", "meaning"):
        table.add_column(column)
    for env, default, shown, meaning in rows:
        table.add_row(env, shown, default, meaning)
    Console().print(table)


@cli.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, add_help_option=False
)
def bench(ctx: typer.Context) -> None:
    """The benchmark table: every mode side by side on the same tickets (`ticketq bench --help`)."""
    from worker.bench import main as bench_main

    raise typer.Exit(bench_main(ctx.args))


def _errors(exc) -> str:
    return "\n".join(f"  - {error['msg'].removeprefix('Value error, ')}" for error in exc.errors())


def _logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
