"""Label scoring: trie-constrained probabilities from the model's logits or final hidden states.

At every point where the labels (or a question's answers) diverge, the softmax over the allowed
next tokens only, exactly what constrained decoding would choose from; a label's log-probability
is the sum of its choices down the trie (`prompt.LabelTrie.decisions`). A label that is a prefix of
another ends with the template's end-of-answer token, one of those choices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from worker.engine.prompt import EncodedTicket, LabelTrie
from worker.results import Prediction

Choice = Callable[[tuple[int, ...], int], float]  # (trie branch path, child index) -> its log-prob


def choice_logprobs(logits: torch.Tensor, kids: tuple[int, ...]) -> torch.Tensor:
    """Full-vocabulary log-probs restricted to a branch's children, renormalised over them: (..., V) -> (..., C)."""
    allowed = torch.log_softmax(logits, dim=-1)[..., list(kids)]  # (..., C) full-vocab log-probs
    return torch.log_softmax(allowed, dim=-1)  # (..., C) renormalised over the choices


@dataclass(frozen=True)
class OutputTerms:
    """What a family's causal-LM head does to the logits after its matmul, in transformers' order
    (elementwise, per token: so it applies to any subset of the vocabulary alike)."""

    divide: float = 1.0  # Granite's `logits_scaling`: logits / s
    multiply: float = 1.0  # Cohere's `logit_scale`, Falcon-H1's `lm_head_multiplier`: logits * s
    softcap: float | None = None  # Gemma 2/3's `final_logit_softcapping`: cap * tanh(logits / cap)

    @classmethod
    def of(cls, config: Any) -> OutputTerms:
        """The terms `config` (a causal LM's) asks for; none for Llama-style heads."""
        text = getattr(config, "text_config", None) or config  # a multimodal config keeps them in its text part
        multiply = (getattr(text, "logit_scale", None) or 1.0) * (getattr(text, "lm_head_multiplier", None) or 1.0)
        return cls(float(getattr(text, "logits_scaling", None) or 1.0), float(multiply),
                   getattr(text, "final_logit_softcapping", None) or None)  # fmt: skip

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.divide != 1.0:
            logits = logits / self.divide
        if self.multiply != 1.0:
            logits = logits * self.multiply
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(frozen=True)
class HeadRows:
    """The LM head restricted to some tokens (a label-trie branch's children): their logits alone."""

    weight: torch.Tensor  # (C, H)
    bias: torch.Tensor | None  # (C,), where the head has a bias
    terms: OutputTerms

    @classmethod
    def of(cls, model: Any, tokens: Iterable[int]) -> HeadRows:
        """`model`'s (a causal LM's) head rows of `tokens`."""
        head, tokens = model.get_output_embeddings(), list(tokens)
        bias, dtype = getattr(head, "bias", None), getattr(head, "dtype", head.weight.dtype)  # a `CastTable`'s
        return cls(head.weight[tokens].detach().to(dtype), None if bias is None else bias[tokens].detach().to(dtype),
                   OutputTerms.of(model.config))  # fmt: skip

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) final hidden states -> (B, C) float32 logits of these tokens, the family's terms applied."""
        logits = hidden @ self.weight.T  # (B, C)
        if self.bias is not None:
            logits = logits + self.bias
        return self.terms(logits.float())


def branch_logprobs(hidden: torch.Tensor, rows: HeadRows) -> torch.Tensor:
    """Log-probs over a branch's children from final hidden states (B, H) and their head rows: (B, C).

    The same numbers as `choice_logprobs` on the full logits: the renormalisation cancels every
    token but the children."""
    return torch.log_softmax(rows.logits(hidden), dim=-1)


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
