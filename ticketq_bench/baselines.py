"""The baselines ticketq is measured against, each scored as the engine scores (`worker.engine.scoring`).

- `sequential`   one ticket at a time, full prompt, constrained label scoring (`Engine.reference`):
                 the reference for agreement and the baseline for speedup.
- `full_prompt`  fixed-size batches of full prompts, nothing cached (`full_prompt_batch`),
                 planned by `worker.engine.batching`: naive, naive-global (every row padded to the
                 longest ticket), sorted.
- `generate`     the chat template and greedy `model.generate` (`generate_text`), the label
                 parsed from the decoded text: what a newcomer writes.

Each returns the answers in ticket order and one `BatchReport` per forward pass, so the report
counts exactly the tokens each way computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from ticketq_bench.records import Answer
from worker.engine import batching
from worker.engine.layout import padded_ids
from worker.engine.prompt import EncodedTicket, canonical_text
from worker.engine.scoring import OutputTerms, choice_logprobs, label_logprobs, make_prediction
from worker.results import BatchReport, Prediction

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
        predictions, batch_reports = full_prompt_batch(engine, [encoded[i] for i in batch.indices], batch.width)
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
        decoded, prompt_tokens, new_tokens = generate_text(engine, text, GENERATE_NEW_TOKENS)
        computed = prompt_tokens + max(0, new_tokens - 1)  # the last new token is never fed back
        reports.append(BatchReport(1, computed, computed, time.perf_counter() - start))
        answers.append(Answer(parse_label(decoded, engine.labels), new_tokens=new_tokens))
        _advance(bar, 1)
    return answers, reports


@torch.inference_mode()
def full_prompt_batch(engine, rows: Sequence[EncodedTicket], width: int | None = None,
                      ) -> tuple[list[Prediction], list[BatchReport]]:  # fmt: skip
    """`rows` as whole prompts (prefix + ticket + suffix, nothing cached), right-padded to prefix + `width`.

    `Engine.reference` a batch at a time, for the naive, naive-global and sorted modes: at each
    label-trie branch one forward of every row's prompt plus the branch path, and the
    full-vocabulary log-softmax at each row's last real token, restricted to the branch's
    children and renormalised. One report per forward (distinct first label tokens: one in all).
    """
    width = width or max(len(row.ids) for row in rows)
    prompt = engine.prompt
    scores, reports = {}, []
    for path, kids in prompt.trie.branches.items():
        sequences = [[*prompt.prefix_ids, *row.ids, *path] for row in rows]
        padded = engine.prefix_len + width + len(path)
        start = time.perf_counter()
        scores[path] = _full_prompt_scores(engine, sequences, padded, kids)  # (B, C)
        reports.append(BatchReport(len(rows), padded, sum(map(len, sequences)), time.perf_counter() - start))
    predictions = [
        make_prediction(label_logprobs(prompt.trie, engine.labels,
                                       lambda path, child, i=i: float(scores[path][i, child])), row)
        for i, row in enumerate(rows)
    ]  # fmt: skip
    return predictions, reports


def _full_prompt_scores(engine, sequences: list[list[int]], width: int, kids: tuple[int, ...]) -> torch.Tensor:
    """Choice log-probs at each sequence's last real token; the sequences right-padded to `width`, no cache."""
    device = engine.device
    lengths = torch.tensor([len(s) for s in sequences], device=device)  # (B,)
    ids = padded_ids(sequences, width, engine.pad_id, device)  # (B, T)
    mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()  # (B, T), 1 = real
    # the batched path's decoder (int8 where the engine is), every position computed
    hidden = engine.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (B, T, H)
    last = hidden[torch.arange(len(sequences), device=device), lengths - 1]  # (B, H)
    logits = OutputTerms.of(engine.model.config)(engine.label_head(last).float())  # (B, V): the last real token's
    return choice_logprobs(logits, kids).cpu()  # (B, C)


@torch.inference_mode()
def generate_text(engine, text: object, max_new_tokens: int) -> tuple[str, int, int]:
    """The rendered chat prompt and greedy `model.generate`: (the decoded new text, prompt tokens,
    new tokens actually generated); the caller looks for a label in the text, as a newcomer's code would."""
    rendered = engine.prompt.render(canonical_text(text))
    ids = engine.tokenizer(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"].to(engine.device)
    out = engine.model.generate(
        ids,  # (1, T)
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=engine.pad_id,
    )  # (1, T + new)
    new = out[0, ids.shape[1] :]  # (new,)
    return engine.tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], int(new.shape[0])


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
