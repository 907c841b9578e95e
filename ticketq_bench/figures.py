"""The benchmark's figures per mode: one JSON-ready row from a `ModeResult` (`summarise`: the median
items/s over the rounds and their range, speedup over the baseline from the medians, padding ratio,
tokens per ticket and per second, agreement with the reference, disagreements split into near-ties
and the rest, whether the answers were the same every round), and `--strict`'s verdict on the rows."""

from __future__ import annotations

import statistics

from ticketq_bench.records import REFERENCE, Answer, ModeResult, baseline_of

# Per-mode figures in the JSON rows (None where a mode was skipped).
FIGURES = (
    "tickets", "seconds", "items_per_s", "items_per_s_min", "items_per_s_max", "speedup", "padding_ratio",
    "pad_tokens", "computed_tokens", "tokens_per_ticket", "tokens_per_s", "forwards",
    "agreement", "max_abs_prob_diff", "near_ties", "disagreements_non_tie", "disagreements_near_tie", "failed",
    "round_label_changes", "round_max_abs_prob_diff", "baseline", "cost_ratio", "cost_ratio_per_round",
    "reference_check",
)  # fmt: skip
COMPARED = ("agreement", "max_abs_prob_diff", "near_ties", "disagreements_non_tie", "disagreements_near_tie")


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
    row |= _speed_and_padding(result, row["rounds"])
    if result.reference_check is not None:  # a schema mode, checked against its own reference
        row |= {key: result.reference_check[key] for key in COMPARED} | {"reference_check": result.reference_check}
    row["baseline"] = baseline_of(result.mode)
    baseline = next((r for r in results if r.mode == row["baseline"] and r.round_seconds), None)
    if baseline is not None:  # else not run yet (a partial report) or it failed
        row |= _against(baseline, result, row, tie_tolerance)
    return row


def _speed_and_padding(result: ModeResult, rounds: list[dict]) -> dict:
    """A mode's own figures: items/s (median and range over the rounds), padding, tokens, forwards."""
    n = len(result.answers)
    rates = [r["items_per_s"] for r in rounds if r["items_per_s"]]
    pad, computed = result.padding or (
        sum(r.pad_tokens for r in result.reports),
        sum(r.computed_tokens for r in result.reports),
    )
    return {
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


def _against(baseline: ModeResult, result: ModeResult, row: dict, tie_tolerance: float) -> dict:
    """A mode against its baseline: the speedup, and agreement with the reference or the cost ratio."""
    base_rate = statistics.median(len(baseline.answers) / s for s in baseline.round_seconds if s)
    speedup = row["items_per_s"] / base_rate if base_rate and row["items_per_s"] else None
    if row["baseline"] == REFERENCE:
        return {"speedup": speedup, **compare(result.answers, baseline.answers, tie_tolerance)}
    # the cost per ticket over the baseline: 1 / speedup, and each round's (the closest in load)
    return {
        "speedup": speedup,
        "cost_ratio": 1 / speedup if speedup else None,
        "cost_ratio_per_round": [
            mine / base for mine, base in zip(result.round_seconds, baseline.round_seconds, strict=False) if base
        ],
    }


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
    return any(row["disagreements_non_tie"] or row["round_label_changes"] or prefixes_recomputed(row)
               for row in rows if mode_ran(row))  # fmt: skip


def prefixes_recomputed(row: dict) -> bool:
    return row.get("prefixes_computed") is not None and row["prefixes_computed"] != row.get("schemas")


def mode_ran(row: dict) -> bool:
    """Whether a row has figures: it finished at least one round."""
    return row["items_per_s"] is not None


def fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else spec.format(value)
