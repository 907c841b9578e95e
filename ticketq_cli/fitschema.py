"""`ticketq fit --schema FILE --out DIR`: one label head per field of a schema (issue 43).

Every labelled row runs once through the schema's batched path (`FieldsEngine`, the worker's
prompt for that schema, its cached prefix; the heads the file may already name are left out, so
the comparison is with zero-shot), and the hidden state at every question's answer position is
kept (`headfit.collect_fields`). Each field with enough labelled rows gets its head: a
single-label field a multinomial logistic on its question's state, a multi-label field one
logistic per label on that label's question's state (`headfit.fit_field_head`). The held-out rows
are scored by the head and by zero-shot, field by field: accuracy (a multi-label field's: the
exact set), per-label precision and recall, and ECE (a multi-label field's over every yes/no
decision). Heads are written to `DIR/<field>.safetensors`; the lines to add to the schema file
are printed.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ticketq.exits import EXIT_NOTHING
from ticketq.schema import Field, Schema
from ticketq_cli.common import check_model, console, fail
from ticketq_cli.fitrows import MIN_ROWS, FitOptions, Labelled


def fit_schema(settings, schema: Schema, data: Labelled, held: Labelled | None, options: FitOptions,
               source: str) -> None:  # fmt: skip
    """Fit, score, write and report each field's head (see the module)."""
    fields = _fittable(schema, data, source)
    paths = {spec.name: options.out / f"{spec.name}.safetensors" for spec in fields}
    if options.out.exists() and not options.out.is_dir():
        fail(f"--out {options.out}: with --schema it is a folder (one head per field), not a file")
    taken = [str(path) for path in paths.values() if path.exists()]
    if taken and not options.force:
        fail(f"--out {options.out}: {', '.join(taken)} exist(s): pass --force to replace")
    check_model(settings, hub=True)
    from ticketq_cli.classify_commands import _load_engine

    engine = _load_engine(settings)
    bare = replace(schema, fields=tuple(replace(spec, head=None) for spec in schema.fields))  # scored zero-shot
    figures = _fit_and_score(engine.fields(bare), fields, data, held, options)
    options.out.mkdir(parents=True, exist_ok=True)
    for spec in fields:
        figures[spec.name]["head"].save(paths[spec.name])
    _report(schema, figures, paths, engine.info.standin, options)
    _write_json(schema, figures, paths, engine.info.standin, options, source)


def _fittable(schema: Schema, data: Labelled, source: str) -> list[Field]:
    """The fields with enough labelled rows (a single-label one: and two labels seen); exit 3 if none."""
    fields, short = [], []
    for spec in schema.fields:
        answers = [row[spec.name] for row in data.expected if spec.name in row]
        seen = {answer for answer in answers if isinstance(answer, str)}
        if len(answers) >= MIN_ROWS and (spec.multi or len(seen) >= 2):
            fields.append(spec)
        else:
            short.append(f"{spec.name}: {len(answers)} rows")
    if short:
        console.print(f"[yellow]no head for {'; '.join(short)} (a head needs at least {MIN_ROWS} labelled rows and, "
                      "single-label, two labels)[/]")  # fmt: skip
    if not fields:
        skipped = f" ({len(data.skipped)} rows left out, e.g. {data.skipped[0]})" if data.skipped else ""
        fail(f"{source}: no field of schema {schema.name} has enough labelled rows to fit a head{skipped}",
             EXIT_NOTHING)  # fmt: skip
    return fields


def _fit_and_score(runner, fields: list[Field], data: Labelled, held: Labelled | None, options: FitOptions) -> dict:
    """Per field: its head, and its and zero-shot's figures on the held-out rows."""
    import time

    from tqdm import tqdm

    from worker.engine.headfit import collect_fields, split

    holdout_share, _, seed = options.shares
    texts = data.texts + (held.texts if held else [])
    expected = data.expected + (held.expected if held else [])
    started = time.perf_counter()
    with tqdm(total=len(texts), desc="hidden states", unit="ticket", disable=None if options.progress else True) as bar:
        states, zero_shot = collect_fields(runner, texts, on_chunk=bar.update)  # (N, Q, H)
    collect_s = round(time.perf_counter() - started, 1)
    if held is not None:
        fitted, test = list(range(len(data.texts))), list(range(len(data.texts), len(texts)))
    else:
        parts = split(len(texts), holdout_share, seed)
        fitted, test = parts.train, parts.validation
    figures = {}
    for spec in fields:
        head = _fit_field(runner, spec, states, expected, fitted, options)
        head.summary.update(collect_s=collect_s)
        figures[spec.name] = _score_field(runner, spec, head, states, expected, test, zero_shot)
    return figures


def _fit_field(runner, spec: Field, states, expected: list[dict], fitted: list[int], options: FitOptions):
    """`spec`'s head on the fitted rows that label it."""
    import torch

    from worker.engine.headfit import fit_field_head, split

    _, validation_share, seed = options.shares
    rows = [i for i in fitted if spec.name in expected[i]]
    asked = [q for q, question in enumerate(runner.questions) if question.field == spec.name]
    if spec.multi:  # (n, L, H) each label's question's state; (n, L) 1 where the label was chosen
        features = states[rows][:, asked]
        targets = torch.tensor([[int(runner.questions[q].label in expected[i][spec.name]) for q in asked]
                                for i in rows])  # fmt: skip
    else:  # (n, H) the field's one question's state; (n,) the label's index
        features = states[rows][:, asked[0]]
        targets = torch.tensor([spec.labels.index(expected[i][spec.name]) for i in rows])
    return fit_field_head(features, targets, spec, split(len(rows), validation_share, seed + 1), runner)


