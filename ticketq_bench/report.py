"""How the benchmark's rows and header are shown: three renderers and the files they write.

Renderers: `print_report` (the rich table on stdout), `markdown_table`, `write_chart` (PNG);
`write_outputs` writes the files the options ask for (JSON, PNG, Markdown), each replaced whole (a
killed run leaves the last complete file). The rows are `figures.summarise`'s, the header
`header.make_header`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ticketq_bench.figures import fmt, mode_ran, token_rates
from ticketq_bench.header import ceiling_lines, exactness_lines, precision_of, schema_lines
from ticketq_bench.records import FIELD_MODES, REFERENCE, SCHEMA_MODES, Options

# (heading, JSON key, format) of the figure columns shared by the stdout and Markdown tables.
COLUMNS = (
    ("items/s", "items_per_s", "{:.2f}"),
    ("min–max", "items_range", "{}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("padding", "padding_ratio", "{:.1%}"),
    ("tokens/ticket", "tokens_per_ticket", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("forwards", "forwards", "{}"),
    ("agreement", "agreement", "{:.1%}"),
    ("max |Δp|", "max_abs_prob_diff", "{:.1e}"),
)


def print_report(console: Console, header: dict, rows: list[dict]) -> None:
    """The rich table, the planner line and the notes."""
    title = (
        f"ticketq bench — {header['model']} ({precision_of(header)}, {header['device']}, "
        f"{header['torch_threads']} threads), {header['tickets']} tickets"
    )
    table = Table(title=title, caption=_caption(header, rows))
    for column in ("mode", *(name for name, _, _ in COLUMNS), "disagree (real / near-tie)", "peak RSS MB"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in rows:
        mode = row["mode"] if row["status"] == "ok" else f"{row['mode']} ({row['status']})"
        table.add_row(mode, *(_cells(row) if mode_ran(row) else ["—"] * (len(COLUMNS) + 2)))
    console.print(table)
    for line in schema_lines(rows):
        console.print(escape(line), highlight=False)
    if loads := _round_loads(header):
        console.print(f"load average (1 min) at the start of each round: {loads}")
    console.print(f"planner: {header['autotune']['description']}")
    for note in header["notes"]:
        console.print(f"[yellow]note:[/] {escape(note)}")  # notes hold brackets: pip install 'ticketq[peers]'


def _caption(header: dict, rows: list[dict]) -> str:
    """What the speedup and agreement columns are against: sequential, and the schema modes' own."""
    parts = []
    if any(row["mode"] == REFERENCE for row in rows):
        ties = next((row["near_ties"] for row in rows if row["mode"] == REFERENCE and row["near_ties"] is not None), 0)
        parts.append(f"reference = sequential; near-tie = reference margin < {header['tie_tolerance']:g} "
                     f"({ties} tickets)")  # fmt: skip
    if any(row["mode"] in (*FIELD_MODES, *SCHEMA_MODES) for row in rows):
        parts.append(f"schema modes: speedup over one-field (one-schema for schemas), agreement per field answer "
                     f"against their per-field reference on {header.get('reference_tickets')} tickets")  # fmt: skip
    return "; ".join(parts)


def markdown_table(header: dict, rows: list[dict]) -> str:
    """The stdout table as GitHub Markdown, with the run's command and machine underneath."""
    names = [name.replace("|", "\\|") for name, _, _ in COLUMNS]
    lines = [
        "| mode | " + " | ".join(names) + " | disagreements (real / near-tie) | peak RSS MB |",
        "|---" * (len(names) + 3) + "|",
    ]
    for row in rows:
        mode = f"`{row['mode']}`" + ("" if row["status"] == "ok" else f" ({row['status']})")
        if not mode_ran(row):
            lines.append(f"| {mode} | " + " | ".join(["—"] * (len(names) + 2)) + " |")
            continue
        row = token_rates(row["computed_tokens"], row["tickets"], row["seconds"]) | row  # older JSON lacks them
        lines.append(f"| {mode} | " + " | ".join(_cells(row, markdown=True)) + " |")
    reasons = [f"- `{row['mode']}`: {row['reason']}" for row in rows if row.get("reason")]
    words = [f"- {line}" for line in (*schema_lines(rows), *ceiling_lines(rows), *exactness_lines(rows))]
    return "\n".join([*lines, "", *reasons, *words, *([""] if reasons or words else []), _run_line(header), "",
                      f"`{header['command']}`", ""])  # fmt: skip


def _round_loads(header: dict) -> str:
    """The 1-minute load average at the start of each round, "0.52, 1.87, 2.01" (older JSON: "")."""
    loads = (header.get("load_average") or {}).get("rounds") or []
    return ", ".join(f"{load[0]:.2f}" for load in loads if load)


