"""The bench's schema modes: what several fields per ticket cost, and what serving several schemas costs.

On the same tickets, model and kernels as every other mode (`--schema`, default `examples/schema.toml`):

- `one-field`     one field per ticket: the schema's first field alone (a single-label field's labels
                  in the system prompt, the prompt ticketq has always used), through its `FieldsEngine`.
- `fields`        every field of the schema in one pass (`Engine.fields`): the ticket computed once,
                  each field's short answer opening scored as a segment of the ticket's row.
- `full-prompts`  a full prompt per field: each field alone classifies every ticket, so the ticket is
                  read once per field.
- `one-schema`    a worker serving the schema alone (`worker.engine.schemas.SchemaSet`).
- `schemas`       a worker serving three schemas at once, the tickets assigned round-robin: the schema
                  and two variants of it (the same fields, one more line in the system prompt), so
                  each its own cached prefix and every ticket the same work whichever it names.

`one-field` is the baseline of `fields` and `full-prompts` (their cost ratio), `one-schema` that
of `schemas`; each runs whenever a mode that needs it does, in the same interleaved rounds. A
mode's FieldsEngines (or SchemaSet, every schema's prefix computed) are built once, before its
first round. Every mode is checked against its own per-field reference (`FieldsEngine.reference`:
one ticket, one field's full prompt, no cache, full-vocabulary logits) on the first
`--reference-tickets` tickets: labels equal, max |Δp|, disagreements on near-ties (reference
confidence below `--tie-tolerance`) and on the rest. `schemas` reports `prefixes_computed`, which
must equal the number of schemas however many batches ran.

    ticketq bench --schema examples/schema.toml --modes one-field,fields,full-prompts --tickets 200
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from ticketq.schema import Schema, TicketFields
from ticketq_bench.modes import InProcessRun
from ticketq_bench.records import SCHEMA_MODES, Answer, Load
from worker.results import BatchReport

SCHEMAS = 3  # how many schemas the `schemas` mode serves at once

# what one of these modes returns per ticket: its answers, one per pass over the tickets
Answers = list[list[TicketFields]]


def one_field_schema(schema: Schema, name: str) -> Schema:
    """`schema`'s field `name` alone: a single-label field's labels in the system prompt (the prompt
    ticketq has always used), a multi-label one in the fields layout (the only one it has)."""
    only = schema.field(name)
    layout = "fields" if only.multi else "system"
    return Schema(f"{schema.name}.{name}", (only,), system=schema.system, truncation=schema.truncation, layout=layout)


def schema_variants(schema: Schema, count: int = SCHEMAS) -> list[Schema]:
    """`schema` and `count - 1` variants: the same fields under another name, one more line in the
    system prompt, so that each has a cached prefix of its own and costs the same per ticket."""
    return [schema, *(replace(schema, name=f"{schema.name}-{k}", system=f"{schema.system}\n\nQueue {k}.")
                      for k in range(2, count + 1))]  # fmt: skip


class FieldPasses:
    """`one-field`, `fields`, `full-prompts`: FieldsEngines that each answer every ticket."""

    def __init__(self, engine, schema: Schema, mode: str) -> None:
        if mode == "one-field":
            schemas = [one_field_schema(schema, schema.fields[0].name)]
        elif mode == "fields":
            schemas = [schema]
        else:
            schemas = [one_field_schema(schema, name) for name in schema.field_names]
        self.runners = [engine.fields(s) for s in schemas]  # each computes its prefix once, here
        self.figures = {"schema": schema.name, "fields": list(schema.field_names),
                        "passes": [s.name for s in schemas], "prefix_tokens": [r.prefix_len for r in self.runners]}

    def run(self, texts: list[str], bar: tqdm | None) -> tuple[Answers, list[BatchReport]]:
        answers: Answers = [[] for _ in texts]
        reports: list[BatchReport] = []
        rows = 0

        def on_batch(report: BatchReport) -> None:  # the bar counts tickets: a pass's rows are a share of them
            nonlocal rows
            rows += report.rows
            bar.update(rows // len(self.runners) - bar.n)

        for runner in self.runners:
            results, runner_reports = runner.classify(texts, on_batch=on_batch if bar else None)
            for mine, result in zip(answers, results, strict=True):
                mine.append(result)
            reports += runner_reports
        return answers, reports

    def references(self, index: int, text: str) -> list[TicketFields]:
        return [runner.reference(text) for runner in self.runners]


class SchemaRoundRobin:
    """`one-schema`, `schemas`: a `SchemaSet` serving one schema or several, ticket i naming schema i mod n."""

    def __init__(self, engine, schema: Schema, mode: str) -> None:
        from worker.engine.schemas import SchemaSet

        self.engine = engine
        self.schemas = schema_variants(schema, 1 if mode == "one-schema" else SCHEMAS)
        self.set = SchemaSet(engine, self.schemas)
        self.set.classify([(s.name, "hello") for s in self.schemas])  # every prefix computed before the rounds
        self.figures = {"schema": schema.name, "fields": list(schema.field_names), "schemas": len(self.schemas),
                        "passes": [s.name for s in self.schemas]}

    def run(self, texts: list[str], bar: tqdm | None) -> tuple[Answers, list[BatchReport]]:
        items = [(self.schemas[i % len(self.schemas)].name, text) for i, text in enumerate(texts)]
        results, reports = self.set.classify(items, on_batch=(lambda r: bar.update(r.rows)) if bar else None)
        return [[result] for result in results], reports

    def references(self, index: int, text: str) -> list[TicketFields]:
        return [self.engine.fields(self.schemas[index % len(self.schemas)]).reference(text)]


def flat_answer(answers: Sequence[TicketFields]) -> Answer:
    """A ticket's answers (one per pass) as one bench `Answer`: every field's label(s) in `label`, each
    label's probability under `field=label`, so that rounds are compared as for any mode."""
    labels, probs = [], {}
    for answer in answers:
        for name, result in answer.fields.items():
            labels.append(f"{name}={'+'.join(result.labels) or '-'}")
            probs |= {f"{name}={label}": p for label, p in result.probs.items()}
    return Answer(" ".join(labels), probs)


