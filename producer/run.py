"""One run of `ticketq-produce`: send, collect while the wait lasts, and a row for every ticket
when Ctrl-C, --timeout or Redis stops it part way (`pending`, `unsent`), so `--resume` can go on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from producer.api import Producer
from producer.errors import BrokerUnavailable, NotReplicated, SendInterrupted, SendStopped, WaitStopped
from producer.messages import TicketResult
from producer.outage import RETRY_FOR_S
from producer.summary import error, out_console, print_summary
from ticketq.config import mask_url
from ticketq.exits import EXIT_FAILED, EXIT_USAGE

EXIT_PROBLEMS = EXIT_FAILED  # some tickets were rejected, failed or timed out
EXIT_UNUSABLE = EXIT_USAGE  # bad configuration, unreadable input, Redis unreachable
EXIT_INTERRUPTED = 130  # Ctrl-C: what was sent and what came back is written (--out) and said
PENDING = "pending"  # a row sent, without a result yet (Ctrl-C, --timeout): its task id says which message
UNSENT = "unsent"  # a row Ctrl-C stopped before it was sent


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
    """What `send_and_collect` got: every row it has, and the line saying what an interrupted or
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


def send_and_collect(producer: Producer, tickets: list[dict], rejected: int, options: RunOptions) -> Outcome:
    """Send; with --wait or --out also collect and print the summary table.

    Redis not reachable before the first send is waited for up to --retry-for (`connect`). Ctrl-C
    while connecting or sending, Redis lost for longer than --retry-for or refusing the writes, or
    replicas that do not confirm the send, give a row for each ticket (`stopped_send`); Ctrl-C once
    the send is done (its line still being printed, or the wait), --timeout or Redis lost while
    waiting, a `pending` row for each ticket still without a result: `--resume` goes on from any of
    them.
    """
    started = time.monotonic()
    sent = _send(producer, tickets, options)
    if isinstance(sent, Outcome):
        return sent
    collected = Collected()
    waited = _collect(producer, tickets, sent, options, collected, started)
    if isinstance(waited, Outcome):
        return waited
    results, lost, interrupted = waited
    for result in results:
        if result.get("status") == "timeout":
            result["status"] = PENDING
    expected = {ticket["id"]: ticket["expected"] for ticket in tickets if "expected" in ticket}
    for result in results:
        if result.get("id") in expected:
            result["expected"] = expected[result["id"]]
    print_summary(results, rejected, started, collected.last_at)
    pending = sum(result.get("status") == PENDING for result in results)
    if not pending:
        return Outcome(results)
    what = "interrupted" if interrupted else lost or f"timed out after {options.timeout:g} s"
    line = (f"{what}: {len(results) - pending} tickets answered, {pending} pending (sent, no result yet)"
            f"{where(options)}")  # fmt: skip
    return Outcome(results, line, interrupted)


def _send(producer: Producer, tickets: list[dict], options: RunOptions) -> list | Outcome:
    """Connect and send every ticket: their async results, or the Outcome of a send that stopped."""
    try:
        connect(producer, options.retry_for)
    except SendInterrupted as stop:
        return stopped_send(producer, tickets, stop, options, "interrupted while connecting to Redis")
    except SendStopped as stop:
        error(with_flags(str(stop)))
        what = "Redis refused the credentials" if stop.refused else f"Redis not reachable for {options.retry_for:g} s"
        return stopped_send(producer, tickets, stop, options, what)
    try:
        return producer.submit_many(tickets, pack=options.pack, progress=options.progress,
                                    idempotent=options.idempotent, already_sent=options.already_sent)  # fmt: skip
    except SendInterrupted as stop:
        return stopped_send(producer, tickets, stop, options, "interrupted while sending")
    except SendStopped as stop:
        error(with_flags(str(stop)))
        return stopped_send(producer, tickets, stop, options, "Redis stopped the send")
    except NotReplicated as stop:  # Redis took every ticket; too few replicas confirmed them
        error(with_flags(str(stop)))
        outcome = stopped_send(producer, tickets, SendStopped(stop, stop.results, []), options,
                               "replicas did not confirm the send")  # fmt: skip
        outcome.status = EXIT_UNUSABLE  # docs/reliability.md, Replica acks
        return outcome


def _collect(producer: Producer, tickets: list[dict], sent: list, options: RunOptions, collected: Collected,
             started: float) -> tuple[list[dict], str, bool] | Outcome:  # fmt: skip
    """Print the enqueue line and, with --wait or --out, wait: (results, why some are lost, interrupted),
    pending rows for the tickets without a result; an Outcome when nothing is waited for."""
    interrupted, lost = False, ""
    waiting = options.wait or options.out
    try:
        # The enqueue line inside the try: a Ctrl-C that answers it can come while it is still being
        # printed (the process preempted just after its write), and must find the rows as in the wait.
        print_enqueued(producer, tickets, sent, time.monotonic() - started)
        if not waiting:
            return Outcome(None)
        results = producer.wait(sent, timeout=options.timeout, progress=options.progress, on_result=collected.add,
                                resend_after=options.resend_after)  # fmt: skip
    except WaitStopped as stop:
        error(with_flags(str(stop)))
        results, lost = stop.results, f"Redis not reachable for {options.retry_for:g} s while waiting"
    except BrokerUnavailable as exc:  # refused credentials: asking again cannot help, and nothing can be read
        error(with_flags(str(exc)))
        seen = {row.get("task_id") for row in collected.results}
        results, lost = collected.results + pending_rows(sent, seen), "Redis refused the credentials while waiting"
    except KeyboardInterrupt:
        if not waiting:  # every ticket was sent, and none is waited for
            return Outcome(None, interrupted=True)
        interrupted = True
        seen = {row.get("task_id") for row in collected.results}
        # Answers stored before the Ctrl-C that the wait had not read yet: one quick read, then pending.
        late = producer.ready_now([result for result in sent if result.id not in seen])
        results = collected.results + late + pending_rows(sent, seen | {row.get("task_id") for row in late})
    return results, lost, interrupted


