"""`ticketq-produce`: enqueue tickets from a file or a synthetic generator, optionally wait for results.

Thin glue over `producer.api.Producer`: read and validate input, send with a progress bar,
collect with a progress bar, print a summary, write results JSONL.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from producer.api import BrokerUnavailable, Producer
from producer.clitools import (
    CONTEXT_SETTINGS,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    command,
    exit_status,
    report,
    summary_line,
)
from producer.synthetic import generate_tickets
from producer.tickets import OutputError, TicketFile, TicketFileError, check_output, read_tickets, write_results
from ticketq.config import ClientSettings, SettingsError, mask_url
from ticketq.contract import TicketRejected, validate_ticket

EXIT_PROBLEMS = EXIT_FAILED  # some tickets were rejected, failed or timed out
EXIT_UNUSABLE = EXIT_USAGE  # bad configuration, unreadable input, Redis unreachable

app = typer.Typer(
    name="ticketq-produce",
    help=(
        "Send support tickets to ticketq workers through Redis and, with --wait, collect the labels.\n\n"
        "Configuration comes from TICKETQ_* environment variables (TICKETQ_BROKER_URL, "
        "TICKETQ_RESULT_BACKEND, TICKETQ_QUEUE, TICKETQ_MAX_TICKET_BYTES, ...); --broker-url and "
        "--backend-url override them.\n\n"
        "Exit status: 0 all tickets sent (and, with --wait, classified); 1 some tickets were rejected, "
        "failed or timed out; 2 nothing could be done (bad settings, unreadable file, Redis unreachable); "
        "3 the input was read but no ticket was sent (or, with --wait, classified)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT_SETTINGS,
)
out_console = Console()
err_console = Console(stderr=True)

Pack = Annotated[
    int,
    typer.Option(
        "--pack", "-k", min=1,
        help="Tickets per Celery message. 1 sends one message per ticket; larger packs cut broker "
        "round trips for bulk loads (the worker still batches across messages).",
    ),
]
Wait = Annotated[bool, typer.Option("--wait", "-w", help="Wait for every result and print a summary.")]
Out = Annotated[
    Path | None,
    typer.Option("--out", "-o", dir_okay=False, help="Write per-ticket results as JSONL (implies --wait); "
                 "one row per input row, malformed and rejected ones included."),
]
Force = Annotated[bool, typer.Option("--force", "-f", help="Replace --out if it exists.")]
Timeout = Annotated[
    float,
    typer.Option("--timeout", min=0.1, help="Seconds to wait for all results, overall; late ones count as timeout."),
]
ResendAfter = Annotated[
    float | None,
    typer.Option("--resend-after", min=0.1, help="While waiting, re-send a message that has no result after this "
                 "many seconds, with the same task id (the worker publishes each ticket once). Covers a message "
                 "lost on its way, e.g. by a Redis that lost its last writes."),
]
BrokerUrl = Annotated[
    str | None,
    typer.Option("--broker-url", help="Redis broker URL, e.g. redis://:password@host:6379/0 "
                 "(default: TICKETQ_BROKER_URL)."),
]
BackendUrl = Annotated[
    str | None,
    typer.Option("--backend-url", help="Result backend URL (default: TICKETQ_RESULT_BACKEND, else the broker)."),
]
Progress = Annotated[bool, typer.Option("--progress/--no-progress", help="Show progress bars on stderr.")]


@dataclass
class RunOptions:
    pack: int
    wait: bool
    out: Path | None
    timeout: float
    progress: bool
    force: bool = False
    resend_after: float | None = None


@dataclass
class Collected:
    """Results as they arrive, with the time of the last one (for throughput)."""

    results: list[dict] = field(default_factory=list)
    last_at: float | None = None

    def add(self, tickets: list[dict]) -> None:
        self.results.extend(tickets)
        self.last_at = time.monotonic()


@app.command("file")
def file_command(
    path: Annotated[Path, typer.Argument(help="Tickets as JSONL ({\"id\", \"text\"} per line, id optional) "
                                         "or CSV with a header naming 'text' (and optionally 'id').")],
    fmt: Annotated[str, typer.Option("--format", help="auto (by extension, then content), jsonl or csv.")] = "auto",
    pack: Pack = 1,
    wait: Wait = False,
    out: Out = None,
    force: Force = False,
    timeout: Timeout = 600.0,
    resend_after: ResendAfter = None,
    broker_url: BrokerUrl = None,
    backend_url: BackendUrl = None,
    progress: Progress = True,
) -> None:
    """Send the tickets in a JSONL or CSV file. Malformed rows are reported with file:line, not sent,
    and (with --out) written as failed rows."""
    settings = _settings(broker_url, backend_url)
    if fmt not in ("auto", "jsonl", "csv"):
        _exit_error(f"--format {fmt}: must be auto, jsonl or csv")
    try:
        if out:
            check_output(out, [path], force)
        parsed = read_tickets(path, fmt, settings.max_ticket_bytes)  # type: ignore[arg-type]
    except (TicketFileError, OutputError) as exc:
        _exit_error(str(exc))
    _report_errors([str(error) for error in parsed.errors], f"{len(parsed.errors)} rows refused, not sent:",
                   _kept_hint(out))  # fmt: skip
    options = RunOptions(pack, wait, out, timeout, progress, force, resend_after)
    raise typer.Exit(_run(parsed.tickets, options, settings, parsed))


@app.command("synthetic")
def synthetic_command(
    n: Annotated[int, typer.Argument(min=1, help="How many synthetic tickets to send.")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives the same tickets.")] = 0,
    pack: Pack = 1,
    wait: Wait = False,
    out: Out = None,
    force: Force = False,
    timeout: Timeout = 600.0,
    resend_after: ResendAfter = None,
    broker_url: BrokerUrl = None,
    backend_url: BackendUrl = None,
    progress: Progress = True,
) -> None:
    """Send N generated tickets with known labels (long-tailed lengths, unicode, code, injections).

    With --wait the summary also shows agreement with the generator's expected labels.
    """
    settings = _settings(broker_url, backend_url)
    try:
        if out:
            check_output(out, (), force)
    except OutputError as exc:
        _exit_error(str(exc))
    tickets = generate_tickets(n, seed=seed, labels=settings.label_names)
    options = RunOptions(pack, wait, out, timeout, progress, force, resend_after)
    raise typer.Exit(_run(tickets, options, settings))


def _settings(broker_url: str | None = None, backend_url: str | None = None) -> ClientSettings:
    """The client settings with the URL options applied and validated, or one line per problem and exit 2.

    Only what a producer uses is read: a worker-only setting is the worker's to check.
    """
    try:
        return ClientSettings.from_env({"broker_url": "--broker-url", "result_backend": "--backend-url"},
                                       broker_url=broker_url, result_backend=backend_url)  # fmt: skip
    except SettingsError as exc:
        _exit_error(str(exc))


def _exit_error(message: str) -> NoReturn:
    _error(message)
    raise typer.Exit(EXIT_UNUSABLE)


def _kept_hint(out: Path | None) -> str:
    return f"; every row is in {out}" if out else "; pass --out FILE to keep every row"


def _run(tickets: list[dict], options: RunOptions, settings: ClientSettings, source: TicketFile | None = None) -> int:
    """Validate, send, optionally collect, write the results file; returns the exit status."""
    producer = Producer(settings)
    try:
        good, refused = _validate(tickets, settings.max_ticket_bytes)
        _report_errors([f"{row['id']}: {row['error']}" for row in refused],
                       f"{len(refused)} tickets rejected, not sent:", _kept_hint(options.out))  # fmt: skip
        malformed = len(source.errors) if source else 0
        results = None
        if good:
            producer.check_connection()
            results = _send_and_collect(producer, good, malformed + len(refused), options)
        else:
            _error("no valid tickets to send")
    except BrokerUnavailable as exc:  # this command has the options too: name them
        _error(str(exc).replace(BrokerUnavailable.fix, f"{BrokerUnavailable.fix}, or pass --broker-url"))
        return EXIT_UNUSABLE
    finally:
        producer.close()
    return _finish(refused + (results or []), options, source, sent=len(good), waited=results is not None)


def _finish(results: list[dict], options: RunOptions, source: TicketFile | None, sent: int, waited: bool) -> int:
    """Write every row (--out), print the summary line, and turn the outcome into the exit status."""
    rows = source.results_in_order(results) if source else results
    if options.out and (waited or not sent):
        try:
            count = write_results(options.out, rows, overwrite=options.force)
        except OutputError as exc:
            _error(str(exc))
            return EXIT_UNUSABLE
        out_console.print(f"wrote {count} results to {options.out}", highlight=False, markup=False)
    if waited or not sent:
        line, ok, failed = summary_line(rows)
        out_console.print(line, highlight=False, markup=False, soft_wrap=True)
        return exit_status(ok, failed)
    problems = len(results) + (len(source.errors) if source else 0)  # not waiting: `results` are the refused
    return EXIT_PROBLEMS if problems else EXIT_OK


def _validate(tickets: list[dict], max_bytes: int) -> tuple[list[dict], list[dict]]:
    """The tickets the contract accepts, and a failed result row (with its reason) for each one it refuses.

    A file's rows were checked as they were read; this catches generated tickets (a small
    TICKETQ_MAX_TICKET_BYTES) before anything is sent.
    """
    good, refused = [], []
    for ticket in tickets:
        try:
            validate_ticket(ticket, max_bytes)
        except TicketRejected as exc:
            refused.append({"id": ticket["id"], "status": "failed", "reason": exc.reason, "error": str(exc)})
        else:
            good.append(ticket)
    return good, refused


def _send_and_collect(producer: Producer, tickets: list[dict], rejected: int, options: RunOptions) -> list[dict] | None:
    """Send; with --wait or --out also collect and print the summary table. None when not waiting."""
    settings = producer.settings
    started = time.monotonic()
    sent = producer.submit_many(tickets, pack=options.pack, progress=options.progress)
    elapsed = time.monotonic() - started
    out_console.print(
        f"enqueued {len(tickets)} tickets in {len(sent)} messages to queue '{settings.queue}' at "
        f"{mask_url(settings.broker_url)} in {elapsed:.2f} s ({len(tickets) / max(elapsed, 1e-9):,.0f} tickets/s); "
        f"queue depth now {producer.queue_depth()}",
        highlight=False,
        markup=False,
    )
    if not (options.wait or options.out):
        return None

    collected = Collected()
    results = producer.wait(sent, timeout=options.timeout, progress=options.progress, on_result=collected.add,
                            resend_after=options.resend_after)  # fmt: skip
    expected = {ticket["id"]: ticket["expected"] for ticket in tickets if "expected" in ticket}
    for result in results:
        if result.get("id") in expected:
            result["expected"] = expected[result["id"]]
    _print_summary(results, rejected, started, collected.last_at)
    return results


def _print_summary(results: list[dict], rejected: int, started: float, last_at: float | None) -> None:
    statuses = Counter(result.get("status", "?") for result in results)
    ok = [result for result in results if result.get("status") == "ok"]
    table = Table(title="ticketq results", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("tickets", f"{len(results)} sent, {rejected} rejected before sending")
    table.add_row("outcome", ", ".join(f"{count} {status}" for status, count in statuses.most_common()))
    if last_at is not None:
        span = max(last_at - started, 1e-9)
        done = statuses["ok"] + statuses["failed"]
        table.add_row("throughput", f"{done / span:,.1f} tickets/s (first send to last result, {span:.2f} s)")
    labels = Counter(result.get("label") for result in ok)
    if labels:
        table.add_row("labels", ", ".join(f"{label}: {count} ({count / len(ok):.0%})"
                                          for label, count in labels.most_common()))
    _add_latency_rows(table, ok)
    scored = [result for result in ok if "expected" in result]
    if scored:
        agree = sum(result["label"] == result["expected"] for result in scored)
        note = " (stand-in model: labels are not meaningful)" if any(r.get("standin") for r in scored) else ""
        table.add_row("agreement", f"{agree}/{len(scored)} = {agree / len(scored):.1%} with expected{note}")
    out_console.print(table)
    errors = Counter(result.get("error", "") for result in results if result.get("status") != "ok")
    lines = [f"{count} x {error}" for error, count in errors.most_common()]
    _report_errors(lines, f"{sum(errors.values())} tickets without a label, by error:")


def _add_latency_rows(table: Table, ok: list[dict]) -> None:
    for key, name in (("queue_wait_s", "queue wait"), ("processing_s", "processing")):
        values = sorted(r[key] for r in ok if isinstance(r.get(key), (int, float)))
        if values:
            p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
            table.add_row(name, f"median {statistics.median(values) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms")


def _error(message: str) -> None:
    err_console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _report_errors(lines: list[str], header: str, more_hint: str = "") -> None:
    report(err_console, lines, header, more_hint)


def main() -> None:
    command(app, "ticketq-produce")(prog_name="ticketq-produce")


if __name__ == "__main__":
    main()
