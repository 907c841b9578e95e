"""`ticketq-produce`: enqueue tickets from a file or a synthetic generator, optionally wait for results.

Thin glue over `producer.api.Producer`: read and validate input, send with a progress bar,
collect with a progress bar, print a summary, write results JSONL.
"""

from __future__ import annotations

import json
import os
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

from producer.api import (
    RETRY_FOR_S,
    BrokerUnavailable,
    Producer,
    SendInterrupted,
    SendStopped,
    TicketResult,
    WaitStopped,
)
from producer.synthetic import generate_tickets
from producer.tickets import OutputError, TicketFile, TicketFileError, check_output, read_tickets, write_results
from ticketq.cli import CONTEXT_SETTINGS, command, report, summary_line
from ticketq.config import ClientSettings, SettingsError, mask_url
from ticketq.contract import TicketRejected, validate_ticket
from ticketq.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE, exit_status
from ticketq.names import REVIEW_STREAM

EXIT_PROBLEMS = EXIT_FAILED  # some tickets were rejected, failed or timed out
EXIT_UNUSABLE = EXIT_USAGE  # bad configuration, unreadable input, Redis unreachable
EXIT_INTERRUPTED = 130  # Ctrl-C: what was sent and what came back is written (--out) and said
PENDING = "pending"  # a row sent, without a result yet (Ctrl-C, --timeout): its task id says which message
UNSENT = "unsent"  # a row Ctrl-C stopped before it was sent