def connect(producer: Producer, retry_for: float) -> None:
    """The check before the first send, through an outage of up to `retry_for` (a producer started
    while Redis restarts, fails over or loads its data); as a send stopped before its first message:
    `SendInterrupted` on Ctrl-C, `SendStopped` when Redis stays away (or refuses the credentials)."""
    try:
        producer.check_connection(retry_for)
    except KeyboardInterrupt:
        raise SendInterrupted([], []) from None
    except BrokerUnavailable as exc:
        raise SendStopped(exc, [], []) from None


def stopped_send(producer: Producer, tickets: list[dict], stop: SendInterrupted | SendStopped,
                  options: RunOptions, what: str) -> Outcome:  # fmt: skip
    """A send stopped part way (Ctrl-C, or Redis): a row for every ticket. Its answer if it has one
    already (one quick read), a `pending` row (with its task id) for each other ticket Redis took,
    `"sent": "maybe"` for those of the pipeline being sent (Redis may or may not hold them), and an
    `unsent` row for each of the rest. Exit status: 130 on Ctrl-C; 2 when Redis took no ticket for
    sure, else the rows' (`producer.cli._finish`)."""
    answers = producer.ready_now([*stop.results, *stop.unconfirmed])
    answered = {row.get("task_id") for row in answers}
    rows = answers + pending_rows(stop.results, answered)
    for row in pending_rows(stop.unconfirmed, answered):
        # --resume sends these again, under the same task id: answered once either way
        rows.append({**row, "sent": "maybe", "error": "being sent when the send stopped: Redis may or may not have it"})
    named = {row["id"] for row in rows}
    rows += [{"id": t["id"], "status": UNSENT, "reason": UNSENT, "error": f"not sent: {what}"}
             for t in tickets if t["id"] not in named]  # fmt: skip
    maybe = sum(len(result.ticket_ids) for result in stop.unconfirmed if result.id not in answered)
    unsure = f" ({maybe} of them maybe: they were being sent)" if maybe else ""
    line = (f"{what}: {len(named)} of {len(tickets)} tickets sent{unsure}, "
            f"{len(tickets) - len(named)} not sent{where(options)}")  # fmt: skip
    waiting = options.wait or options.out
    sure = sum(len(result.ticket_ids) for result in stop.results)
    status = None if waiting else EXIT_PROBLEMS
    if isinstance(stop, SendStopped) and not sure:
        status = EXIT_UNUSABLE
    return Outcome(rows if waiting else None, line, interrupted=isinstance(stop, SendInterrupted), status=status)


def print_enqueued(producer: Producer, tickets: list[dict], sent: list[TicketResult], elapsed: float) -> None:
    """The line saying what the send did: how many tickets, how fast, and how deep the queue is now."""
    settings = producer.settings
    before = [result for result in sent if result.sent_before]
    now = len(tickets) - sum(len(result.ticket_ids) for result in before)
    again = f"; {len(tickets) - now} sent before, not sent again" if before else ""
    out_console.print(
        f"enqueued {now} tickets in {len(sent) - len(before)} messages to queue '{settings.queue}' at "
        f"{mask_url(settings.broker_url)} in {elapsed:.2f} s ({now / max(elapsed, 1e-9):,.0f} tickets/s){again}; "
        f"queue depth now {depth(producer)}",
        highlight=False,
        markup=False,
    )


def depth(producer: Producer) -> str:
    """The queue depth for the enqueue line; a Redis that went away just after the send does not stop the run."""
    try:
        return str(producer.queue_depth())
    except BrokerUnavailable:
        return "unknown (Redis not reachable)"


def with_flags(message: str) -> str:
    """A `BrokerUnavailable` line naming this command's options too."""
    return message.replace(BrokerUnavailable.fix, f"{BrokerUnavailable.fix}, or pass --broker-url")


def pending_rows(sent: list[TicketResult], answered: set) -> list[dict]:
    """A `pending` row for each ticket of a message in `sent` whose task id is not in `answered`."""
    return [{"id": ticket_id, "task_id": result.id, "status": PENDING, "reason": PENDING,
             "error": "sent, no result yet"}
            for result in sent if result.id not in answered for ticket_id in result.ticket_ids]  # fmt: skip


def where(options: RunOptions) -> str:
    """Where the rows are, and how to go on."""
    if options.out and options.idempotent:
        return f"; every row is in {options.out}: run the same command with --resume to go on"
    if options.out:
        return f"; every row is in {options.out}"
    if options.idempotent:
        return "; running the same command again sends each ticket id once; pass --out FILE to keep every row"
    return "; pass --out FILE to keep every row"


