"""The run's header: the machine, load per round, versions, model, tickets and planner
(`make_header`), and the notes and schema lines printed under the table."""

from __future__ import annotations

import os
import platform
import re
import statistics
from datetime import datetime, timezone
from pathlib import Path

from ticketq_bench.figures import fmt, mode_ran, prefixes_recomputed
from ticketq_bench.records import FIELD_MODES, REFERENCE, SCHEMA_MODES, Bench, Options, baseline_of

STANDIN_LINE = "stand-in model (random weights): labels meaningless; speed is real"


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
    return notes + ceiling_lines(rows) + exactness_lines(rows)


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


def precision_of(header: dict) -> str:
    """"float32", or "float32 (oneDNN)" where the decoder's float32 GEMMs ran through oneDNN."""
    onednn = header.get("matmul") == "onednn"  # absent in reports written before TICKETQ_MATMUL
    if not onednn:
        return header["dtype"]
    return f"{header['dtype']} (oneDNN, fused layers)" if header.get("fused") else f"{header['dtype']} (oneDNN)"


def schema_lines(rows: list[dict]) -> list[str]:
    """The schema modes' figures in words: cost over one-field, agreement with the per-field reference,
    several schemas against one and the prefixes computed (none where no schema mode ran)."""
    ran = {row["mode"]: row for row in rows if mode_ran(row) and row["mode"] in (*FIELD_MODES, *SCHEMA_MODES)}
    lines = []
    costs = [f"{mode} {row['cost_ratio']:.2f}x (per round {ratios_text(row['cost_ratio_per_round'])})"
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
            f"{ratios_text(several['cost_ratio_per_round'])})"
        )
    for mode in ("one-schema", "schemas"):
        if mode in ran:
            row = ran[mode]
            verdict = "RECOMPUTED" if prefixes_recomputed(row) else "once each"
            lines.append(f"{mode}: prefixes computed {row['prefixes_computed']} for {row['schemas']} "
                         f"schema{'s' * (row['schemas'] != 1)} ({verdict})")  # fmt: skip
    for mode, row in ran.items():
        if check := row.get("reference_check"):
            lines.append(
                f"{mode} against its per-field reference on {check['tickets']} tickets: {check['labels_equal']}/"
                f"{check['answers']} answers equal, max |Δp| {fmt(check['max_abs_prob_diff'], '{:.1e}')}"
            )
    return lines


def ratios_text(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def load_average() -> tuple[float, float, float] | None:
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def ceiling_lines(rows: list[dict]) -> list[str]:
    """A line per mode timed against its linear-layer ceiling (`ticketq_bench.ceiling`)."""
    from ticketq_bench.ceiling import ceiling_note

    return [ceiling_note(row["mode"], row["linear_ceiling"]["rows"], row["linear_ceiling"]["share"])
            for row in rows if (row.get("linear_ceiling") or {}).get("share")]  # fmt: skip


# the rows a checked or deduplicated run is measured against, side by side in the same run
RIVALS = ("ticketq", "ticketq-bf16", "ticketq-int8", "openvino", "openvino-bf16", "openvino-int8", "llama-cpp",
          "llama-cpp-q8")  # fmt: skip


def exactness_lines(rows: list[dict]) -> list[str]:
    """ticketq-checked's re-check share and its labels against the reference, its speed against every
    other row of the run (ratios of medians), and what deduplication saved (none where neither ran)."""
    ran = {row["mode"]: row for row in rows if mode_ran(row)}
    lines = []
    if (checked := ran.get("ticketq-checked")) and (recheck := checked.get("recheck")):
        equal = round(checked["agreement"] * checked["tickets"]) if checked.get("agreement") is not None else None
        lines.append(
            f"ticketq-checked: {recheck['precision']}, {statistics.median(recheck['share']):.1%} of tickets "
            f"re-checked in float32 (per round {', '.join(f'{x:.1%}' for x in recheck['share'])}), bound "
            f"{recheck['bound'][-1]:.3g}; labels equal to the reference on {equal}/{checked['tickets']} tickets"
        )
        if recheck.get("fast_s"):
            lines.append(time_split(recheck))
        if weights := recheck.get("weights_mb"):
            lines.append(f"ticketq-checked memory: {weights['both']:.0f} MiB of weights resident, its "
                         f"{recheck['precision']} copy {weights['fast']:.0f} MiB and the float32 twin "
                         f"{weights['twin']:.0f} MiB (shared tensors counted once: the copy reads the twin's embedding "
                         "table and LM head)")  # fmt: skip
        ratios = [f"{mode} {checked['items_per_s'] / row['items_per_s']:.2f}x" for mode, row in ran.items()
                  if mode in RIVALS and row.get("items_per_s")]  # fmt: skip
        if ratios:
            lines.append("ticketq-checked against, in the same run (ratio of median items/s): " + ", ".join(ratios))
    dedup, plain = ran.get("ticketq"), ran.get("ticketq-nodedup")
    if dedup and plain and dedup.get("computed_tickets") and plain.get("items_per_s"):
        lines.append(
            f"deduplication: ticketq computed {dedup['computed_tickets'][0]} rows for {dedup['tickets']} tickets "
            f"(ticketq-nodedup {plain['computed_tickets'][0]}), {dedup['items_per_s'] / plain['items_per_s']:.2f}x "
            f"its items/s; labels equal ticket for ticket: {_same_labels(dedup, plain)}"
        )
    return lines


def time_split(recheck: dict) -> str:
    """Where ticketq-checked's time went, in its median round: fast forwards, re-check forwards and
    tickets sent straight to float32, and the share of tickets and tokens each took."""
    median = {key: statistics.median(recheck[key]) for key in ("fast_s", "recheck_s", "straight_s", "tokens_share",
                                                               "straight_share")}  # fmt: skip
    return (f"ticketq-checked time split (median round): {median['fast_s']:.2f} s in {recheck['precision']} forwards, "
            f"{median['recheck_s']:.2f} s re-checking in float32 ({median['tokens_share']:.1%} of the tokens computed "
            f"again), {median['straight_s']:.2f} s on tickets sent straight to float32 "
            f"({median['straight_share']:.1%} of the tickets)")


def _same_labels(a: dict, b: dict) -> str:
    labels = [row.get("labels") for row in (a, b)]
    if not all(labels):
        return "not recorded"
    same = sum(x == y for x, y in zip(*labels, strict=True))
    return f"{same}/{len(labels[0])}"
