"""Learned label heads (issue 43): a linear head on the final hidden state at the answer position.

The zero-shot scorer reads the label rows of the LM head at each row's last real token (`scoring`).
A `LabelHead` reads the same hidden state (B, H) and multiplies it by its own (L, H) weight: one
logit per label of the team's own categories, a softmax over them. Nothing else changes: the
prompt, the cached prefix, the batched path, the planner. `Engine.forward_batch` asks the head
for its answers where one is attached; `Engine.reference` computes the same hidden state from the
full prompt without a cache (`reference_answer`), so the head is judged against the reference
exactly as the LM head is, and the float32 re-check and the shadow check see its log-probabilities
(the decision gap in the head's logit space: log p1 - log p2 is a difference of two head logits).

A head file is safetensors (tensors `weight` (L, H) and `bias` (L,), float32) with one metadata
entry, `ticketq_head`: JSON with the labels, the model fingerprint (`model_fingerprint`), the
prompt digest (`prompt_digest`) and the training summary. No pickle. A worker refuses a head
whose fingerprint or prompt digest is not its own (`HeadMismatch`, one line, exit status 2).
A schema field's head (`head = "path"`, `fieldheads`) is the same file with `field` and `multi`
in its metadata; a multi-label field's rows are one logistic per label (`yes_logits`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from worker.engine.kernels import dtype_name
from worker.engine.loading import ModelNotFound
from worker.engine.prompt import EncodedTicket, PromptTemplate
from worker.engine.scheduler import Exact
from worker.engine.scoring import make_prediction
from worker.results import Prediction

log = logging.getLogger(__name__)

FORMAT = 1  # the head file's format version, in its metadata
META_KEY = "ticketq_head"


class HeadMismatch(ModelNotFound):
    """A head file that cannot serve here (unreadable, another model, another prompt); one line."""


def model_fingerprint(model: Any) -> str:
    """A digest of the model's architecture and a checksum of its weights (the LM head's first rows
    and the decoder's dense vectors, found by shape; packed weights are opaque), rounded so that
    summation order does not move it. Computed on the float32 model."""
    config = model.config
    head = model.get_output_embeddings().weight
    vectors = [p for p in model.get_decoder().parameters() if p.dim() == 1 and p.layout == torch.strided]
    # summed as bfloat16 values: a model cast to bfloat16 (TICKETQ_RECHECK=never) has the same fingerprint
    sums = [_checksum(head[:64]), sum(_checksum(p) for p in vectors)]
    key = [
        getattr(config, "model_type", "?"),
        getattr(config, "hidden_size", 0),
        getattr(config, "num_hidden_layers", 0),
        getattr(config, "vocab_size", 0),
        [f"{s:.5e}" for s in sums],
    ]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def _checksum(tensor: torch.Tensor) -> float:
    return float(tensor.detach().to(torch.bfloat16).double().sum())


def prompt_digest(prompt: PromptTemplate) -> str:
    """A digest of what decides the answer position's hidden state: the prefix (system text, label
    list, chat template) and the suffix around the ticket."""
    key = [list(prompt.prefix_ids), list(prompt.suffix_ids)]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LabelHead:
    """A fitted head: `weight` (L, H) and `bias` (L,) in float32 over `labels`, for one model and prompt."""

    labels: tuple[str, ...]
    weight: torch.Tensor  # (L, H)
    bias: torch.Tensor  # (L,)
    model: str  # `model_fingerprint` of the model it was fitted on
    prompt: str  # `prompt_digest` of the prompt it was fitted with
    summary: dict = field(default_factory=dict)  # how it was fitted and what it scored
    field: str | None = None  # the schema field it scores (`fieldheads`); None: TICKETQ_HEAD's single field
    multi: bool = False  # a multi-label field's: row l is label l's own logistic (p(yes) = sigmoid)

    @property
    def digest(self) -> str:
        """12 hex digits naming these weights, labels, model and prompt (results carry it)."""
        key = [self.labels, self.model, self.prompt, *([self.field, self.multi] if self.field else [])]
        sha = hashlib.sha256(json.dumps(key).encode())
        sha.update(self.weight.contiguous().numpy().tobytes())
        sha.update(self.bias.contiguous().numpy().tobytes())
        return sha.hexdigest()[:12]

    @property
    def scorer(self) -> str:
        return f"head:{self.digest}"

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, H) final hidden states -> (B, L) float32 log-probabilities over the head's labels."""
        weight, bias = self.weight.to(hidden.device), self.bias.to(hidden.device)
        return torch.log_softmax(hidden.float() @ weight.T + bias, dim=-1)  # (B, L)

    def yes_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """A multi-label head's log-odds of yes: (B, K, H) hidden states, state k at label `rows[k]`'s own
        answer position -> (B, K), each label's logistic on its own state."""
        index = torch.tensor(list(rows))
        weight, bias = self.weight[index].to(hidden.device), self.bias[index].to(hidden.device)  # (K, H), (K,)
        return (hidden.float() * weight).sum(-1) + bias  # (B, K)

    def answers(self, hidden: torch.Tensor, rows: Sequence[EncodedTicket], precision: str,
                zero_shot: Sequence[Prediction] = ()) -> list[Prediction]:  # fmt: skip
        """One `Prediction` per row from its answer-position hidden state (B, H), scored by this head
        (`zero_shot`, the LM head's answers for the same rows, is what a `headfit.StateTap` returns)."""
        table = self.logprobs(hidden).tolist()  # (B, L)
        return [
            replace(make_prediction(dict(zip(self.labels, lps, strict=True)), row, precision), scorer=self.scorer)
            for lps, row in zip(table, rows, strict=True)
        ]

    def reference_answer(self, engine: Any, encoded: EncodedTicket) -> Prediction:
        """The reference: the full prompt, no cache, the whole model's decoder; the head at its last token."""
        ids = torch.tensor([list(engine.prompt.full_ids(encoded))], device=engine.device)  # (1, T)
        hidden = engine.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -1]  # (1, H)
        return self.answers(hidden, [encoded], dtype_name(engine.dtype))[0]

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        meta = {
            "format": FORMAT,
            "labels": list(self.labels),
            "model": self.model,
            "prompt": self.prompt,
            "summary": self.summary,
            **({"field": self.field, "multi": self.multi} if self.field else {}),
        }
        tensors = {"weight": self.weight.float().contiguous(), "bias": self.bias.float().contiguous()}
        save_file(tensors, str(path), metadata={META_KEY: json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> LabelHead:
        """The head in `path`; `HeadMismatch` (one line) for a file that is not one."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = json.loads((handle.metadata() or {}).get(META_KEY, "null"))
                weight, bias = handle.get_tensor("weight"), handle.get_tensor("bias")
        except (OSError, SafetensorError, ValueError) as exc:
            raise HeadMismatch(f"head {path}: cannot be read ({exc}); fit one with `ticketq fit`") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise HeadMismatch(f"head {path}: not a ticketq head file (format {FORMAT}); fit one with `ticketq fit`")
        labels = tuple(meta["labels"])
        if weight.shape[0] != len(labels) or bias.shape != (len(labels),):
            raise HeadMismatch(f"head {path}: {weight.shape[0]} weight rows for {len(labels)} labels")
        return cls(labels, weight.float(), bias.float(), meta["model"], meta["prompt"], meta.get("summary", {}),
                   meta.get("field"), bool(meta.get("multi", False)))  # fmt: skip


def check_head(head: LabelHead, path: str | Path, model: Any, prompt: PromptTemplate) -> None:
    """`HeadMismatch`, one line naming what differs, unless `head` was fitted for `model` and `prompt`."""
    check_model(head, f"head {path}", model)
    digest = prompt_digest(prompt)
    if head.field is not None:
        raise HeadMismatch(f"head {path} was fitted for schema field {head.field!r}: name it in that field's "
                           "`head =` (docs/schemas.md), or fit TICKETQ_HEAD's with `ticketq fit`")  # fmt: skip
    if head.prompt != digest:
        raise HeadMismatch(
            f"head {path} was fitted with another prompt (digest {head.prompt}, this worker's is "
            f"{digest}: system prompt, labels or template changed): fit it again with `ticketq fit`"
        )


def check_model(head: LabelHead, what: str, model: Any) -> None:
    """`HeadMismatch` (one line; `what` names the head) unless `head` was fitted for `model`."""
    fingerprint = model_fingerprint(model)
    if head.model != fingerprint or head.weight.shape[1] != model.config.hidden_size:
        raise HeadMismatch(
            f"{what} was fitted for another model (fingerprint {head.model}, this model's is "
            f"{fingerprint}): fit a head for this model with `ticketq fit`"
        )


def attach_head(path: str | None, engine: Any, *others: Any) -> Any:
    """`engine`, scoring with the head in `path` (TICKETQ_HEAD; nothing where unset) once it is checked
    against `engine`'s model and prompt, and so are `others` (copies of its model in another precision)."""
    if not path:
        return engine
    head = LabelHead.load(path)
    check_head(head, path, engine.model, engine.prompt)
    for runner in (engine, *others):
        runner.head = head
        runner.info = replace(runner.info, scorer=head.scorer)
    log.info("label head %s (%s): %s, fitted on %s tickets", path, head.scorer, ", ".join(head.labels),
             head.summary.get("train", "?"))  # fmt: skip
    return engine


def answer_labels(engine: Any) -> tuple[str, ...]:
    """The labels `engine` answers with: its head's where it has one, else its prompt's."""
    return engine.head.labels if engine.head is not None else tuple(engine.labels)


def zero_shot(engine: Any) -> Any:
    """`engine` scoring zero-shot (the LM head's label rows) for a comparison: a shallow copy without
    the head, of the float32 twin where the engine is re-checked (so its answers are float32's)."""
    base = engine.policy.exact if engine.policy.checked else engine
    view = copy.copy(base)
    view.head, view.policy = None, Exact(view)  # the copy's own policy routes its tickets to the copy
    view.info = replace(base.info, scorer="zero-shot")
    return view