app = typer.Typer(
    name="ticketq-produce",
    help=(
        "Send support tickets to ticketq workers through Redis and, with --wait, collect the labels.\n\n"
        "Configuration comes from TICKETQ_* environment variables (TICKETQ_BROKER_URL, "
        "TICKETQ_RESULT_BACKEND, TICKETQ_QUEUE, TICKETQ_MAX_TICKET_BYTES, ...); --broker-url and "
        "--backend-url override them.\n\n"
        "Exit status: 0 all tickets sent (and, with --wait, classified); 1 some tickets were rejected, "
        "failed or timed out, or Redis stopped the run part way (--out says where each ticket is); 2 nothing "
        "could be done (bad settings, unreadable file, Redis unreachable or refusing the first send); "
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
    float,
    typer.Option("--resend-after", min=0.1, help="While waiting, re-send a message that has no result after this "
                 "many seconds if it is lost: not queued, not fetched by a worker (a Redis that lost its last "
                 "writes, or its data). Same task id: the worker publishes each ticket once. Backoff doubles "
                 "per re-send; re-sends per period are capped by the answer rate."),
]
DEFAULT_RESEND_AFTER_S = 30.0
RetryFor = Annotated[
    float,
    typer.Option("--retry-for", min=0, help="How long sending and waiting ask a Redis that went away again (a "
                 "restart, a Sentinel failover) before stopping; every ticket's row says where it is then."),
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


@dataclass
class RunOptions:
    pack: int
    wait: bool
    out: Path | None
    timeout: float
    progress: bool
    force: bool = False
    resend_after: float | None = None
    retry_for: float = RETRY_FOR_S
    idempotent: bool = False  # task ids from the ticket ids: a ticket sent again is answered once
    already_sent: frozenset[str] = frozenset()  # task ids an interrupted run sent (--resume)


@dataclass
class Outcome:
    """What `_send_and_collect` got: every row it has, and the line saying what an interrupted or
    timed-out run left ("" when nothing is pending)."""

    results: list[dict] | None  # None: not waiting
    stopped: str = ""
    interrupted: bool = False
    status: int | None = None  # the exit status when the rows do not decide it


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
    _report_errors([str(error) for error in parsed.errors], f"{len(parsed.errors)} rows refused, not sent:",
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
    timeout: Timeout = 600.0,
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
    _error(message)
    raise typer.Exit(EXIT_UNUSABLE)


def _kept_hint(out: Path | None) -> str:
    return f"; every row is in {out}" if out else "; pass --out FILE to keep every row"


def _run(tickets: list[dict], options: RunOptions, settings: ClientSettings, source: TicketFile | None = None) -> int:
    """Validate, send, optionally collect, write the results file; returns the exit status."""
    producer = Producer(settings, retry_for_s=options.retry_for)
    try:
        good, refused = _validate(tickets, settings.max_ticket_bytes)
        _report_errors([f"{row['id']}: {row['error']}" for row in refused],
                       f"{len(refused)} tickets rejected, not sent:", _kept_hint(options.out))  # fmt: skip
        malformed = len(source.errors) if source else 0
        outcome = Outcome(None)
        if good:
            producer.check_connection()
            outcome = _send_and_collect(producer, good, malformed + len(refused), options)
        else:
            _error("no valid tickets to send")
    except BrokerUnavailable as exc:  # this command has the options too: name them
        _error(_with_flags(str(exc)))
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


def _send_and_collect(producer: Producer, tickets: list[dict], rejected: int, options: RunOptions) -> Outcome:
    """Send; with --wait or --out also collect and print the summary table.

    Ctrl-C while sending, or Redis lost for longer than --retry-for or refusing the writes, gives a
    row for each ticket (`_stopped_send`); Ctrl-C, --timeout or Redis lost while waiting, a `pending`
    row for each ticket still without a result: `--resume` goes on from any of them.
    """
    settings = producer.settings
    started = time.monotonic()
    try:
        sent = producer.submit_many(tickets, pack=options.pack, progress=options.progress,
                                    idempotent=options.idempotent, already_sent=options.already_sent)  # fmt: skip
    except SendInterrupted as stop:
        return _stopped_send(producer, tickets, stop, options, "interrupted while sending")
    except SendStopped as stop:
        _error(_with_flags(str(stop)))
        return _stopped_send(producer, tickets, stop, options, "Redis stopped the send")
    elapsed = time.monotonic() - started
    before = [result for result in sent if result.sent_before]
    now = len(tickets) - sum(len(result.ticket_ids) for result in before)
    again = f"; {len(tickets) - now} sent before, not sent again" if before else ""
    out_console.print(
        f"enqueued {now} tickets in {len(sent) - len(before)} messages to queue '{settings.queue}' at "
        f"{mask_url(settings.broker_url)} in {elapsed:.2f} s ({now / max(elapsed, 1e-9):,.0f} tickets/s){again}; "
        f"queue depth now {_depth(producer)}",
        highlight=False,
        markup=False,
    )
    if not (options.wait or options.out):
        return Outcome(None)

    collected = Collected()
    interrupted, lost = False, ""
    try:
        results = producer.wait(sent, timeout=options.timeout, progress=options.progress, on_result=collected.add,
                                resend_after=options.resend_after)  # fmt: skip
    except WaitStopped as stop:
        _error(_with_flags(str(stop)))
        results, lost = stop.results, f"Redis not reachable for {options.retry_for:g} s while waiting"
    except KeyboardInterrupt:
        interrupted = True
        seen = {row.get("task_id") for row in collected.results}
        # Answers stored before the Ctrl-C that the wait had not read yet: one quick read, then pending.
        late = producer.ready_now([result for result in sent if result.id not in seen])
        results = collected.results + late + _pending_rows(sent, seen | {row.get("task_id") for row in late})
    for result in results:
        if result.get("status") == "timeout":
            result["status"] = PENDING
    expected = {ticket["id"]: ticket["expected"] for ticket in tickets if "expected" in ticket}
    for result in results:
        if result.get("id") in expected:
            result["expected"] = expected[result["id"]]
    _print_summary(results, rejected, started, collected.last_at)
    pending = sum(result.get("status") == PENDING for result in results)
    if not pending:
        return Outcome(results)
    what = "interrupted" if interrupted else lost or f"timed out after {options.timeout:g} s"
    line = (f"{what}: {len(results) - pending} tickets answered, {pending} pending (sent, no result yet)"
            f"{_where(options)}")  # fmt: skip
    return Outcome(results, line, interrupted)


def _stopped_send(producer: Producer, tickets: list[dict], stop: SendInterrupted | SendStopped,
                  options: RunOptions, what: str) -> Outcome:  # fmt: skip
    """A send stopped part way (Ctrl-C, or Redis): a row for every ticket. Its answer if it has one
    already (one quick read), a `pending` row (with its task id) for each other ticket Redis took,
    `"sent": "maybe"` for those of the pipeline being sent (Redis may or may not hold them), and an
    `unsent` row for each of the rest. Exit status: 130 on Ctrl-C; 2 when Redis took no ticket for
    sure, else the rows' (`_finish`)."""
    answers = producer.ready_now([*stop.results, *stop.unconfirmed])
    answered = {row.get("task_id") for row in answers}
    rows = answers + _pending_rows(stop.results, answered)
    for row in _pending_rows(stop.unconfirmed, answered):
        # --resume sends these again, under the same task id: answered once either way
        rows.append({**row, "sent": "maybe", "error": "being sent when the send stopped: Redis may or may not have it"})
    named = {row["id"] for row in rows}
    rows += [{"id": t["id"], "status": UNSENT, "reason": UNSENT, "error": f"not sent: {what}"}
             for t in tickets if t["id"] not in named]  # fmt: skip
    maybe = sum(len(result.ticket_ids) for result in stop.unconfirmed if result.id not in answered)
    unsure = f" ({maybe} of them maybe: they were being sent)" if maybe else ""
    line = (f"{what}: {len(named)} of {len(tickets)} tickets sent{unsure}, "
            f"{len(tickets) - len(named)} not sent{_where(options)}")  # fmt: skip
    waiting = options.wait or options.out
    sure = sum(len(result.ticket_ids) for result in stop.results)
    status = None if waiting else EXIT_PROBLEMS
    if isinstance(stop, SendStopped) and not sure:
        status = EXIT_UNUSABLE
    return Outcome(rows if waiting else None, line, interrupted=isinstance(stop, SendInterrupted), status=status)


def _depth(producer: Producer) -> str:
    """The queue depth for the enqueue line; a Redis that went away just after the send does not stop the run."""
    try:
        return str(producer.queue_depth())
    except BrokerUnavailable:
        return "unknown (Redis not reachable)"


def _with_flags(message: str) -> str:
    """A `BrokerUnavailable` line naming this command's options too."""
    return message.replace(BrokerUnavailable.fix, f"{BrokerUnavailable.fix}, or pass --broker-url")


def _pending_rows(sent: list[TicketResult], answered: set) -> list[dict]:
    """A `pending` row for each ticket of a message in `sent` whose task id is not in `answered`."""
    return [{"id": ticket_id, "task_id": result.id, "status": PENDING, "reason": PENDING,
             "error": "sent, no result yet"}
            for result in sent if result.id not in answered for ticket_id in result.ticket_ids]  # fmt: skip


def _where(options: RunOptions) -> str:
    """Where the rows are, and how to go on."""
    if options.out and options.idempotent:
        return f"; every row is in {options.out}: run the same command with --resume to go on"
    if options.out:
        return f"; every row is in {options.out}"
    if options.idempotent:
        return "; running the same command again sends each ticket id once; pass --out FILE to keep every row"
    return "; pass --out FILE to keep every row"


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
    labelled = [result for result in ok if "label" in result]
    labels = Counter(result["label"] for result in labelled)
    if labels:
        table.add_row("labels", ", ".join(f"{label}: {count} ({count / len(labelled):.0%})"
                                          for label, count in labels.most_common()))
    _add_field_rows(table, [result for result in ok if "fields" in result])
    _add_latency_rows(table, ok)
    scored = [result for result in labelled if isinstance(result.get("expected"), str)]
    if scored:
        agree = sum(result["label"] == result["expected"] for result in scored)
        note = " (stand-in model: labels are not meaningful)" if any(r.get("standin") for r in scored) else ""
        table.add_row("agreement", f"{agree}/{len(scored)} = {agree / len(scored):.1%} with expected{note}")
    out_console.print(table)
    errors = Counter(result.get("error", "") for result in results if result.get("status") != "ok")
    lines = [f"{count} x {error}" for error, count in errors.most_common()]
    _report_errors(lines, f"{sum(errors.values())} tickets without a label, by error:")


def _add_field_rows(table: Table, triaged: list[dict]) -> None:
    """Per schema field, how its answers spread; and how many tickets go to review."""
    if not triaged:
        return
    answers: dict[str, Counter] = {}
    for result in triaged:
        for name, answer in result["fields"].items():
            chosen = [answer["label"]] if "label" in answer else answer.get("labels") or ["none"]
            answers.setdefault(f"{result['schema']}.{name}", Counter()).update(chosen)
    for where, counts in answers.items():
        table.add_row(where, ", ".join(f"{label}: {count}" for label, count in counts.most_common(6)))
    review = sum(1 for result in triaged if result.get("review"))
    table.add_row("review", f"{review}/{len(triaged)} = {review / len(triaged):.1%} below a field's threshold "
                  f"(copied to {REVIEW_STREAM})")


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
