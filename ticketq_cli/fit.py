"""`ticketq fit LABELLED --out HEAD`: a label head learned from a team's labelled tickets (issue 43).

The labelled rows (`fitrows`) are a file `ticketq eval` reads (JSONL or CSV rows with `text` and
`expected`, `evaluate`'s docstring), the review page's decisions (`--from-reviews`: the labelled
stream, as `ticketq reviews export` reads it), or both. Every row runs
through the engine's batched path in float32 (the worker's prompt, the cached prefix), the hidden
state at the answer position is kept (`worker.engine.headfit.collect`), and a regularised softmax
regression is fitted on it (`fit_head`: a validation split for early stopping and the penalty).
The held-out tickets (`--holdout FILE`, else a share of the file) are then scored twice, by the
head and by the zero-shot scorer, side by side: accuracy, per-label precision and recall, and the
expected calibration error (ECE). The head file (`worker.engine.head`) records the model
fingerprint, the prompt digest, the labels and this summary; `TICKETQ_HEAD=HEAD` serves it.
With `--schema FILE`, one head per field of the schema (`fitschema`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from ticketq.exits import EXIT_NOTHING
from ticketq_cli.common import ENGINE_FLAGS, check_model, console, fail, read_settings
from ticketq_cli.fitrows import MIN_ROWS, FitOptions, Labelled, field_labels, read_file, single_label
from ticketq_cli.fitrows import from_reviews as from_reviews_stream


def fit(
    path: Annotated[Path | None, typer.Argument(help="Labelled tickets: JSONL or CSV rows, text and expected.")] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="The head file to write (with --schema: a folder).")] = ...,
    from_reviews: Annotated[
        bool, typer.Option("--from-reviews", help="Also train on the review page's decisions (ticketq:labelled).")
    ] = False,
    tenant: Annotated[str | None, typer.Option(help="With --from-reviews: only this tenant's decisions.")] = None,
    schema: Annotated[Path | None, typer.Option(help="A schema file: one head per field, in the --out folder.")] = None,
    holdout: Annotated[
        Path | None,
        typer.Option(help="Held-out labelled tickets to score on (default: a share of PATH, never trained on)."),
    ] = None,
    holdout_share: Annotated[
        float, typer.Option(min=0.05, max=0.5, help="Share of PATH held out when no --holdout is given.")
    ] = 0.2,
    validation_share: Annotated[
        float, typer.Option(min=0.05, max=0.5, help="Share of the training rows for early stopping and the penalty.")
    ] = 0.15,
    seed: Annotated[int, typer.Option(help="Seed of the splits.")] = 0,
    fmt: Annotated[str, typer.Option("--format", help="auto (by extension, then content), jsonl or csv.")] = "auto",
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace --out if it exists.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures to this JSON file.")] = None,
    model: Annotated[str | None, typer.Option(help="Hub id or local dir (default TICKETQ_MODEL).")] = None,
    device: Annotated[str | None, typer.Option(help="auto|cpu|cuda|mps.")] = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Progress bar on stderr.")] = True,
) -> None:
    """Fit a label head on labelled tickets: the hidden state at the answer position of the worker's
    prompt, a regularised logistic regression on it; head and zero-shot scored on held-out tickets.

    Rows come from PATH, the review page's decisions (--from-reviews), or both; `expected` is a label
    or {field: label}. Serve the head with TICKETQ_HEAD=OUT; with --schema FILE, one head per field
    (OUT/<field>.safetensors), served by the field's `head =` (docs/schemas.md). A worker refuses a
    head fitted for another model or prompt. Exit status 3: too little to fit (under 20 rows, one label)."""
    settings = read_settings(ENGINE_FLAGS, model=model, device=device, dtype="float32", recheck="never")
    settings = settings.model_copy(update={"head": None})  # fitted on the zero-shot engine, whatever is served
    _check_options(path, from_reviews, fmt)
    spec = _read_schema(schema) if schema is not None else None
    parse, name = (field_labels(spec), spec.name) if spec is not None else (single_label, None)
    data = _rows(settings, path, (from_reviews, tenant), name, parse, fmt)
    held = read_file(holdout, fmt, settings.max_ticket_bytes, parse, name) if holdout is not None else None
    options = FitOptions(out, (holdout_share, validation_share, seed), progress, force, json_out)
    source = " + ".join([*([str(path)] if path else []), *(["the review decisions"] if from_reviews else [])])
    if spec is not None:
        from ticketq_cli.fitschema import fit_schema

        return fit_schema(settings, spec, data, held, options, source)
    return _fit_single(settings, data, held, options, source)


def _check_options(path: Path | None, from_reviews: bool, fmt: str) -> None:
    if path is None and not from_reviews:
        fail("nothing to fit on: give a labelled file (PATH), --from-reviews, or both")
    if fmt not in ("auto", "jsonl", "csv"):
        fail(f"--format {fmt}: must be auto, jsonl or csv")


def _read_schema(path: Path):
    from ticketq.schema import SchemaError, load_schema

    try:
        return load_schema(path)
    except SchemaError as exc:
        fail(str(exc))


def _rows(settings, path: Path | None, reviews: tuple[bool, str | None], schema: str | None, parse,
          fmt: str) -> Labelled:  # fmt: skip
    """The training rows: PATH's, then the review decisions' (of `schema`'s results, where given)."""
    data = read_file(path, fmt, settings.max_ticket_bytes, parse, schema) if path is not None else Labelled()
    from_reviews, tenant = reviews
    if from_reviews:
        data.extend(from_reviews_stream(settings, tenant, schema, parse))
    return data


def _fit_single(settings, data: Labelled, held: Labelled | None, options: FitOptions, source: str) -> None:
    """TICKETQ_HEAD's head: the single field's labels, from a label or an object's one field."""
    if options.out.exists() and not options.force:
        fail(f"--out {options.out} exists: pass --force to replace it")
    labels = tuple(sorted(set(data.expected)))
    if len(data.texts) < MIN_ROWS or len(labels) < 2:
        fail(
            f"{source}: {len(data.texts)} labelled rows over {len(labels)} labels; a head needs at least {MIN_ROWS} "
            f"rows and two labels{_skipped(data)}",
            EXIT_NOTHING,
        )
    check_model(settings, hub=True)
    from ticketq_cli.classify_commands import _load_engine

    engine = _load_engine(settings)
    figures = _fit_and_score(engine, data, held, labels, options.shares, options.progress)
    figures["head"].save(options.out)
    _report(figures, source, options.out, engine.info.standin, options.json_out)


def _skipped(data: Labelled) -> str:
    """Why rows were left out, the first of them, for a refusal's line."""
    return f" ({len(data.skipped)} rows left out, e.g. {data.skipped[0]})" if data.skipped else ""


def _fit_and_score(engine, data: Labelled, held: Labelled | None, labels, shares, progress: bool) -> dict:
    """The head, and its and zero-shot's figures on the held-out rows."""
    import time

    import torch
    from tqdm import tqdm

    from worker.engine.headfit import collect, fit_head, split

    holdout_share, validation_share, seed = shares
    texts = data.texts + (held.texts if held else [])
    expected = data.expected + (held.expected if held else [])
    started = time.perf_counter()
    with tqdm(total=len(texts), desc="hidden states", unit="ticket", disable=None if progress else True) as bar:
        states, zero_shot = collect(engine, texts, on_chunk=bar.update)  # (N, H)
    if held is not None:
        fitted, test = list(range(len(data.texts))), list(range(len(data.texts), len(texts)))
    else:
        parts = split(len(texts), holdout_share, seed)
        fitted, test = parts.train, parts.validation
    index = {label: i for i, label in enumerate(labels)}
    usable = [i for i in fitted if expected[i] in index]
    inner = split(len(usable), validation_share, seed + 1)
    targets = torch.tensor([index.get(label, -1) for label in expected])  # (N,)
    rows = torch.tensor(usable)
    head = fit_head(states[rows], targets[rows], labels, inner, engine)
    head.summary.update(collect_s=round(time.perf_counter() - started, 1), holdout=len(test))
    answers = head.answers(states[test], engine.encode([texts[i] for i in test]), "float32")
    truth = [expected[i] for i in test]
    return {
        "head": head,
        "labels": labels,
        "scores": {
            head.scorer: _scores(labels, truth, answers),
            "zero-shot": _scores(labels, truth, [zero_shot[i] for i in test]),
        },
    }


def _scores(labels, truth: list[str], answers) -> dict:
    from ticketq_cli.evaluate import Scores
    from worker.engine.headfit import expected_calibration_error

    scores = Scores(labels)
    for want, answer in zip(truth, answers, strict=True):
        scores.add(want, answer.label, answer.margin)
    correct = [want == answer.label for want, answer in zip(truth, answers, strict=True)]
    ece = expected_calibration_error([max(a.probs.values()) for a in answers], correct)
    return {
        "accuracy": sum(correct) / len(correct) if correct else 0.0,
        "ece": ece,
        "per_label": scores.per_label(),
        "scored": len(correct),
    }


def _report(figures: dict, path: str, out: Path, standin: bool, json_out: Path | None) -> None:
    stdout, head, scores = Console(), figures["head"], figures["scores"]
    summary = head.summary
    table = Table(title=f"held-out: {summary['holdout']} tickets (never trained on)")
    table.add_column("figure")
    for scorer in scores:
        table.add_column(scorer, justify="right")
    table.add_row("accuracy", *(f"{s['accuracy']:.1%}" for s in scores.values()))
    table.add_row("ECE", *(f"{s['ece']:.3f}" for s in scores.values()))
    for label in figures["labels"]:
        table.add_row(
            f"{label} P / R",
            *(
                f"{s['per_label'][label]['precision']:.1%} / {s['per_label'][label]['recall']:.1%}"
                for s in scores.values()
            ),
        )
    stdout.print(table)
    stdout.print(
        f"fitted on {summary['train']} tickets ({summary['validation']} for early stopping, penalty "
        f"{summary['penalty']:g}, {summary['steps']} steps) in {summary['fit_s']:.1f} s after "
        f"{summary['collect_s']:.1f} s of hidden states; head {head.scorer} written to {out}; "
        f"serve it with TICKETQ_HEAD={out}",
        highlight=False,
        soft_wrap=True,
    )
    if standin:
        console.print(
            "[yellow]stand-in model: random weights, so zero-shot is chance; the head learned from its "
            "features what the synthetic tickets' words say[/]"
        )
    if json_out is not None:
        data = {"head": head.scorer, "summary": summary, "scores": scores, "standin": standin, "input": path}
        json_out.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def synthetic(
    count: Annotated[int, typer.Argument(min=1, help="How many labelled tickets to write.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The labelled JSONL file to write.")],
    seed: Annotated[int, typer.Option(help="Random seed: the same seed, the same tickets.")] = 0,
    force: Annotated[bool, typer.Option("--force", "-f", help="Replace --out if it exists.")] = False,
) -> None:
    """Write synthetic labelled tickets (JSONL: id, text, expected), the format `ticketq fit` and
    `ticketq eval` read. Each label has its own vocabulary, so a head can learn it from the text;
    fit on one seed and hold out another."""
    from producer.synthetic import generate_tickets

    if out.exists() and not force:
        fail(f"--out {out} exists: pass --force to replace it")
    with out.open("w", encoding="utf-8") as handle:
        for ticket in generate_tickets(count, seed=seed):
            handle.write(json.dumps(ticket, ensure_ascii=False) + "\n")
    Console().print(f"{count} labelled tickets (seed {seed}) written to {out}", highlight=False, markup=False)
