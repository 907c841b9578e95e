"""The benchmark's figures and how they are shown: one JSON-ready row per mode, a header, three renderers.

`summarise` turns a `ModeResult` into a row (the median items/s over the rounds and their range,
speedup over `sequential` from the medians, padding ratio, tokens per ticket and per second,
agreement with `sequential`, disagreements split into near-ties and the rest, whether the answers
were the same every round); `make_header` records the run (machine, load per round, versions,
model, tickets, planner). Renderers: `print_report` (the rich table on stdout), `markdown_table`,
`write_chart` (PNG); `write_outputs` writes the files the options ask for (JSON, PNG, Markdown),
each replaced whole (a killed run leaves the last complete file).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ticketq_bench.records import FIELD_MODES, REFERENCE, SCHEMA_MODES, Answer, ModeResult, Options, baseline_of

if TYPE_CHECKING:  # the runner imports this module; its types are only read here
    from ticketq_bench.records import Bench

# Per-mode figures in the JSON rows (None where a mode was skipped).
FIGURES = (
    "tickets", "seconds", "items_per_s", "items_per_s_min", "items_per_s_max", "speedup", "padding_ratio",
    "pad_tokens", "computed_tokens", "tokens_per_ticket", "tokens_per_s", "forwards",
    "agreement", "max_abs_prob_diff", "near_ties", "disagreements_non_tie", "disagreements_near_tie", "failed",
    "round_label_changes", "round_max_abs_prob_diff", "baseline", "cost_ratio", "cost_ratio_per_round",
    "reference_check",
)  # fmt: skip
COMPARED = ("agreement", "max_abs_prob_diff", "near_ties", "disagreements_non_tie", "disagreements_near_tie")
STANDIN_LINE = "stand-in model (random weights): labels meaningless; speed is real"
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


# ----- figures ------------------------------------------------------------------------------


def summarise(result: ModeResult, results: list[ModeResult], tie_tolerance: float) -> dict:
    """One JSON-ready row: speed (median over the rounds), padding, agreement with `sequential`, memory.

    `status` is "ok", "skipped" (never ran: the reason is `reason` and the first note) or
    "crashed" (its process died or it failed: the figures are those of the rounds before, if any).
    """
    status = "skipped" if result.skipped else "crashed" if result.crashed else "ok"
    row = {"kind": "mode", "mode": result.mode, "status": status, "reason": result.skipped or result.crashed}
    row |= dict.fromkeys(FIGURES) | {"peak_rss_mb": result.peak_rss_mb, "rss_of": result.rss_of, "notes": result.notes}
    row["rounds"] = [
        {"round": k, "seconds": seconds, "items_per_s": len(result.answers) / seconds if seconds else None,
         "load_average": list(load) if load else None}
        for k, (seconds, load) in enumerate(zip(result.round_seconds, result.round_loads, strict=True), start=1)
    ]  # fmt: skip
    if result.skipped:
        row["notes"] = [result.skipped, *result.notes]
    if not result.round_seconds:
        return row
    n = len(result.answers)
    rates = [r["items_per_s"] for r in row["rounds"] if r["items_per_s"]]
    pad, computed = result.padding or (
        sum(r.pad_tokens for r in result.reports),
        sum(r.computed_tokens for r in result.reports),
    )
    row |= {
        "tickets": n,
        "seconds": result.seconds,
        "items_per_s": statistics.median(rates) if rates else None,
        "items_per_s_min": min(rates, default=None),
        "items_per_s_max": max(rates, default=None),
        "padding_ratio": pad / computed if computed else 0.0,
        "pad_tokens": pad,
        "computed_tokens": computed,
        **token_rates(computed, n, result.seconds),
        "forwards": result.forwards if result.forwards is not None else len(result.reports),
        "failed": sum(a.label.startswith("<") for a in result.answers),
        "round_label_changes": result.round_label_changes,
        "round_max_abs_prob_diff": result.round_max_abs_prob_diff,
        **result.figures,
    }
    if result.reference_check is not None:  # a schema mode, checked against its own reference
        row |= {key: result.reference_check[key] for key in COMPARED} | {"reference_check": result.reference_check}
    row["baseline"] = baseline_of(result.mode)
    baseline = next((r for r in results if r.mode == row["baseline"] and r.round_seconds), None)
    if baseline is None:  # not run yet (a partial report) or it failed
        return row
    base_rate = statistics.median(len(baseline.answers) / s for s in baseline.round_seconds if s)
    row["speedup"] = row["items_per_s"] / base_rate if base_rate and row["items_per_s"] else None
    if row["baseline"] == REFERENCE:
        row |= compare(result.answers, baseline.answers, tie_tolerance)
    else:  # the cost per ticket over the baseline: 1 / speedup, and each round's (the closest in load)
        row["cost_ratio"] = 1 / row["speedup"] if row["speedup"] else None
        row["cost_ratio_per_round"] = [
            mine / base for mine, base in zip(result.round_seconds, baseline.round_seconds, strict=False) if base
        ]
    return row


def token_rates(computed: int | None, tickets: int | None, seconds: float | None) -> dict:
    """Where the time goes: fewer tokens per ticket (prefix cache, padding) or more tokens/s (batching)."""
    return {
        "tokens_per_ticket": computed / tickets if computed is not None and tickets else None,
        "tokens_per_s": computed / seconds if computed is not None and seconds else None,
    }


def compare(answers: list[Answer], reference: list[Answer], tie_tolerance: float) -> dict:
    """Agreement with the reference; disagreements split into near-ties and real ones."""
    margins = [_margin(r.probs) for r in reference]
    ties = [m < tie_tolerance for m in margins]
    differs = [a.label != r.label for a, r in zip(answers, reference, strict=True)]
    diffs = [
        abs(a.probs[k] - p)
        for a, r in zip(answers, reference, strict=True)
        if a.probs is not None
        for k, p in r.probs.items()
    ]
    return {
        "agreement": 1 - sum(differs) / len(reference) if reference else None,
        "max_abs_prob_diff": max(diffs) if diffs else None,
        "near_ties": sum(ties),
        "disagreements_non_tie": sum(d and not t for d, t in zip(differs, ties, strict=True)),
        "disagreements_near_tie": sum(d and t for d, t in zip(differs, ties, strict=True)),
    }


def _margin(probs: dict[str, float]) -> float:
    ranked = sorted(probs.values(), reverse=True)
    return ranked[0] - ranked[1]


def strict_failure(rows: list[dict]) -> bool:
    """Any disagreement that is not a near-tie, a label that changed between rounds, or a schema's
    prefix computed more than once (what `--strict` exits 1 on)."""
    return any(row["disagreements_non_tie"] or row["round_label_changes"] or _prefixes_recomputed(row)
               for row in rows if _ran(row))  # fmt: skip


def _prefixes_recomputed(row: dict) -> bool:
    return row.get("prefixes_computed") is not None and row["prefixes_computed"] != row.get("schemas")


def _ran(row: dict) -> bool:
    """Whether a row has figures: it finished at least one round."""
    return row["items_per_s"] is not None


# ----- the run's header ---------------------------------------------------------------------


def make_header(bench: Bench, tickets: list[dict], rows: list[dict], finished: bool = True) -> dict:
    """What ran where: machine, load per round, versions, model, tickets, modes and the planner's cost model.

    `finished` is False in the reports written while the run goes on (after every mode).
    """
    import torch
    import transformers

    engine, options = bench.engine, bench.options
    lengths = bench.ticket_lengths or [e.ticket_tokens for e in engine.encode([t["text"] for t in tickets])]
    return {
        "kind": "header",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": options.command,
        "finished": finished,
        "machine": _machine(),
        "rounds": options.rounds,
        "rounds_started": len(bench.round_loads),
        # os.getloadavg() (1, 5, 15 min) at the start and the end, and at the start of each round
        "load_average": {"start": bench.load_before, "end": load_average(), "rounds": bench.round_loads},
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": engine.info.name,
        "standin": engine.info.standin,
        "dtype": engine.info.dtype,
        "matmul": engine.info.matmul,
        "fused": engine.info.fused,
        "device": engine.info.device,
        "tickets": len(tickets),
        "ticket_source": _ticket_source(options),
        "ticket_tokens": {
            "min": min(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "mean": statistics.fmean(lengths),
        },
        "prefix_tokens": engine.prefix_len,
        "suffix_tokens": len(engine.prompt.suffix_ids),
        "labels": list(engine.labels),
        "batch_size": options.batch_size,
        "warmup_tickets": options.warmup,
        "tie_tolerance": options.tie_tolerance,
        "quick": options.quick,
        "modes": options.mode_list,
        "schema": _schema(bench),
        "reference_tickets": options.reference_tickets if bench.schema is not None else None,
        "autotune": _autotune(bench),
        "notes": _notes(bench, rows),
    }


def _schema(bench: Bench) -> dict | None:
    """The schema modes' schema: where it came from, its name and fields (None where none ran)."""
    schema = bench.schema
    if schema is None:
        return None
    fields = [{"name": f.name, "labels": list(f.labels), "multi": f.multi} for f in schema.fields]
    return {"path": str(bench.options.schema), "name": schema.name, "fields": fields}


