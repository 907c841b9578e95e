"""Fitting a label head (`ticketq fit`): hidden states collected from the serving path, a
regularised multinomial logistic regression on them, early stopping on a validation split.

`collect` runs the engine's own batched path (the worker's prompt, the cached prefix, the
planner, duplicates computed once) with a `StateTap` in the head's place: every forward hands it
the final hidden state at each row's answer position (B, H), the same vector the zero-shot scorer
reads, and the zero-shot answers (the engine computes them beside any head) come back as usual
(the comparison `ticketq fit` prints). Only
those vectors are kept (N x H floats: 3.5 MB for 1,000 tickets on a 896-wide model); no logits.

`fit_head` standardises the features, fits softmax regression with an L2 penalty by full-batch
Adam for each penalty of `PENALTIES`, stops when the validation loss has not improved for
`PATIENCE` checks, keeps the penalty with the best validation loss, and folds the
standardisation back into the weights, so serving is one (H x L) product.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

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


def collect(
    engine, texts: Sequence[str], chunk: int = 256, on_chunk: Callable[[int], None] | None = None
) -> tuple[torch.Tensor, list[Prediction]]:
    """(N, H) answer-position hidden states of `texts` and their zero-shot answers, through the
    engine's batched path a chunk at a time (the tap emptied after each chunk: memory is the states)."""
    tap, states, answers = StateTap(), [], []
    engine.head = tap
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
        engine.head = None
    return torch.stack(states) if states else torch.empty(0), answers  # (N, H)


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
    started = time.perf_counter()
    train, valid = states[parts.train], states[parts.validation]  # (n, H), (m, H)
    mean, scale = train.mean(0), train.std(0).clamp_min(1e-6)  # (H,), (H,)
    x, xv = (train - mean) / scale, (valid - mean) / scale
    y, yv = targets[parts.train], targets[parts.validation]
    best = None
    for penalty in PENALTIES:
        weight, bias, loss, steps = _fit_one(x, y, xv, yv, len(labels), penalty)
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
    fp = model_fingerprint((engine.policy.exact if engine.policy.checked else engine).model)
    return LabelHead(
        labels, folded.contiguous(), (bias - mean @ folded.T).contiguous(), fp, prompt_digest(engine.prompt), summary
    )


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
