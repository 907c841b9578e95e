"""How far a fast precision moves the label decisions, on many tickets: is the re-check bound tight?

    .venv/bin/python docs/bench/decision_errors.py [--model DIR] [--precision bfloat16]
        [--tickets 600] [--seeds 0,1] [--unfused] [--out errors.json]

Classifies the calibration tickets (`precision.calibration_texts`) and `--tickets` synthetic long-
tail tickets per seed in float32 and in `--precision` (the copy a worker's `auto` builds, fused
where its weights are packed; `--unfused`: transformers' layers), every ticket in both, and prints,
per length bucket and overall, the decision error (`precision.decision_error`, what the bound is
measured on): its largest value, root mean square and 99th percentile. Then, for the bound a worker
would set from the calibration tickets alone (the wider of SAFETY x their largest error and their
fitted tail's, `precision.calibrate`; flat and length-aware), the share of tickets and of tokens
that would be re-checked and the label changes it would miss; and the bound's exceedance probability
per ticket under an exponential tail (peaks over the 80th percentile, Pickands-Balkema-de Haan, the
tail's scale at its 99% upper confidence) fitted to every ticket measured: how much margin the bound
keeps. Cost: float32 runs every ticket (minutes on the full-size stand-in). Findings:
docs/performance.md."""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def summary(rows: list[dict]) -> str:
    errors = sorted(r["error"] for r in rows)
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    return (f"n {len(errors):5d}  max {errors[-1]:.4f}  rms {rms:.4f}  p99 {errors[int(0.99 * (len(errors) - 1))]:.4f}"
            f"  max/rms {errors[-1] / rms if rms else 0:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/qwen2.5-0.5b-standin")
    parser.add_argument("--precision", default="bfloat16")
    parser.add_argument("--tickets", type=int, default=600, help="synthetic tickets per seed")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--unfused", action="store_true", help="the fast copy through transformers' layers")
    parser.add_argument("--out", type=Path, help="every ticket's tokens, gaps and error as JSON")
    args = parser.parse_args()

    import torch

    from producer.synthetic import generate_tickets
    from worker.engine.precision import (
        SAFETY,
        Calibration,
        ErrorBound,
        calibration_texts,
        decision_error,
        decision_gap,
        envelope,
        fit_tail,
        tail_bound,
    )
    from worker.engine.probes import cpu_flags, cpu_model
    from worker.engine.replicas import load_engine, with_precision
    from worker.settings import Settings

    exact = load_engine(Settings(model=args.model, dtype="float32", threads=args.threads, recheck="never"))
    fast = with_precision(exact, args.precision)
    if args.unfused:
        fast.unfuse()
    flags = " ".join(sorted(f for f in cpu_flags() if "avx512" in f or "amx" in f))
    forward = "fused" if fast.fused else "transformers' layers"
    print(
        f"{cpu_model()} ({flags}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{platform.machine()}; {args.precision} {forward}, matmul {fast.info.matmul}"
    )
    sets = {"calibration": calibration_texts()}
    for seed in (int(s) for s in args.seeds.split(",") if s):
        sets[f"seed {seed}"] = [t["text"] for t in generate_tickets(args.tickets, seed=seed)]
    measured: dict[str, list[dict]] = {}
    for name, texts in sets.items():
        started = time.perf_counter()
        answers, _ = fast.classify(texts)
        between = time.perf_counter()
        references, _ = exact.classify(texts)
        print(f"{name}: {len(texts)} tickets, {args.precision} {between - started:.1f} s, "
              f"float32 {time.perf_counter() - between:.1f} s", flush=True)  # fmt: skip
        measured[name] = [{"tokens": a.tokens, "gap": decision_gap(a), "exact_gap": decision_gap(b),
                           "error": decision_error(a, b), "same": a.label == b.label}
                          for a, b in zip(answers, references, strict=True)]  # fmt: skip
    tickets = [r for name, rows in measured.items() if name != "calibration" for r in rows]
    everything = measured["calibration"] + tickets
    print("\ndecision error against float32")
    for name, rows in measured.items():
        print(f"  {name:12s} {summary(rows)}")
    buckets: dict[int, list[dict]] = {}
    for row in tickets:
        buckets.setdefault(max(row["tokens"], 1).bit_length(), []).append(row)
    for bucket in sorted(buckets):
        print(f"  < {2**bucket:4d} tokens {summary(buckets[bucket])}")
    print(f"\nthe bound a worker sets from the calibration tickets, on the {len(tickets)} tickets:")
    calibration = [(r["tokens"], r["error"]) for r in measured["calibration"]]
    fitted, _ = envelope(calibration)
    for exponent in sorted({0.0, fitted}):
        normalised = [e / max(t, 1) ** exponent for t, e in calibration]
        largest, tail = SAFETY * max(normalised), tail_bound(normalised)
        rate = max(largest, tail) / SAFETY  # as `precision.calibrate` sets it
        bound = ErrorBound(args.precision, Calibration(max(e for _, e in calibration), len(calibration), 0.0, 0.0,
                                                       exponent, rate))  # fmt: skip
        checked = [r for r in tickets if r["gap"] < bound.bound_at(r["tokens"])]
        missed = sum(not r["same"] for r in tickets if r["gap"] >= bound.bound_at(r["tokens"]))
        flat = f"bound {SAFETY * rate:.4f}" + (f" x tokens^{exponent:g}" if exponent else "")
        flat += f" (SAFETY x the largest {largest:.4f}, the tail's {tail:.4f})"
        exceed = fit_tail([r["error"] / max(r["tokens"], 1) ** exponent for r in everything]).chance(SAFETY * rate)
        chosen = " (the envelope chosen)" if exponent == fitted else ""
        share = len(checked) / len(tickets)
        tokens = sum(r["tokens"] for r in checked) / sum(r["tokens"] for r in tickets)
        print(f"  {flat}{chosen}: re-checked {share:.1%} of tickets, {tokens:.1%} of tokens; label changes missed "
              f"{missed}; P(error > bound) per ticket under the fitted tail {exceed:.1e}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(measured), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