def _run_line(header: dict) -> str:
    """Tickets, precision, machine, load, versions, date and planner: the sentence under a Markdown table."""
    machine = header["machine"]
    flags = f", {' '.join(machine['cpu_flags'])}" if machine.get("cpu_flags") else ""
    load = header.get("load_average") or {}
    loads = (
        ", load average " + " → ".join(f"{value[0]:.2f}" for value in (load.get("start"), load.get("end")) if value)
        if any(load.values())
        else ""
    )
    rounds = header.get("rounds", 1)
    per_round = (
        f"; {rounds} rounds interleaved, median items/s shown, load average (1 min) at each round's start "
        f"{_round_loads(header)}"
        if rounds > 1
        else ""
    )
    unfinished = "" if header.get("finished", True) else " UNFINISHED: the run was still going when this was written."
    return (
        f"{header['tickets']} tickets ({header['ticket_source']}), {precision_of(header)} on {header['device']} "
        f"({machine['cpu']}{flags}, {machine.get('usable_cores', machine['cores'])} cores, {header['torch_threads']} "
        f"torch threads{loads}{per_round}), torch {header['torch']}, transformers {header['transformers']}, "
        f"{header['date'][:10]}; planner: {header['autotune']['description']}.{unfinished}"
    )


def _cells(row: dict, markdown: bool = False) -> list[str]:
    """One mode's figures as table cells (Markdown: × for speedup, no RSS owner)."""
    row = row | {"items_range": _items_range(row)}
    cells = [fmt(row[key], spec.replace("x", "×") if markdown else spec) for _, key, spec in COLUMNS]
    rss = fmt(row["peak_rss_mb"], "{:.0f}")
    if not markdown and row["rss_of"] == "worker process":
        rss += " (worker)"
    disagreements = " / ".join(fmt(row[key], "{}") for key in ("disagreements_non_tie", "disagreements_near_tie"))
    return [*cells, disagreements, rss]


def _items_range(row: dict) -> str | None:
    """ "3.21–3.40": the lowest and highest items/s over the rounds (None in older JSON)."""
    low, high = row.get("items_per_s_min"), row.get("items_per_s_max")
    return None if low is None or high is None else f"{low:.2f}–{high:.2f}"


def write_chart(path: Path, header: dict, rows: list[dict]) -> None:
    """A PNG: items/s (labelled with the speedup) and padding ratio per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    done = [r for r in rows if mode_ran(r)]
    modes = [r["mode"] for r in done]
    fig, (speed, pad) = plt.subplots(1, 2, figsize=(12, 4.5))
    medians = [r["items_per_s"] or 0 for r in done]
    spread = [  # the rounds' range as error bars (older JSON: none)
        [m - (r.get("items_per_s_min") or m) for m, r in zip(medians, done, strict=True)],
        [(r.get("items_per_s_max") or m) - m for m, r in zip(medians, done, strict=True)],
    ]
    bars = speed.bar(modes, medians, yerr=spread, capsize=3, color="tab:blue")
    speed.bar_label(bars, labels=[fmt(r["speedup"], "{:.2f}x") for r in done])
    speed.set_ylabel("items / s")
    speed.set_title("throughput (label: speedup vs sequential)")
    bars = pad.bar(modes, [100 * (r["padding_ratio"] or 0) for r in done], color="tab:orange")
    pad.bar_label(bars, fmt="%.1f%%")
    pad.set_ylabel("padding (% of computed tokens)")
    pad.set_title("padding ratio")
    for ax in (speed, pad):
        ax.tick_params(axis="x", rotation=30)
    standin = " — STAND-IN: labels meaningless, speed real" if header["standin"] else ""
    fig.suptitle(
        f"{header['model']} {header['dtype']}/{header['device']}, {header['tickets']} tickets{standin}", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(
    options: Options, header: dict, rows: list[dict], console: Console | None, chart: bool = True
) -> None:
    """The files the options ask for: `--json` [header, one object per mode], `--chart`, `--markdown`.

    While the run goes on (after every mode) it writes JSON and Markdown only, quietly (`console`
    None, `chart` False); each file is written beside its path and renamed over it.
    """
    say = console.print if console is not None else lambda _: None
    if options.json:
        _replace(options.json, json.dumps([header, *rows], indent=2, ensure_ascii=False) + "\n")
        say(f"JSON written to {options.json}")
    if options.chart and chart:
        write_chart(options.chart, header, rows)
        say(f"chart written to {options.chart}")
    if options.markdown:
        _replace(options.markdown, markdown_table(header, rows))
        say(f"Markdown table written to {options.markdown}")


def _replace(path: Path, text: str) -> None:
    """`path` holds `text` or its previous content, never half of either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)
