"""Fitting a label head (`ticketq fit`): hidden states collected from the serving path, a
regularised multinomial logistic regression on them, early stopping on a validation split.

`collect` runs the engine's own batched path (the worker's prompt, the cached prefix, the
planner, duplicates computed once) with a `StateTap` in the head's place: every forward hands it
the final hidden state at each row's answer position (B, H), the same vector the zero-shot scorer
reads, and the zero-shot answers (the engine computes them beside any head) come back as usual
(the comparison `ticketq fit` prints). Only those vectors are kept (N x H floats: 3.5 MB for 1,000
tickets on a 896-wide model); no logits. `collect_fields` does the same for a schema (a
`FieldStateTap` in a `FieldsEngine`'s heads' slot): the state at every question's answer
position, (N, Q, H).

`fit_head` standardises the features, fits softmax regression with an L2 penalty by full-batch
Adam for each penalty of `PENALTIES`, stops when the validation loss has not improved for
`PATIENCE` checks, keeps the penalty with the best validation loss, and folds the
standardisation back into the weights, so serving is one (H x L) product. `fit_field_head` fits a
schema field's: multinomial for a single-label field, one logistic per label (one-vs-rest, each a
two-class softmax whose logit difference is kept) for a multi-label one.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ticketq.fieldanswers import ZERO_SHOT
from ticketq.schema import Field
from worker.engine.fieldheads import field_prompt_digest
from worker.engine.head import LabelHead, model_fingerprint, prompt_digest
from worker.engine.prompt import EncodedTicket
from worker.results import Prediction

PENALTIES = (1e-4, 1e-3, 1e-2)  # L2 on the standardised weights, chosen on the validation split
MAX_STEPS = 2000
CHECK_EVERY = 10  # steps between validation checks
PATIENCE = 10  # checks without a better validation loss before stopping
ECE_BINS = 10


class StateTap:
    """Stands in the engine's head slot: records each row's answer-position hidden state, answers nothing
    (the zero-shot scorer answers)."""

    def __init__(self) -> None:
        self.states: dict[tuple[int, ...], torch.Tensor] = {}  # a ticket's token ids -> its (H,) float32 state

    def answers(self, hidden: torch.Tensor, rows: Sequence[EncodedTicket], precision: str,
                zero_shot: Sequence[Prediction] = ()) -> list[Prediction]:  # fmt: skip
        for state, row in zip(hidden.float().cpu(), rows, strict=True):  # (H,) each
            self.states[tuple(row.ids)] = state.clone()
        return list(zero_shot)


class FieldStateTap:
    """Stands in a `FieldsEngine`'s heads (`fieldheads.FieldHeads`): records each row's hidden states at
    every question's answer position, (Q, H), scores nothing (the label tries answer)."""

    scorer = ZERO_SHOT

    def __init__(self, questions: int) -> None:
        self.questions = questions
        self.states: dict[tuple[int, ...], torch.Tensor] = {}  # a ticket's token ids -> its (Q, H) float32 states

    def scorer_of(self, field: str) -> str:
        return ZERO_SHOT

    def score(self, hidden_at: Callable[[int], torch.Tensor], rows: Sequence[EncodedTicket]) -> list[dict]:
        states = torch.stack([hidden_at(q) for q in range(self.questions)], 1).float().cpu()  # (B, Q, H)
        for state, row in zip(states, rows, strict=True):
            self.states[tuple(row.ids)] = state.clone()
        return [{} for _ in rows]


def collect(
    engine, texts: Sequence[str], chunk: int = 256, on_chunk: Callable[[int], None] | None = None
) -> tuple[torch.Tensor, list[Prediction]]:
    """(N, H) answer-position hidden states of `texts` and their zero-shot answers, through the
    engine's batched path a chunk at a time (the tap emptied after each chunk: memory is the states)."""
    return _collect(engine, "head", StateTap(), texts, chunk, on_chunk)


def collect_fields(
    runner, texts: Sequence[str], chunk: int = 256, on_chunk: Callable[[int], None] | None = None
) -> tuple[torch.Tensor, list]:
    """(N, Q, H) hidden states at each question's answer position of a `FieldsEngine` (Q questions: a
    single-label field's one, a multi-label field's one per label) and its zero-shot answers."""
    return _collect(runner, "heads", FieldStateTap(len(runner.questions)), texts, chunk, on_chunk)


def _collect(engine, slot: str, tap, texts: Sequence[str], chunk: int, on_chunk) -> tuple[torch.Tensor, list]:
    """`tap` in `engine`'s head slot `slot` while `texts` run through its batched path, then put back."""
    states, answers, kept = [], [], getattr(engine, slot)
    setattr(engine, slot, tap)
    try:
        for start in range(0, len(texts), chunk):
            part = texts[start : start + chunk]
            encoded = engine.encode(part)
            predictions, _ = engine.classify_encoded(encoded)
            states += [tap.states[tuple(e.ids)] for e in encoded]
            answers += predictions
            tap.states.clear()
            if on_chunk is not None:
                on_chunk(len(part))
    finally:
        setattr(engine, slot, kept)
    return torch.stack(states) if states else torch.empty(0), answers  # (N, H) or (N, Q, H)


@dataclass(frozen=True)
class Split:
    train: list[int]
    validation: list[int]


def split(count: int, share: float, seed: int = 0) -> Split:
    """Indices `0..count` shuffled (seeded) and cut: `share` of them for validation (at least one)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    cut = max(1, round(count * share))
    return Split(sorted(order[cut:]), sorted(order[:cut]))


def fit_head(states: torch.Tensor, targets: torch.Tensor, labels: tuple[str, ...], parts: Split, engine) -> LabelHead:
    """The head fitted on `states[parts.train]` (N, H) -> `targets` (N,) label indices, stopped and its
    penalty chosen on `parts.validation`, for `engine`'s model and prompt."""
    weight, bias, summary = fit_softmax(states, targets, len(labels), parts)
    return LabelHead(labels, weight, bias, model_fingerprint(_float_model(engine)), prompt_digest(engine.prompt),
                     summary)  # fmt: skip


