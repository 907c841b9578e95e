"""Conventions both command-line programs (`ticketq`, `ticketq-produce`) share: `-h`/`--version`
on every command, the list of failed rows, and the summary line of a file run. The exit statuses
are `ticketq.exits`'.

No torch, no worker internals: `ticketq-produce` imports it.
"""

from __future__ import annotations

import functools
import inspect
import platform
from collections import Counter
from collections.abc import Callable, Iterable
from enum import Enum
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperArgument, TyperOption

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}
MAX_SHOWN = 20


def version_line(prog: str) -> str:
    try:
        ours = version("ticketq")
    except PackageNotFoundError:  # running from a source tree that was never installed
        ours = "unknown"
    return f"{prog} {ours} (Python {platform.python_version()}, celery {version('celery')})"


def command(app: typer.Typer, prog: str) -> Callable[..., Any]:
    """`app` as a click command with `--version` on the program and on each of its commands."""
    flag = Annotated[
        bool, typer.Option("--version", callback=_show_version(prog), is_eager=True, help="Show the version and exit.")
    ]
    _add_version(app, flag)
    built = typer.main.get_command(app)
    _reflow_help(built)
    plain_metavars(built)
    return built


def plain_metavars(command: Any) -> None:
    """Help in click's words, for `command` and every subcommand: typer 0.2x writes a type beside
    each option (`--force <bool>`, `--out <path>`) and braces around a required argument in the
    usage line (`{path}`); here a flag shows no value, an option its value as click names it
    (`--out PATH`, `--format TEXT`, `--dtype [auto|float32]`) and an argument its name (`PATH`,
    `[PATH]`, `PATHS...`)."""
    if not hasattr(TyperOption, "bare_type"):  # typer before it vendored click: click's words already
        return
    for param in getattr(command, "params", ()):
        if isinstance(param, TyperOption) and param.metavar is None:
            param.metavar = "" if param.is_flag else _value_name(param)
        elif isinstance(param, TyperArgument) and param.metavar is None:
            param.metavar = param.name.upper() + ("..." if param.nargs != 1 else "")
            param.display_type_rich = lambda ctx: None  # the name column says it
            param.get_usage_pieces = functools.partial(_argument_usage, param)
    if hasattr(command, "get_help_option"):  # made on first use: a flag too
        command.get_help_option = functools.partial(_flag_help_option, command.get_help_option)
    for sub in getattr(command, "commands", {}).values():
        plain_metavars(sub)


def _flag_help_option(made: Callable[[Any], Any], ctx: Any) -> Any:
    option = made(ctx)
    if option is not None:
        option.metavar = ""
    return option


_VALUE_NAMES = {"str": "TEXT", "int": "INTEGER", "float": "FLOAT"}  # click's names for them


def _value_name(param: TyperOption) -> str:
    if param.type_descriptor.is_path:
        return "PATH"
    choices = param.type_descriptor.annotation
    if isinstance(choices, type) and issubclass(choices, Enum):  # click's Choice: [a|b|c]
        return "[" + "|".join(str(member.value) for member in choices) + "]"
    return _VALUE_NAMES.get(param.bare_type(), param.bare_type().upper())


def _argument_usage(param: TyperArgument, ctx: object) -> list[str]:
    return [param.metavar if param.required else f"[{param.metavar}]"]


def _reflow_help(command: Any) -> None:
    """Help text as paragraphs that the terminal wraps, for `command` and every subcommand: typer
    keeps a docstring's single line breaks, which then cut sentences wherever the terminal is
    narrower or wider than the source. A line starting a list item or indented stays a line."""
    if command.help:
        command.help = "\n\n".join(_joined(paragraph) for paragraph in inspect.cleandoc(command.help).split("\n\n"))
    for sub in getattr(command, "commands", {}).values():
        _reflow_help(sub)


def _joined(paragraph: str) -> str:
    lines = paragraph.splitlines()
    out = lines[:1]
    for line in lines[1:]:
        if line.startswith(("-", "*", " ", "\b")) or out[-1].startswith("\b"):
            out.append(line)
        else:
            out[-1] = f"{out[-1]} {line}"
    return "\n".join(out)


def _add_version(app: typer.Typer, flag: object) -> None:
    """Give every command of `app` (nested groups too) a `--version` parameter, once."""
    if app.registered_callback is None:
        app.callback()(_no_options)
    infos = [app.registered_callback, *app.registered_commands]
    for info in infos:
        if info.callback is not None and not getattr(info.callback, "has_version", False):
            info.callback = _with_version(info.callback, flag)
    for group in app.registered_groups:
        _add_version(group.typer_instance, flag)


def _no_options() -> None:
    """A program without options of its own still takes --version and -h."""


def _with_version(function: Callable[..., Any], flag: object) -> Callable[..., Any]:
    signature = inspect.signature(function, eval_str=True)

    @functools.wraps(function)
    def wrapped(*args: Any, version: bool = False, **kwargs: Any) -> Any:
        return function(*args, **kwargs)  # --version acted in its callback; it is not the command's

    extra = inspect.Parameter("version", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=flag)
    wrapped.__signature__ = signature.replace(parameters=[*signature.parameters.values(), extra])  # type: ignore[attr-defined]
    wrapped.__annotations__ = {**function.__annotations__, "version": flag}
    wrapped.has_version = True  # type: ignore[attr-defined]
    return wrapped


def _show_version(prog: str) -> Callable[[bool], None]:
    def show(value: bool) -> None:
        if value:
            print(version_line(prog))
            raise typer.Exit()

    return show


def error(console: Console, message: str) -> None:
    console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def report(console: Console, lines: list[str], header: str, more_hint: str = "") -> None:
    """Print `header` and the first MAX_SHOWN lines; say how many more there are and where they are."""
    if not lines:
        return
    console.print(f"[yellow]{escape(header)}[/]", highlight=False, soft_wrap=True)
    for line in lines[:MAX_SHOWN]:
        console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
    if len(lines) > MAX_SHOWN:
        console.print(f"  ... and {len(lines) - MAX_SHOWN} more{more_hint}", highlight=False, markup=False)


def summary_line(rows: Iterable[dict]) -> tuple[str, int, int]:
    """`read N rows: X ok, Y failed (count reason, ...)` for a results file's rows, and (ok, failed)."""
    rows = list(rows)
    ok = sum(row.get("status") == "ok" for row in rows)
    reasons = Counter(str(row.get("reason") or row.get("status")) for row in rows if row.get("status") != "ok")
    detail = f" ({', '.join(f'{count} {reason}' for reason, count in reasons.most_common())})" if reasons else ""
    return f"read {len(rows)} rows: {ok} ok, {len(rows) - ok} failed{detail}", ok, len(rows) - ok