def _ticket_source(options: Options) -> str:
    return str(options.tickets_file) if options.tickets_file else f"synthetic long-tail, seed {options.seed}"


def _autotune(bench: Bench) -> dict:
    engine, tuning = bench.engine, bench.tuning
    return {
        "applied": tuning is not None,
        "description": tuning.describe() if tuning else describe_cost(engine),
        "cost": {"fixed_ms": engine.cost.fixed_ms, "token_ms": engine.cost.token_ms, "quad_ms": engine.cost.quad_ms},
        "max_batch_tokens": engine.max_batch_tokens,
        "samples": [list(s) for s in tuning.samples] if tuning else [],
    }


def describe_cost(engine) -> str:
    """The planner's cost model and budget as the engine holds them (autotuned or configured)."""
    from worker.engine.autotune import Tuning

    return Tuning(engine.cost, engine.max_batch_tokens, ()).describe()


def _notes(bench: Bench, rows: list[dict]) -> list[str]:
    engine = bench.engine
    notes = []
    if engine.info.standin:
        notes.append(STANDIN_LINE)
    if bench.int8_engine is not None:
        tuned = f" planner: {bench.int8_tuning.describe()}" if bench.int8_tuning else ""
        notes.append(
            "ticketq-int8: decoder linear layers but the MLP down projection in dynamic int8 (torch "
            "quantize_dynamic, per-channel weights), prefix cache and reference in float32; inexact, so "
            f"near-ties may flip (counted separately).{tuned}"
        )
    if engine.info.dtype != "float32":
        notes.append(
            f"{engine.info.dtype}: batch shape changes rounding, so probabilities differ slightly between "
            "modes; near-ties may flip (counted separately)"
        )
    requested, modes = bench.options.requested_modes, bench.options.mode_list
    for baseline in [m for m in modes if m not in requested]:
        needs = [m for m in requested if baseline_of(m) == baseline]
        why = "the reference and the speedup baseline" if baseline == REFERENCE else "the baseline"
        notes.append(f"{baseline} ran although not listed: it is {why} of {', '.join(needs)}")
    if bench.options.rounds > 1:
        notes.append(
            f"{bench.options.rounds} rounds, the modes interleaved (A B C A B C …): items/s is the median over "
            "the rounds, min–max their range, speedup the ratio of the medians; answers are the first round's"
        )
    for row in rows:
        notes += [n for n in row["notes"] if n not in notes]
        if row.get("round_label_changes"):
            notes.append(
                f"{row['mode']}: ANSWERS CHANGED BETWEEN ROUNDS: {row['round_label_changes']} tickets' labels "
                f"(max |Δp| {row['round_max_abs_prob_diff']:.1e} against the first round)"
            )
    return notes + ceiling_lines(rows)


