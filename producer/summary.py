"""What `ticketq-produce` prints: its two consoles, error lines, and the summary table of a run."""

from __future__ import annotations

import statistics
from collections import Counter

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ticketq.cli import report
from ticketq.names import REVIEW_STREAM

out_console = Console()
err_console = Console(stderr=True)



def error(message: str) -> None:
    err_console.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def report_errors(lines: list[str], header: str, more_hint: str = "") -> None:
    report(err_console, lines, header, more_hint)



def print_summary(results: list[dict], rejected: int, started: float, last_at: float | None) -> None:
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
    report_errors(lines, f"{sum(errors.values())} tickets without a label, by error:")


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


