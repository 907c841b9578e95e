"""The operator commands: `ticketq status`, `ticketq dead list|show|requeue`, `ticketq result` and
`ticketq exporter`, each on the broker of the settings (`ops`, `exporter` do the work)."""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated

import typer

from ticketq.cli import CONTEXT_SETTINGS, error
from ticketq.exits import EXIT_NO_WORKER, EXIT_NOTHING, exit_status
from ticketq_cli.common import (
    console,
    fail,
    log_to_stderr,
    read_settings,
)

reviews = typer.Typer(help="Reviewers' decisions from the gateway's review page (stream ticketq:labelled).",
                      no_args_is_help=True, context_settings=CONTEXT_SETTINGS)  # fmt: skip
dead = typer.Typer(help="Dead letters (stream ticketq:dead): list, show, requeue once the cause is fixed.",
                   no_args_is_help=True, context_settings=CONTEXT_SETTINGS)  # fmt: skip


@contextmanager
def _ops():
    """The operator commands' Ops on a broker that answers (else one line naming it), closed after."""
    from producer.errors import BrokerUnavailable
    from ticketq_cli.ops import Ops

    ops = Ops(read_settings())
    try:
        ops.redis.ping()
    except Exception as exc:  # redis-py and socket errors alike: report the broker, not a traceback
        ops.close()
        fail(str(BrokerUnavailable(ops.settings.broker_url, exc)))
    try:
        yield ops
    finally:
        ops.close()


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
    from worker.httpserver import MetricsPortInUse

    settings = read_settings()
    try:
        client = connect(settings.broker_url, **settings.sentinel, retries=3)
        server = exporter_server(client, queues or [settings.queue], host, port)
    except RedisUnavailable as exc:
        fail(str(exc))
    except MetricsPortInUse:
        fail(f"--port {port}: cannot listen on {host}:{port} (in use, or not allowed); pass another --port")
    log_to_stderr()
    watched = ", ".join(queues or [settings.queue])
    logging.getLogger(__name__).info("exporting queues %s on http://%s:%d/metrics", watched, host, port)
    with suppress(KeyboardInterrupt):
        server.serve_forever()


def status(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Queue depth, in-flight messages, live workers (Celery ping), dead letters by reason, results
    stream, Redis's memory and whether it kept its data. Exit status 4 when no worker answered the
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
        raise typer.Exit(EXIT_NO_WORKER)  # nothing is consuming the queue (or nobody could ask)


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
        fail(f"no dead letter with entry id or task id {key}", EXIT_NOTHING)  # as `dead requeue` of it
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
    from ticketq_cli.dead_letters import NotRequeueable

    if not keys and not reason:
        fail("name dead letters to requeue (entry or task ids) or pass --reason")
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


def result(key: Annotated[str, typer.Argument(help="Task id or ticket id.")]) -> None:
    """Look up results by task id or ticket id (results stream, then the Celery result backend)."""
    with _ops() as ops:
        found = ops.result(key)
    if not found:
        fail(f"no result for {key} (not in the results stream, pending or expired in the backend)", EXIT_NOTHING)
    for row in found:
        print(json.dumps(row, ensure_ascii=False))


@reviews.command("export")
def reviews_export(
    out: Annotated[Path, typer.Option(help="The labelled file to write (JSONL: id, text, schema, expected).")],
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's decisions (default: every tenant's).")] = None,
    schema: Annotated[str | None, typer.Option(help="Only decisions on results of this schema.")] = None,
) -> None:
    """Write the review page's decisions as a labelled file that `ticketq eval --schema` and `ticketq fit`
    read: one row per decided ticket, `expected` the reviewer's {field: label}, oldest first."""
    from ticketq_cli.reviews import export

    with _ops() as ops:
        summary = export(ops.redis, out, tenant, schema)
    print(f"{out}: {summary.rows} decision(s), {summary.corrected} corrected by the reviewer"
          + (f"; {summary.without_text} left out (no ticket text recorded)" if summary.without_text else ""))
