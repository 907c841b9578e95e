"""The `ticketq` typer app and what its commands share: the console, settings read with one line
per bad one, failing with an exit status, the model check, logging."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from ticketq.cli import CONTEXT_SETTINGS, error
from ticketq.exits import EXIT_USAGE

cli = typer.Typer(
    help="ticketq — route support tickets with a small LLM: Redis + Celery micro-batches, length-sorted, "
    "prefix-cached, label-constrained, checked against the unbatched reference.\n\n"
    "Exit status: 0 done; 1 some tickets failed; 2 bad settings, options or input, nothing done; "
    "3 the input was read but nothing was classified (result, dead show, dead requeue: no such id); "
    "4 (status) no worker answered.",
    no_args_is_help=True,
    add_completion=False,
    context_settings=CONTEXT_SETTINGS,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
DEFAULT_STANDIN = Path("models/qwen2.5-0.5b-standin")
DEFAULT_OUT = Path("results.jsonl")
ENGINE_FLAGS = {"model": "--model", "dtype": "--dtype", "device": "--device"}


def read_settings(flags: dict[str, str] | None = None, **overrides):
    """The settings, or one line per invalid one and exit 2, before anything heavy is imported."""
    from worker.settings import SettingsError, load_settings

    try:
        return load_settings(flags, **overrides)
    except SettingsError as exc:
        fail(f"invalid settings:\n{exc}" if "\n" in str(exc) else str(exc))


def fail(message: str, status: int = EXIT_USAGE) -> NoReturn:
    error(console, message)
    raise typer.Exit(status)


def check_model(settings, hub: bool = False) -> None:
    """Refuse a model that cannot load, in one line, before any noisy start-up work: a missing
    directory, a checkpoint that is no decoder and, with `hub` (for a command that loads the model
    whatever its input), a Hub id with neither the Hub nor its cache."""
    from worker.settings import model_problem

    if settings.null_classifier:
        return
    problem = model_problem(settings.model) or (_hub_problem(settings.model) if hub else None)
    if problem:
        fail(problem)


def _hub_problem(model: str) -> str | None:
    """Why a Hub id cannot load here: the Hub does not answer and the id is not in its local cache."""
    if Path(model).expanduser().exists():
        return None
    from huggingface_hub import try_to_load_from_cache

    from worker.engine.loading import hub_reachable

    if isinstance(try_to_load_from_cache(model, "config.json"), str) or hub_reachable():
        return None
    return (f"TICKETQ_MODEL={model}: the model hub is not reachable and the model is not in its local cache; "
            f"build a stand-in (`ticketq standin --out {DEFAULT_STANDIN}`) and set TICKETQ_MODEL={DEFAULT_STANDIN}")


def log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "huggingface_hub", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
