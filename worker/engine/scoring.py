"""Label scoring: trie-constrained probabilities from the model's logits or final hidden states.

At every point where the labels (or a question's answers) diverge, the softmax over the allowed
next tokens only, exactly what constrained decoding would choose from; a label's log-probability
is the sum of its choices down the trie (`prompt.LabelTrie.decisions`). A label that is a prefix of
another ends with the template's end-of-answer token, one of those choices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from worker.engine.prompt import EncodedTicket, LabelTrie
from worker.results import Prediction

Choice = Callable[[tuple[int, ...], int], float]  # (trie branch path, child index) -> its log-prob


def choice_logprobs(logits: torch.Tensor, kids: tuple[int, ...]) -> torch.Tensor:
    """Full-vocabulary log-probs restricted to a branch's children, renormalised over them: (..., V) -> (..., C)."""
    allowed = torch.log_softmax(logits, dim=-1)[..., list(kids)]  # (..., C) full-vocab log-probs
    return torch.log_softmax(allowed, dim=-1)  # (..., C) renormalised over the choices


def branch_logprobs(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Log-probs over a branch's children from final hidden states (B, H) and their label-head rows (C, H): (B, C).

    The same numbers as `choice_logprobs` on the full logits: the renormalisation cancels every
    token but the children."""
    return torch.log_softmax((hidden @ rows.T).float(), dim=-1)


def label_logprobs(trie: LabelTrie, names: Iterable[str], choice: Choice) -> dict[str, float]:
    """Each name's log-probability: the sum of its choices down `trie`."""
    return {name: sum(choice(path, child) for path, child in trie.decisions(name)) for name in names}


def make_prediction(logprobs: dict[str, float], encoded: EncodedTicket, precision: str = "float32") -> Prediction:
    """The `Prediction` of a single-label question from its labels' log-probabilities (computed in `precision`)."""
    probs = {name: float(torch.tensor(lp).exp()) for name, lp in logprobs.items()}
    ranked = sorted(probs, key=probs.__getitem__, reverse=True)
    return Prediction(
        label=ranked[0],
        probs=probs,
        margin=probs[ranked[0]] - probs[ranked[1]],
        truncated=encoded.truncated,
        tokens=encoded.ticket_tokens,
        precision=precision,
    )
