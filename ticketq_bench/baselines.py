"""The baselines ticketq is measured against, each one a call into the engine's own scoring.

- `sequential`   one ticket at a time, full prompt, constrained label scoring (`Engine.reference`):
                 the reference for agreement and the baseline for speedup.
- `full_prompt`  fixed-size batches of full prompts, nothing cached (`Engine.full_prompt_batch`),
                 planned by `worker.engine.batching`: naive, naive-global, sorted.
- `generate`     the chat template and greedy `model.generate` (`Engine.generate`), the label
                 parsed from the decoded text: what a newcomer writes.

Each returns the answers in ticket order and one `BatchReport` per forward pass, so the report
counts exactly the tokens each way computes. The tensor code is the engine's (`worker.engine`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from ticketq_bench.records import Answer
from worker.engine import batching
from worker.results import BatchReport

Planner = Callable[[Sequence[int], int], batching.Plan]
FULL_PROMPT_PLANNERS: dict[str, Planner] = {
    "naive": lambda lengths, size: batching.plan_fixed(lengths, size),
    "naive-global": batching.plan_global_pad,
    "sorted": lambda lengths, size: batching.plan_fixed(lengths, size, sort=True),
}
GENERATE_NEW_TOKENS = 4


def sequential(engine, texts: list[str], bar: tqdm | None = None) -> tuple[list[Answer], list[BatchReport]]:
    """The article's baseline: one ticket, full prompt, constrained scoring (`Engine.reference`)."""
    plan = batching.plan_sequential([len(e.ids) for e in engine.encode(texts)])  # arrival order, one row each
    answers, reports = [], []
    for batch in plan.batches:
        start = time.perf_counter()
        answers.append(Answer.of(engine.reference(texts[batch.indices[0]])))
        seconds = time.perf_counter() - start
        for path in engine.prompt.trie.branches:  # the reference runs one full-prompt forward per branch
            width = engine.prefix_len + batch.width + len(path)
            reports.append(BatchReport(1, width, width, seconds))
            seconds = 0.0
        _advance(bar, 1)
    return answers, reports


def full_prompt(
    engine, texts: list[str], planner: Planner, batch_size: int, bar: tqdm | None = None
) -> tuple[list[Answer], list[BatchReport]]:
    """Batches from `planner`, each row the FULL prompt (no prefix cache), right-padded to the batch's width."""
    encoded = engine.encode(texts)
    plan = planner([len(e.ids) for e in encoded], batch_size)
    answers: list[Answer | None] = [None] * len(texts)
    reports = []
    for batch in plan.batches:
        predictions, batch_reports = engine.full_prompt_batch([encoded[i] for i in batch.indices], batch.width)
        for index, prediction in zip(batch.indices, predictions, strict=True):
            answers[index] = Answer.of(prediction)
        reports += batch_reports
        _advance(bar, batch.rows)
    return answers, reports  # type: ignore[return-value]


def generate(engine, texts: list[str], bar: tqdm | None = None) -> tuple[list[Answer], list[BatchReport]]:
    """What a newcomer writes: render the chat, `generate` a few tokens greedily, look for a label."""
    answers, reports = [], []
    for text in texts:
        start = time.perf_counter()
        decoded, prompt_tokens, new_tokens = engine.generate(text, GENERATE_NEW_TOKENS)
        computed = prompt_tokens + max(0, new_tokens - 1)  # the last new token is never fed back
        reports.append(BatchReport(1, computed, computed, time.perf_counter() - start))
        answers.append(Answer(parse_label(decoded, engine.labels), new_tokens=new_tokens))
        _advance(bar, 1)
    return answers, reports


def parse_label(decoded: str, labels: Sequence[str]) -> str:
    """The label named first in `decoded` (case-insensitive), else "unparsed"."""
    lowered = decoded.lower()
    found = [(lowered.find(name.lower()), name) for name in labels if name.lower() in lowered]
    return min(found)[1] if found else "unparsed"


def generate_notes(answers: list[Answer], standin: bool) -> list[str]:
    """How often `generate` paid every decode step, and how often no label could be read."""
    full = sum((a.new_tokens or 0) >= GENERATE_NEW_TOKENS for a in answers)
    unparsed = sum(a.label == "unparsed" for a in answers)
    notes = [
        f"generate: {full}/{len(answers)} tickets ran all {GENERATE_NEW_TOKENS} new tokens "
        f"(no early end-of-turn); {unparsed} unparsed"
    ]
    if standin:
        notes.append("generate: stand-in weights never stop early, so it always pays every decode step")
    return notes


def _advance(bar: tqdm | None, tickets: int) -> None:
    if bar is not None:
        bar.update(tickets)
