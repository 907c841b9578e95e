"""ticketq-checked's figures: its re-check share and bound per round, where its time went (fast
forwards, re-check forwards, tickets sent straight to float32), and the line that describes it."""

from __future__ import annotations

from ticketq_bench.memory import weights_mb
from ticketq_bench.records import Answer
from worker.results import BatchReport


def recheck_figures(figures: dict, engine, answers: list[Answer], reports: list[BatchReport]) -> None:
    """The round's re-check share, the bound it was cut at and its time split, added to `figures`
    (the report's notes read them from the row)."""
    entry = figures.setdefault("recheck", {"share": [], "bound": [], "measured": [], "precision": engine.precision})
    entry["share"].append(sum(a.rechecked for a in answers) / len(answers))
    entry["bound"].append(engine.policy.bound.bound)
    entry["measured"].append(engine.policy.bound.measured)
    entry["forwards"] = sum(r.recheck for r in reports)
    first = [r for r in reports if not r.recheck]  # every ticket's first forward: fast, or straight to float32
    entry.setdefault("tokens_share", []).append(
        sum(r.real_tokens for r in reports if r.recheck) / max(sum(r.real_tokens for r in first), 1))
    entry.setdefault("straight_share", []).append(sum(r.rows for r in first if r.straight) / len(answers))
    parts = {"fast_s": [r for r in first if not r.straight], "straight_s": [r for r in first if r.straight],
             "recheck_s": [r for r in reports if r.recheck]}  # fmt: skip
    for part, chosen in parts.items():
        entry.setdefault(part, []).append(sum(r.seconds for r in chosen))
    entry["weights_mb"] = {"fast": weights_mb(*_models(engine)), "twin": weights_mb(*_models(engine.policy.exact)),
                           "both": weights_mb(*_models(engine), *_models(engine.policy.exact))}  # fmt: skip


def _models(engine) -> list:
    """The modules whose tensors `engine` computes with: its model, and its int8 decoder where it has one."""
    return [engine.model] + ([engine.decoder] if engine.decoder is not engine.float_decoder else [])


def describe_fast(mode: str, engine) -> str:
    """The note under a fast mode's row: what it computes, and for ticketq-checked its bound and calibration."""
    from worker.engine.policy import MIN_GAIN
    from worker.engine.precision import SAFETY, TAIL_CHANCE, expected_gain

    if mode == "ticketq-checked":
        bound = engine.policy.bound
        gain = expected_gain(bound.speed, bound.share)
        served = (f"a worker serves it (>= {MIN_GAIN}x needed)" if gain >= MIN_GAIN else
                  f"a worker would answer in float32 here (< {MIN_GAIN}x): shown for the figures")  # fmt: skip
        return (f"ticketq-checked: answers in {engine.precision}, a ticket whose decision gap is under "
                f"{SAFETY:g} x {bound.rate:.3g} x tokens^{bound.exponent:g} (the envelope of the {engine.precision} "
                f"errors measured over {bound.samples} tickets, or their fitted tail's at {TAIL_CHANCE:g} a ticket "
                f"where wider; largest {bound.measured:.3g}) computed again in float32, a length whose tickets "
                f"mostly are sent straight to float32; every label is compared with the reference. Its calibration: "
                f"{engine.precision} {bound.speed:.2f}x float32's speed, {bound.share:.0%} of its tickets re-checked, "
                f"{gain:.2f}x predicted: {served}")  # fmt: skip
    return f"{mode}: answers in {engine.precision} as they come (unchecked, inexact)"
