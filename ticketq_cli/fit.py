"""`ticketq fit LABELLED --out HEAD`: a label head learned from a team's labelled tickets (issue 43).

The labelled file is the one `ticketq eval` reads (JSONL or CSV rows with `text` and `expected`,
`evaluate`'s docstring); `ticketq reviews export` writes it from the review stream. Every row runs
through the engine's batched path in float32 (the worker's prompt, the cached prefix), the hidden
state at the answer position is kept (`worker.engine.headfit.collect`), and a regularised softmax
regression is fitted on it (`fit_head`: a validation split for early stopping and the penalty).
The held-out tickets (`--holdout FILE`, else a share of the file) are then scored twice, by the
head and by the zero-shot scorer, side by side: accuracy, per-label precision and recall, and the
expected calibration error (ECE). The head file (`worker.engine.head`) records the model
fingerprint, the prompt digest, the labels and this summary; `TICKETQ_HEAD=HEAD` serves it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from producer.ticketfile import TicketReader
from producer.ticketrows import RowError, TicketFileError
from ticketq.exits import EXIT_NOTHING
from ticketq_cli.common import ENGINE_FLAGS, check_model, console, fail, read_settings

MIN_ROWS = 20  # fewer labelled rows fit nothing worth serving


@dataclass
class Labelled:
    """A labelled file's usable rows, and what was left out."""

    texts: list[str] = field(default_factory=list)
    expected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # `source: why` of rows not used


def read_labelled(path: Path, fmt: str, max_bytes: int) -> Labelled:
    """Rows with a text and a single `expected` label; every other row counted in `skipped`."""
    found = Labelled()
    try:
        reader = TicketReader(path, fmt, max_bytes)  # type: ignore[arg-type]
    except TicketFileError as exc:
        fail(str(exc))
    with reader:
        for row in reader:
            if isinstance(row, RowError):
                found.skipped.append(f"{row.source}: {row.reason}: {row.message}")
            elif not isinstance(row.ticket.get("expected"), str):
                found.skipped.append(f"{row.source}: no single `expected` label")
            else:
                found.texts.append(row.ticket["text"])
                found.expected.append(row.ticket["expected"])
    return found


def fit(
    path: Annotated[Path, typer.Argument(help="Labelled tickets: JSONL or CSV rows with text and expected.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="The head file to write (safetensors).")],
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

    Serve it with TICKETQ_HEAD=OUT (a worker refuses a head fitted for another model or prompt).
    Exit status 3 when there is too little to fit (under 20 labelled rows, or one label)."""
    settings = read_settings(ENGINE_FLAGS, model=model, device=device, dtype="float32", recheck="never")
    settings = settings.model_copy(update={"head": None})  # fitted on the zero-shot engine, whatever is served
    if fmt not in ("auto", "jsonl", "csv"):
        fail(f"--format {fmt}: must be auto, jsonl or csv")
    if out.exists() and not force:
        fail(f"--out {out} exists: pass --force to replace it")
    data = read_labelled(path, fmt, settings.max_ticket_bytes)
    held = read_labelled(holdout, fmt, settings.max_ticket_bytes) if holdout is not None else None
    labels = tuple(sorted(set(data.expected)))
    if len(data.texts) < MIN_ROWS or len(labels) < 2:
        fail(
            f"{path}: {len(data.texts)} labelled rows over {len(labels)} labels; a head needs at least {MIN_ROWS} "
            "rows and two labels",
            EXIT_NOTHING,
        )
    check_model(settings, hub=True)
    from ticketq_cli.classify_commands import _load_engine

    engine = _load_engine(settings)
    figures = _fit_and_score(engine, data, held, labels, (holdout_share, validation_share, seed), progress)
    figures["head"].save(out)
    _report(figures, path, out, engine.info.standin, json_out)


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


def _report(figures: dict, path: Path, out: Path, standin: bool, json_out: Path | None) -> None:
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
        data = {"head": head.scorer, "summary": summary, "scores": scores, "standin": standin, "input": str(path)}
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
