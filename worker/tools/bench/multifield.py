"""What several fields per ticket cost: one pass for all of them against one field, and against a
full prompt per field.

On the same tickets, the same model and kernels, three ways are timed side by side:

- `one-field`     one field per ticket: the schema's first field alone, its labels in the system
                  prompt (the prompt ticketq has always used), through the engine.
- `fields`        every field of the schema in one pass (`Engine.fields`): the ticket computed once,
                  each field's short answer opening scored against its keys and values.
- `full-prompts`  a full prompt per field: for each field, the engine classifies every ticket with
                  that field alone (its labels in the system prompt), so the ticket is read once per field.

The modes run interleaved (`--rounds`, each round in a rotated order, after a warm-up), and each
figure is the median over the rounds, so a load change on a shared machine hits all three. The
`fields` answers are checked against the per-field reference (`FieldsEngine.reference`: one
ticket, that field's full prompt, no cache, full-vocabulary logits) on `--reference` tickets.

    python -m worker.tools.bench.multifield --tickets 200
    python -m worker.tools.bench.multifield --tickets 200 --model models/qwen2.5-0.5b-standin --json out/multifield.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ticketq.schema import Schema, load_schema
from worker.tools.procs import ROOT

DEFAULT_SCHEMA = ROOT / "examples" / "schema.toml"
MODES = ("one-field", "fields", "full-prompts")
PROB_TOL = 1e-4  # float32: the engine tests' tolerance against the reference


@dataclass
class Measured:
    seconds: list[float] = field(default_factory=list)  # one per round
    computed_tokens: int = 0  # rows x padded width, every forward of one round
    forwards: int = 0

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def one_field_schema(schema: Schema, name: str) -> Schema:
    """`schema`'s field `name` alone, its labels in the system prompt: today's single-field prompt."""
    only = schema.field(name)
    return Schema(f"{schema.name}.{name}", (only,), system=schema.system, truncation=schema.truncation, layout="system")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(engine, schema: Schema, texts: list[str], rounds: int = 2, reference: int = 20, log=None) -> dict:
    """Time the three modes interleaved over `rounds` and check `fields` against the reference; the figures."""
    log = log or (lambda line: print(line, flush=True))
    if any(spec.multi for spec in schema.fields):
        raise ValueError("the bench compares single-label fields (a multi-label field has no one-field prompt)")
    names = schema.field_names
    runners = {
        "one-field": [engine.fields(one_field_schema(schema, names[0]))],
        "fields": [engine.fields(schema)],
        "full-prompts": [engine.fields(one_field_schema(schema, name)) for name in names],
    }
    shortest = sorted(texts, key=len)[:8]
    for mode in MODES:  # warm-up: first-call allocations and kernel choices out of the timings
        for runner in runners[mode]:
            runner.classify(shortest)
    measured = {mode: Measured() for mode in MODES}
    answers = None
    for round_ in range(rounds):
        order = MODES[round_ % len(MODES) :] + MODES[: round_ % len(MODES)]
        for mode in order:
            start = time.perf_counter()
            reports = []
            for runner in runners[mode]:
                results, runner_reports = runner.classify(texts)
                reports += runner_reports
                if mode == "fields":
                    answers = results
            seconds = time.perf_counter() - start
            m = measured[mode]
            m.seconds.append(seconds)
            m.computed_tokens = sum(r.computed_tokens for r in reports)
            m.forwards = len(reports)
            log(f"round {round_ + 1}/{rounds} {mode:>12}: {len(texts) / seconds:6.2f} items/s ({seconds:.1f} s)")
    agreement = _agreement(runners["fields"][0], texts[:reference], answers[:reference]) if reference else None
    base = measured["one-field"].median_s
    modes = {
        mode: {
            "seconds": m.seconds,
            "median_s": m.median_s,
            "items_per_s": len(texts) / m.median_s,
            "cost_vs_one_field": m.median_s / base,
            "computed_tokens": m.computed_tokens,
            "forwards": m.forwards,
        }
        for mode, m in measured.items()
    }
    prefix_tokens = {mode: [r.prefix_len for r in runners[mode]] for mode in MODES}
    return {
        "tickets": len(texts),
        "fields": list(names),
        "rounds": rounds,
        "modes": modes,
        "ratio_fields": modes["fields"]["cost_vs_one_field"],
        "ratio_full_prompts": modes["full-prompts"]["cost_vs_one_field"],
        # within each round, where the machine's load is closest between the modes
        "ratio_fields_per_round": _per_round(measured["fields"], measured["one-field"]),
        "ratio_full_prompts_per_round": _per_round(measured["full-prompts"], measured["one-field"]),
        "prefix_tokens": prefix_tokens,
        "ticket_tokens_mean": statistics.fmean(e.ticket_tokens for e in runners["fields"][0].encode(texts)),
        "agreement": agreement,
    }


def _per_round(mode: Measured, base: Measured) -> list[float]:
    return [a / b for a, b in zip(mode.seconds, base.seconds, strict=True)]


def _agreement(runner, texts: list[str], answers) -> dict:
    """`fields` answers against the per-field reference: labels equal, and the largest probability gap."""
    same = total = 0
    worst = 0.0
    for text, got in zip(texts, answers, strict=True):
        want = runner.reference(text)
        for name, result in got.fields.items():
            expected = want.fields[name]
            total += 1
            same += result.label == expected.label
            worst = max(worst, *(abs(result.probs[k] - expected.probs[k]) for k in result.probs))
    return {"tickets": len(texts), "answers": total, "labels_equal": same, "max_abs_prob_diff": worst,
            "within_tolerance": worst <= PROB_TOL}  # fmt: skip


def describe(figures: dict, header: dict) -> str:
    lines = [
        f"machine: {header['cpu']}, {header['cores']} cores, torch {header['torch']} with {header['threads']} threads",
        f"load average: {_load(header['load_before'])} before, {_load(header['load_after'])} after",
        f"model: {header['model']}{' (stand-in: labels meaningless, cost per token real)' if header['standin'] else ''}"
        f", {header['dtype']}, matmul {header['matmul']}",
        f"{figures['tickets']} tickets (mean {figures['ticket_tokens_mean']:.1f} tokens), fields "
        f"{', '.join(figures['fields'])}, {figures['rounds']} interleaved rounds, medians:",
    ]
    for mode, m in figures["modes"].items():
        lines.append(
            f"  {mode:>12}: {m['items_per_s']:6.2f} items/s  cost {m['cost_vs_one_field']:.2f}x one field  "
            f"({m['computed_tokens']} computed tokens, {m['forwards']} forwards; rounds "
            f"{', '.join(f'{s:.1f}' for s in m['seconds'])} s)"
        )
    def rounds(key: str) -> str:
        return ", ".join(f"{r:.2f}" for r in figures[key])

    lines.append(
        f"three fields in one pass / one field: {figures['ratio_fields']:.2f}x "
        f"(per round {rounds('ratio_fields_per_round')}); "
        f"three full prompts / one field: {figures['ratio_full_prompts']:.2f}x (per round "
        f"{rounds('ratio_full_prompts_per_round')})"
    )
    agreement = figures["agreement"]
    if agreement:
        lines.append(
            f"fields vs the per-field reference on {agreement['tickets']} tickets: {agreement['labels_equal']}/"
            f"{agreement['answers']} labels equal, max |dp| {agreement['max_abs_prob_diff']:.1e}"
        )
    return "\n".join(lines)


def _load(load) -> str:
    return " ".join(f"{x:.2f}" for x in load) if load else "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.tools.bench.multifield", description=__doc__.split("\n")[0])
    parser.add_argument("--tickets", type=int, default=200, help="synthetic long-tail tickets (default 200)")
    parser.add_argument("--schema", type=Path, default=DEFAULT_SCHEMA, help="the schema (default examples/schema.toml)")
    parser.add_argument("--model", help="hub id or directory (TICKETQ_MODEL, else models/qwen2.5-0.5b-standin)")
    parser.add_argument("--threads", type=int, help="torch threads (default: TICKETQ_THREADS or torch's choice)")
    parser.add_argument("--dtype", default="float32", help="float32 (default, exact) or another TICKETQ_DTYPE")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; figures are medians (default 2)")
    parser.add_argument("--reference", type=int, default=20, help="tickets checked against the reference (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures and the header as JSON here")
    options = parser.parse_args(argv)

    from ticketq.schema import SchemaError

    try:
        schema = load_schema(options.schema)
    except SchemaError as exc:
        print(exc, file=sys.stderr)
        return 2
    import torch

    from producer.synthetic import generate_tickets
    from worker.engine import Engine, ModelNotFound
    from worker.settings import Settings

    model = options.model or os.environ.get("TICKETQ_MODEL")
    if not model and (ROOT / "models" / "qwen2.5-0.5b-standin").is_dir():
        model = str(ROOT / "models" / "qwen2.5-0.5b-standin")
    overrides = {"model": model, "threads": options.threads, "dtype": options.dtype}
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    try:
        engine = Engine.from_settings(settings)
    except ModelNotFound as exc:
        print(exc, file=sys.stderr)
        return 2
    texts = [t["text"] for t in generate_tickets(options.tickets, seed=options.seed)]
    header = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "model": settings.model,
        "standin": engine.info.standin,
        "dtype": engine.info.dtype,
        "matmul": engine.info.matmul,
        "device": engine.info.device,
        "schema": str(options.schema),
        "load_before": os.getloadavg(),
    }
    figures = run(engine, schema, texts, rounds=options.rounds, reference=options.reference)
    header["load_after"] = os.getloadavg()
    print(describe(figures, header))
    if options.json:
        options.json.parent.mkdir(parents=True, exist_ok=True)
        options.json.write_text(json.dumps({"header": header, **figures}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