def _score_field(runner, spec: Field, head, states, expected: list[dict], test: list[int], zero_shot) -> dict:
    """The head's and zero-shot's figures on the held-out rows that label `spec`."""
    from worker.engine.fieldheads import FieldHeads
    from worker.engine.fields import field_result

    rows = [i for i in test if spec.name in expected[i]]
    heads = FieldHeads({spec.name: head}, runner.questions)
    picked = states[rows]  # (n, Q, H)
    scored = heads.score(lambda q: picked[:, q], rows)
    answers = [
        field_result(spec, runner.questions, [{a: math.exp(lp) for a, lp in found.get(q, {}).items()}
                                              for q in range(len(runner.questions))], head.scorer)
        for found in scored
    ]  # fmt: skip
    truth = [expected[i][spec.name] for i in rows]
    head.summary.update(holdout=len(rows))
    return {"head": head, "scores": {
        head.scorer: _scores(spec, truth, answers),
        "zero-shot": _scores(spec, truth, [zero_shot[i].fields[spec.name] for i in rows]),
    }}  # fmt: skip


def _scores(spec: Field, truth: list, answers: list) -> dict:
    """Accuracy (multi-label: the exact set), per-label precision/recall, ECE, rows scored."""
    from ticketq_cli.evaluate import Scores, SetScores
    from worker.engine.headfit import expected_calibration_error

    if spec.multi:
        scores = SetScores(spec.labels)
        decisions = [(max(p, 1 - p), (p > spec.select) == (label in want))  # every yes/no decision
                     for want, answer in zip(truth, answers, strict=True)
                     for label, p in answer.probs.items()]  # fmt: skip
        for want, answer in zip(truth, answers, strict=True):
            scores.add(want, answer.labels, answer.confidence)
    else:
        scores = Scores(spec.labels)
        decisions = [(max(answer.probs.values()), want == answer.label)
                     for want, answer in zip(truth, answers, strict=True)]  # fmt: skip
        for want, answer in zip(truth, answers, strict=True):
            scores.add(want, answer.label, answer.confidence)
    ece = expected_calibration_error([c for c, _ in decisions], [ok for _, ok in decisions])
    return {"accuracy": scores.accuracy, "ece": ece, "per_label": scores.per_label(), "scored": scores.scored}


def _report(schema: Schema, figures: dict, paths: dict[str, Path], standin: bool, options: FitOptions) -> None:
    stdout = Console()
    for name, found in figures.items():
        head = found["head"]
        stdout.print(_table(schema, schema.field(name), head, found["scores"]))
        summary = head.summary
        stdout.print(f"{name}: fitted on {summary['train']} tickets ({summary['validation']} for early stopping) in "
                     f"{summary['fit_s']:.1f} s; head {head.scorer} written to {paths[name]}",
                     highlight=False, soft_wrap=True)  # fmt: skip
    stdout.print("serve them: add to each field of the schema file (a path relative to the file, or absolute)",
                 highlight=False)  # fmt: skip
    for name in figures:
        stdout.print(f'  under [fields.{name}]: head = "{paths[name].resolve()}"', highlight=False, markup=False,
                     soft_wrap=True)  # one line each, whatever the terminal's width: copied into the file
    if standin:
        console.print("[yellow]stand-in model: random weights, so zero-shot is chance; the heads learned from its "
                      "features what the tickets' words say[/]")  # fmt: skip


def _table(schema: Schema, spec: Field, head, scores: dict) -> Table:
    """Head beside zero-shot for one field."""
    kind = "exact set, " if spec.multi else ""
    table = Table(title=f"{schema.name}.{spec.name}: {head.summary['holdout']} held-out tickets ({kind}never "
                        "trained on)")  # fmt: skip
    table.add_column("figure")
    for scorer in scores:
        table.add_column(scorer, justify="right")
    table.add_row("accuracy", *(f"{s['accuracy']:.1%}" for s in scores.values()))
    table.add_row("ECE", *(f"{s['ece']:.3f}" for s in scores.values()))
    for label in spec.labels:
        cells = (s["per_label"][label] for s in scores.values())
        table.add_row(f"{label} P / R", *(f"{c['precision']:.1%} / {c['recall']:.1%}" for c in cells))
    return table


def _write_json(schema: Schema, figures: dict, paths: dict[str, Path], standin: bool, options: FitOptions,
                source: str) -> None:  # fmt: skip
    if options.json_out is None:
        return
    fields = {name: {"head": found["head"].scorer, "file": str(paths[name]), "summary": found["head"].summary,
                     "scores": found["scores"]} for name, found in figures.items()}  # fmt: skip
    data = {"schema": schema.name, "fields": fields, "standin": standin, "input": source}
    options.json_out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