def fit_field_head(states: torch.Tensor, targets: torch.Tensor, spec: Field, parts: Split, runner) -> LabelHead:
    """A schema field's head on a `FieldsEngine`'s states: single-label, `states` (N, H) and `targets` (N,)
    label indices (multinomial); multi-label, `states` (N, L, H) at each label's question and `targets`
    (N, L) 1 for yes, one logistic per label (one-vs-rest)."""
    fit = fit_one_vs_rest if spec.multi else lambda s, t, p: fit_softmax(s, t, len(spec.labels), p)
    weight, bias, summary = fit(states, targets, parts)
    model = model_fingerprint(_float_model(runner.engine))
    return LabelHead(spec.labels, weight, bias, model, field_prompt_digest(runner.prompt, spec.name), summary,
                     spec.name, spec.multi)  # fmt: skip


def _float_model(engine):
    return (engine.policy.exact if engine.policy.checked else engine).model


def fit_one_vs_rest(states: torch.Tensor, targets: torch.Tensor, parts: Split):
    """One logistic per label: label l's (N, H) states -> yes (1) / no (0), each as a two-class softmax
    whose logit difference is the row: (weight (L, H), bias (L,), summary)."""
    rows, biases, fitted = [], [], []
    for label in range(states.shape[1]):
        weight, bias, summary = fit_softmax(states[:, label], targets[:, label].long(), 2, parts)  # (2, H), (2,)
        rows.append(weight[1] - weight[0])  # log-odds of yes: (w_yes - w_no) . h + (b_yes - b_no)
        biases.append(bias[1] - bias[0])
        fitted.append(summary)
    summary = {**fitted[0], "penalty": [f["penalty"] for f in fitted], "steps": [f["steps"] for f in fitted],
               "validation_loss": round(sum(f["validation_loss"] for f in fitted) / len(fitted), 5),
               "fit_s": round(sum(f["fit_s"] for f in fitted), 2)}  # fmt: skip
    return torch.stack(rows).contiguous(), torch.stack(biases).contiguous(), summary


def fit_softmax(states: torch.Tensor, targets: torch.Tensor, classes: int, parts: Split):
    """Softmax regression on `states` (N, H) standardised, each penalty of PENALTIES tried, early-stopped on
    the validation split, the standardisation folded back: (weight (L, H), bias (L,), summary)."""
    started = time.perf_counter()
    train, valid = states[parts.train], states[parts.validation]  # (n, H), (m, H)
    mean, scale = train.mean(0), train.std(0).clamp_min(1e-6)  # (H,), (H,)
    x, xv = (train - mean) / scale, (valid - mean) / scale
    y, yv = targets[parts.train], targets[parts.validation]
    best = None
    for penalty in PENALTIES:
        weight, bias, loss, steps = _fit_one(x, y, xv, yv, classes, penalty)
        if best is None or loss < best[2]:
            best = (weight, bias, loss, steps, penalty)
    weight, bias, loss, steps, penalty = best
    # logits = ((h - mean) / scale) W^T + b = h (W / scale)^T + (b - mean (W / scale)^T)
    folded = weight / scale  # (L, H)
    summary = {
        "train": len(parts.train),
        "validation": len(parts.validation),
        "penalty": penalty,
        "steps": steps,
        "validation_loss": round(loss, 5),
        "fit_s": round(time.perf_counter() - started, 2),
        "hidden": states.shape[1],
    }
    return folded.contiguous(), (bias - mean @ folded.T).contiguous(), summary


def _fit_one(x, y, xv, yv, classes: int, penalty: float):
    """Softmax regression on standardised `x` (n, H) with an L2 `penalty`: (weight (L, H), bias (L,),
    best validation loss, steps), the weights of the best validation check."""
    torch.manual_seed(0)
    weight = torch.zeros(classes, x.shape[1], requires_grad=True)  # (L, H)
    bias = torch.zeros(classes, requires_grad=True)  # (L,)
    optimiser = torch.optim.Adam([weight, bias], lr=0.01)
    best, kept, since = math.inf, (weight.detach().clone(), bias.detach().clone(), 0), 0
    for step in range(1, MAX_STEPS + 1):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ weight.T + bias, y) + penalty * (weight**2).sum()
        loss.backward()
        optimiser.step()
        if step % CHECK_EVERY:
            continue
        with torch.no_grad():
            held = float(torch.nn.functional.cross_entropy(xv @ weight.T + bias, yv))
        if held < best - 1e-5:
            best, kept, since = held, (weight.detach().clone(), bias.detach().clone(), step), 0
        else:
            since += 1
            if since >= PATIENCE:
                break
    return kept[0], kept[1], best, kept[2]


def expected_calibration_error(confidences: Sequence[float], correct: Sequence[bool], bins: int = ECE_BINS) -> float:
    """ECE: over equal-width bins of the top label's probability, the gap between mean confidence and
    accuracy, weighted by the bin's share of the answers."""
    total, error = len(confidences), 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        inside = [i for i, c in enumerate(confidences) if low < c <= high or (b == 0 and c == 0.0)]
        if inside:
            confidence = sum(confidences[i] for i in inside) / len(inside)
            accuracy = sum(correct[i] for i in inside) / len(inside)
            error += len(inside) / total * abs(confidence - accuracy)
    return error