def check(runner: FieldPasses | SchemaRoundRobin, texts: list[str], answers: Answers, tie_tolerance: float) -> dict:
    """`answers` of the first `len(texts)` tickets against `runner.references`, one field answer at a
    time: labels (a multi-label field: its chosen set) equal, the largest probability gap, and the
    disagreements split into near-ties (reference confidence below `tie_tolerance`) and the rest."""
    counts = Counter(dict.fromkeys(("answers", "labels_equal", "near_ties", "disagreements_non_tie",
                                    "disagreements_near_tie"), 0))  # fmt: skip
    worst = 0.0
    for index, (text, got) in enumerate(zip(texts, answers, strict=False)):
        for mine, want in zip(got, runner.references(index, text), strict=True):
            for name, result in mine.fields.items():
                expected = want.fields[name]
                tie, equal = expected.confidence < tie_tolerance, result.labels == expected.labels
                counts.update(answers=1, labels_equal=equal, near_ties=tie, disagreements_non_tie=not equal and not tie,
                              disagreements_near_tie=not equal and tie)  # fmt: skip
                worst = max(worst, *(abs(result.probs[k] - p) for k, p in expected.probs.items()))
    total = counts["answers"]
    return {"tickets": min(len(texts), len(answers)), **counts, "agreement": counts["labels_equal"] / total if total
            else None, "max_abs_prob_diff": worst if total else None}  # fmt: skip


class FieldsRun(InProcessRun):
    """A schema mode in this process: its FieldsEngines or SchemaSet built once, then timed like any
    in-process mode, the first round's answers checked against the per-field reference."""

    runner: FieldPasses | SchemaRoundRobin

    def start(self) -> None:
        bench, mode = self.context.bench, self.result.mode
        build = SchemaRoundRobin if mode in SCHEMA_MODES else FieldPasses
        with self.context.console.status(f"{mode}: computing the cached prefixes…"):
            self.runner = build(bench.engine, bench.schema, mode)
        self.result.figures |= self.runner.figures

    def round(self, number: int, load: Load) -> None:
        bench, result = self.context.bench, self.result
        (answers, reports), seconds = self.timed(self.runner.run)
        if number == 1:
            result.reports = reports
            if bench.options.reference_tickets:
                count = bench.options.reference_tickets
                with self.context.console.status(f"{result.mode}: checking {count} tickets against the reference…"):
                    result.reference_check = check(self.runner, self.context.texts[:count], answers,
                                                   bench.options.tie_tolerance)  # fmt: skip
        if isinstance(self.runner, SchemaRoundRobin):
            result.figures["prefixes_computed"] = self.runner.set.prefixes_computed
        result.add_round([flat_answer(a) for a in answers], seconds, load)