def _machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
        cpu = match.group(1).strip() if match else cpu
    except OSError:
        pass
    machine = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "cpu_flags": _cpu_flags()}
    if hasattr(os, "sched_getaffinity"):
        machine["usable_cores"] = len(os.sched_getaffinity(0))
    return machine


def _cpu_flags() -> list[str]:
    """The SIMD features that decide float32 / bf16 / int8 speed on a CPU (Linux only)."""
    try:
        match = re.search(r"^flags\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        return []
    flags = set(match.group(1).split()) if match else set()
    wanted = ("avx2", "fma", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    return [f for f in wanted if f in flags]


def _precision(header: dict) -> str:
    """"float32", or "float32 (oneDNN)" where the decoder's float32 GEMMs ran through oneDNN."""
    onednn = header.get("matmul") == "onednn"  # absent in reports written before TICKETQ_MATMUL
    if not onednn:
        return header["dtype"]
    return f"{header['dtype']} (oneDNN, fused layers)" if header.get("fused") else f"{header['dtype']} (oneDNN)"


def schema_lines(rows: list[dict]) -> list[str]:
    """The schema modes' figures in words: cost over one-field, agreement with the per-field reference,
    several schemas against one and the prefixes computed (none where no schema mode ran)."""
    ran = {row["mode"]: row for row in rows if _ran(row) and row["mode"] in (*FIELD_MODES, *SCHEMA_MODES)}
    lines = []
    costs = [f"{mode} {row['cost_ratio']:.2f}x (per round {_ratios(row['cost_ratio_per_round'])})"
             for mode, row in ran.items()
             if mode in FIELD_MODES and mode != row["baseline"] and row.get("cost_ratio") is not None]  # fmt: skip
    if costs:
        any_row = next(iter(ran.values()))
        lines.append(f"schema {any_row['schema']} ({', '.join(any_row['fields'])}), cost per ticket over one-field: "
                     + "; ".join(costs))  # fmt: skip
    several, one = ran.get("schemas"), ran.get("one-schema")
    if several and one and several.get("cost_ratio") is not None:
        lines.append(
            f"{several['schemas']} schemas ({', '.join(several['passes'])}) at once, tickets round-robin: "
            f"{several['items_per_s']:.2f} items/s against {one['items_per_s']:.2f} serving one, "
            f"{several['speedup']:.2f}x (cost {several['cost_ratio']:.2f}x, per round "
            f"{_ratios(several['cost_ratio_per_round'])})"
        )
    for mode in ("one-schema", "schemas"):
        if mode in ran:
            row = ran[mode]
            verdict = "RECOMPUTED" if _prefixes_recomputed(row) else "once each"
            lines.append(f"{mode}: prefixes computed {row['prefixes_computed']} for {row['schemas']} "
                         f"schema{'s' * (row['schemas'] != 1)} ({verdict})")  # fmt: skip
    for mode, row in ran.items():
        if check := row.get("reference_check"):
            lines.append(
                f"{mode} against its per-field reference on {check['tickets']} tickets: {check['labels_equal']}/"
                f"{check['answers']} answers equal, max |Δp| {_fmt(check['max_abs_prob_diff'], '{:.1e}')}"
            )
    return lines


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


# ----- renderers ----------------------------------------------------------------------------


def print_report(console: Console, header: dict, rows: list[dict]) -> None:
    """The rich table, the planner line and the notes."""
    title = (
        f"ticketq bench — {header['model']} ({_precision(header)}, {header['device']}, "
        f"{header['torch_threads']} threads), {header['tickets']} tickets"
    )
    table = Table(title=title, caption=_caption(header, rows))
    for column in ("mode", *(name for name, _, _ in COLUMNS), "disagree (real / near-tie)", "peak RSS MB"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for row in rows:
        mode = row["mode"] if row["status"] == "ok" else f"{row['mode']} ({row['status']})"
        table.add_row(mode, *(_cells(row) if _ran(row) else ["—"] * (len(COLUMNS) + 2)))
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
        if not _ran(row):
            lines.append(f"| {mode} | " + " | ".join(["—"] * (len(names) + 2)) + " |")
            continue
        row = token_rates(row["computed_tokens"], row["tickets"], row["seconds"]) | row  # older JSON lacks them
        lines.append(f"| {mode} | " + " | ".join(_cells(row, markdown=True)) + " |")
    reasons = [f"- `{row['mode']}`: {row['reason']}" for row in rows if row.get("reason")]
    words = [f"- {line}" for line in schema_lines(rows)] + [f"- {line}" for line in ceiling_lines(rows)]
    return "\n".join([*lines, "", *reasons, *words, *([""] if reasons or words else []), _run_line(header), "",
                      f"`{header['command']}`", ""])  # fmt: skip


def ceiling_lines(rows: list[dict]) -> list[str]:
    """A line per mode timed against its linear-layer ceiling (`ticketq_bench.ceiling`)."""
    from ticketq_bench.ceiling import ceiling_note

    return [ceiling_note(row["mode"], row["linear_ceiling"]["rows"], row["linear_ceiling"]["share"])
            for row in rows if (row.get("linear_ceiling") or {}).get("share")]  # fmt: skip


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
        f"{header['tickets']} tickets ({header['ticket_source']}), {_precision(header)} on {header['device']} "
        f"({machine['cpu']}{flags}, {machine.get('usable_cores', machine['cores'])} cores, {header['torch_threads']} "
        f"torch threads{loads}{per_round}), torch {header['torch']}, transformers {header['transformers']}, "
        f"{header['date'][:10]}; planner: {header['autotune']['description']}.{unfinished}"
    )


def _cells(row: dict, markdown: bool = False) -> list[str]:
    """One mode's figures as table cells (Markdown: × for speedup, no RSS owner)."""
    row = row | {"items_range": _items_range(row)}
    cells = [_fmt(row[key], spec.replace("x", "×") if markdown else spec) for _, key, spec in COLUMNS]
    rss = _fmt(row["peak_rss_mb"], "{:.0f}")
    if not markdown and row["rss_of"] == "worker process":
        rss += " (worker)"
    disagreements = " / ".join(_fmt(row[key], "{}") for key in ("disagreements_non_tie", "disagreements_near_tie"))
    return [*cells, disagreements, rss]


def _items_range(row: dict) -> str | None:
    """ "3.21–3.40": the lowest and highest items/s over the rounds (None in older JSON)."""
    low, high = row.get("items_per_s_min"), row.get("items_per_s_max")
    return None if low is None or high is None else f"{low:.2f}–{high:.2f}"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else spec.format(value)


def write_chart(path: Path, header: dict, rows: list[dict]) -> None:
    """A PNG: items/s (labelled with the speedup) and padding ratio per mode."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    done = [r for r in rows if _ran(r)]
    modes = [r["mode"] for r in done]
    fig, (speed, pad) = plt.subplots(1, 2, figsize=(12, 4.5))
    medians = [r["items_per_s"] or 0 for r in done]
    spread = [  # the rounds' range as error bars (older JSON: none)
        [m - (r.get("items_per_s_min") or m) for m, r in zip(medians, done, strict=True)],
        [(r.get("items_per_s_max") or m) - m for m, r in zip(medians, done, strict=True)],
    ]
    bars = speed.bar(modes, medians, yerr=spread, capsize=3, color="tab:blue")
    speed.bar_label(bars, labels=[_fmt(r["speedup"], "{:.2f}x") for r in done])
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
