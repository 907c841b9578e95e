"""`ticketq-produce`: enqueue tickets from a file or a synthetic generator, optionally wait for results.

Thin glue over `producer.api.Producer`: read and validate input, send and collect
(`producer.run`), print a summary (`producer.summary`), write results JSONL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.markup import escape

from producer.api import Producer
from producer.errors import BrokerUnavailable
from producer.outage import RETRY_FOR_S
from producer.resultfile import OutputError, check_output, write_results
from producer.run import (
    EXIT_INTERRUPTED,
    EXIT_PROBLEMS,
    EXIT_UNUSABLE,
    PENDING,
    Outcome,
    RunOptions,
    send_and_collect,
    with_flags,
)
from producer.summary import err_console, error, out_console, report_errors
from producer.synthetic import generate_tickets
from producer.ticketfile import TicketFile, read_tickets
from producer.ticketrows import TicketFileError
from ticketq.cli import CONTEXT_SETTINGS, command, summary_line
from ticketq.config import ClientSettings, SettingsError
from ticketq.contract import TicketRejected, validate_ticket
from ticketq.exits import EXIT_OK, exit_status

app = typer.Typer(
    name="ticketq-produce",
    help=(
        "Send support tickets to ticketq workers through Redis and, with --wait, collect the labels.\n\n"
        "Configuration comes from TICKETQ_* environment variables (TICKETQ_BROKER_URL, "
        "TICKETQ_RESULT_BACKEND, TICKETQ_QUEUE, TICKETQ_MAX_TICKET_BYTES, ...); --broker-url and "
        "--backend-url override them.\n\n"
        "Exit status: 0 all tickets sent (and, with --wait, classified); 1 some tickets were rejected, "
        "failed or timed out, or Redis stopped the run part way (--out says where each ticket is); 2 nothing "
        "could be done (bad settings, unreadable file, Redis unreachable for --retry-for or refusing the first "
        "send; --out still has a row for every ticket); "
        "3 the input was read but no ticket was sent (or, with --wait, classified)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings=CONTEXT_SETTINGS,
)
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
DEFAULT_TIMEOUT_S = 600.0
ResendAfter = Annotated[
    float,
    typer.Option("--resend-after", min=0.1, help="While waiting, re-send a message that has no result after this "
                 "many seconds if it is lost: not queued, not fetched by a worker (a Redis that lost its last "
                 "writes, or its data). Same task id: the worker publishes each ticket once. Backoff doubles "
                 "per re-send; re-sends per period are capped by the answer rate."),
]
DEFAULT_RESEND_AFTER_S = 30.0
RetryFor = Annotated[
    float,
    typer.Option("--retry-for", min=0, help="How long connecting, sending and waiting ask a Redis that is not "
                 "reachable again (down, a restart, a Sentinel failover, loading its data) before stopping; every "
                 "ticket's row says where it is then."),
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
SchemaName = Annotated[
    str | None,
    typer.Option("--schema", help="The schema (set of fields, TICKETQ_SCHEMAS on the worker) to answer the tickets "
                 "with, for those that name none (a file row's own 'schema' wins); default: the worker's first."),
]
Resume = Annotated[
    bool,
    typer.Option("--resume", help="Go on from the --out file of an interrupted or timed-out run (replacing it): "
                 "its pending tickets are waited for, not sent again; tickets answered before are read back, "
                 "not sent again; the rest are sent."),
]


@app.command("file")
def file_command(
    path: Annotated[Path, typer.Argument(help="Tickets as JSONL ({\"id\", \"text\"} per line, id optional) "
                                         "or CSV with a header naming 'text' (and optionally 'id').")],
    fmt: Annotated[str, typer.Option("--format", help="auto (by extension, then content), jsonl or csv.")] = "auto",
    pack: Pack = 1,
    wait: Wait = False,
    out: Out = None,
    force: Force = False,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    resend_after: ResendAfter = DEFAULT_RESEND_AFTER_S,
    retry_for: RetryFor = RETRY_FOR_S,
    resume: Resume = False,
    broker_url: BrokerUrl = None,
    backend_url: BackendUrl = None,
    progress: Progress = True,
    schema: SchemaName = None,
) -> None:
    """Send the tickets in a JSONL or CSV file. Malformed rows are reported with file:line, not sent,
    and (with --out) written as failed rows.

    A ticket id is sent once: running the same file again (with the same --pack) sends only the
    tickets that have no result yet, under the same task ids, and reads back the others."""
    settings = _settings(broker_url, backend_url)
    if fmt not in ("auto", "jsonl", "csv"):
        _exit_error(f"--format {fmt}: must be auto, jsonl or csv")
    if resume and not out:
        _exit_error("--resume needs --out: the results file of the run to go on from")
    try:
        already_sent = _sent_before(out) if resume else frozenset()
        if out:
            check_output(out, [path], force or resume)
        parsed = read_tickets(path, fmt, settings.max_ticket_bytes)  # type: ignore[arg-type]
    except (TicketFileError, OutputError) as exc:
        _exit_error(str(exc))
    report_errors([str(error) for error in parsed.errors], f"{len(parsed.errors)} rows refused, not sent:",
                   _kept_hint(out))  # fmt: skip
    options = RunOptions(pack, wait, out, timeout, progress, force or resume, resend_after, retry_for, True,
                         already_sent)  # fmt: skip
    raise typer.Exit(_run(_with_schema(parsed.tickets, schema), options, settings, parsed))


def _with_schema(tickets: list[dict], schema: str | None) -> list[dict]:
    """`tickets`, those naming no schema given `schema` (unchanged when it is None)."""
    if schema is None:
        return tickets
    return [ticket if ticket.get("schema") is not None else {**ticket, "schema": schema} for ticket in tickets]


def _sent_before(out: Path) -> frozenset[str]:
    """The task ids of the `pending` rows in the results file of an earlier run (none if it is not
    there), but for those that were being sent when it was interrupted."""
    if not out.exists():
        return frozenset()
    sent, number = set(), 0
    try:
        with out.open(encoding="utf-8") as rows:
            for number, line in enumerate(rows, 1):  # noqa: B007 (named in the error)
                row = json.loads(line) if line.strip() else {}
                if row.get("status") == PENDING and row.get("task_id") and row.get("sent") != "maybe":
                    sent.add(str(row["task_id"]))
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise OutputError(f"--resume: cannot read {out} as a results file (line {number}: {exc})") from None
    return frozenset(sent)


@app.command("synthetic")
def synthetic_command(
    n: Annotated[int, typer.Argument(min=1, help="How many synthetic tickets to send.")],
    seed: Annotated[int, typer.Option("--seed", help="Random seed; the same seed gives the same tickets.")] = 0,
    pack: Pack = 1,
    wait: Wait = False,
    out: Out = None,
    force: Force = False,
    timeout: Timeout = DEFAULT_TIMEOUT_S,
    resend_after: ResendAfter = DEFAULT_RESEND_AFTER_S,
    retry_for: RetryFor = RETRY_FOR_S,
    broker_url: BrokerUrl = None,
    backend_url: BackendUrl = None,
    progress: Progress = True,
    schema: SchemaName = None,
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
    options = RunOptions(pack, wait, out, timeout, progress, force, resend_after, retry_for)
    raise typer.Exit(_run(_with_schema(tickets, schema), options, settings))


def _settings(broker_url: str | None = None, backend_url: str | None = None) -> ClientSettings:
    """The client settings with the URL options applied and validated, or one line per problem and exit 2.

    Only what a producer uses is read: a worker-only setting is the worker's to check.
    """
    try:
        settings = ClientSettings.from_env({"broker_url": "--broker-url", "result_backend": "--backend-url"},
                                           broker_url=broker_url, result_backend=backend_url)  # fmt: skip
    except SettingsError as exc:
        _exit_error(str(exc))
    for line in ClientSettings.unknown_names(os.environ):
        err_console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
    return settings


def _exit_error(message: str) -> NoReturn:
    error(message)
    raise typer.Exit(EXIT_UNUSABLE)


def _kept_hint(out: Path | None) -> str:
    return f"; every row is in {out}" if out else "; pass --out FILE to keep every row"


def _run(tickets: list[dict], options: RunOptions, settings: ClientSettings, source: TicketFile | None = None) -> int:
    """Validate, send, optionally collect, write the results file; returns the exit status."""
    producer = Producer(settings, retry_for_s=options.retry_for)
    try:
        good, refused = _validate(tickets, settings.max_ticket_bytes)
        report_errors([f"{row['id']}: {row['error']}" for row in refused],
                       f"{len(refused)} tickets rejected, not sent:", _kept_hint(options.out))  # fmt: skip
        malformed = len(source.errors) if source else 0
        outcome = Outcome(None)
        if good:
            outcome = send_and_collect(producer, good, malformed + len(refused), options)
        else:
            error("no valid tickets to send")
    except BrokerUnavailable as exc:  # this command has the options too: name them
        error(with_flags(str(exc)))
        return EXIT_UNUSABLE
    finally:
        producer.close()
    results = outcome.results
    status = _finish(refused + (results or []), options, source, sent=len(good), waited=results is not None)
    if outcome.stopped:
        err_console.print(outcome.stopped, highlight=False, markup=False, soft_wrap=True)
    if status == EXIT_UNUSABLE:  # the results file could not be written
        return status
    if outcome.interrupted:
        return EXIT_INTERRUPTED
    return status if outcome.status is None else outcome.status


def _finish(results: list[dict], options: RunOptions, source: TicketFile | None, sent: int, waited: bool) -> int:
    """Write every row (--out), print the summary line, and turn the outcome into the exit status."""
    rows = source.results_in_order(results) if source else results
    if options.out and (waited or not sent):
        try:
            count = write_results(options.out, rows, overwrite=options.force)
        except OutputError as exc:
            error(str(exc))
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


def main() -> None:
    command(app, "ticketq-produce")(prog_name="ticketq-produce")


if __name__ == "__main__":
    main()
