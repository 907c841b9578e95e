"""Label heads for a schema's fields (issue 43): a field's `head = "path"` (docs/schemas.md).

A `FieldsEngine` computes, for every question of its schema, the final hidden state at the
question's answer position (the last token of its segment: `category:`, or `topics: refund?`),
exactly as that question's full prompt computes it. A single-label field's head reads its one
question's state (B, H) and answers a softmax over the field's labels, as TICKETQ_HEAD does; a
multi-label field's head is one logistic per label (one-vs-rest), label l's read at its own
question's state: p(yes) = sigmoid(w_l . h_l + b_l), so the decision gap the re-check and the
shadow check measure (the log-odds) is the head's logit itself.

`FieldHeads.score` gives, per row, the log-probabilities of every headed question's answers; the
engine scores the other questions along their label tries as before (`fields`). The reference
computes each headed question's state from its full prompt, no cache (`FieldsEngine.reference`).

A head file is `head.LabelHead`'s, with `field` and `multi` in its metadata. It is checked against
the model's fingerprint and the field's prompt digest (the schema's prefix, the answer opening,
the field's question suffixes: everything its states depend on): `HeadMismatch`, one line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ticketq.fieldanswers import ZERO_SHOT
from ticketq.schema import Field, Schema
from worker.engine.head import HeadMismatch, LabelHead, check_model
from worker.engine.prompt import NO, YES, EncodedTicket, FieldsPrompt, Question

HiddenAt = Callable[[int], torch.Tensor]  # question index -> its answer position's states, (B, H)
Scored = dict[int, dict[str, float]]  # question index -> its answers' log-probabilities


def field_prompt_digest(prompt: FieldsPrompt, field: str) -> str:
    """A digest of what decides `field`'s answer positions' hidden states."""
    asked = [list(question.suffix_ids) for question in prompt.questions if question.field == field]
    key = [list(prompt.prefix_ids), list(prompt.template.suffix_ids), field, asked]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def load_field_heads(schema: Schema, prompt: FieldsPrompt, model: Any) -> dict[str, LabelHead]:
    """The heads `schema`'s fields name, each checked against `model` and `prompt` (`HeadMismatch`)."""
    return {spec.name: load_field_head(spec, prompt, model) for spec in schema.fields if spec.head}


def load_field_head(spec: Field, prompt: FieldsPrompt, model: Any) -> LabelHead:
    """`spec.head`, once it is known to be a head for this field, model and prompt."""
    assert spec.head is not None
    head = LabelHead.load(spec.head)
    what = f"schema {prompt.schema.name} field {spec.name}'s head {spec.head}"
    check_model(head, what, model)
    if head.multi != spec.multi or set(head.labels) != set(spec.labels):
        kind = lambda multi: "multi-label" if multi else "single-label"  # noqa: E731
        raise HeadMismatch(
            f"{what} was fitted for other labels ({kind(head.multi)}: {', '.join(head.labels)}; the field is "
            f"{kind(spec.multi)}: {', '.join(spec.labels)}): fit it again with `ticketq fit --schema`"
        )
    digest = field_prompt_digest(prompt, spec.name)
    if head.prompt != digest:
        raise HeadMismatch(
            f"{what} was fitted with another prompt (digest {head.prompt}, this schema's is {digest}: its "
            "system text, fields, labels or the template changed): fit it again with `ticketq fit --schema`"
        )
    return head


def check_schema_heads(schemas: Sequence[Schema], engine: Any) -> str:
    """At start-up: every head the `schemas` name is readable and fitted for `engine`'s model and that
    schema's prompt (`HeadMismatch`, one line), before a ticket names the schema. What they are, for
    the model-info metric: `schema.field=head:<digest>`, space-separated ("" for none)."""
    found = []
    for schema in schemas:
        if any(spec.head for spec in schema.fields):
            prompt = FieldsPrompt(engine.tokenizer, schema, engine.prompt.max_ticket_tokens, engine.prompt.truncation)
            heads = load_field_heads(schema, prompt, engine.model)
            found += [f"{schema.name}.{name}={head.scorer}" for name, head in heads.items()]
    return " ".join(found)


class FieldHeads:
    """A schema's field heads on its questions: which questions each scores, and the scores."""

    def __init__(self, heads: Mapping[str, LabelHead], questions: Sequence[Question]) -> None:
        self.heads = dict(heads)
        self.asked = {name: [q for q, question in enumerate(questions) if question.field == name] for name in heads}
        self.labels = {q: question.label for q, question in enumerate(questions)}  # multi-label: its label

    def __bool__(self) -> bool:
        return bool(self.heads)

    def scorer_of(self, field: str) -> str:
        head = self.heads.get(field)
        return head.scorer if head is not None else ZERO_SHOT

    @property
    def scorer(self) -> str:
        """Every headed field's scorer (`field=head:<digest>`, comma-separated), or "zero-shot"."""
        return ",".join(f"{name}={head.scorer}" for name, head in self.heads.items()) or ZERO_SHOT

    def score(self, hidden_at: HiddenAt, rows: Sequence[EncodedTicket]) -> list[Scored]:
        """Per row, each headed question's answers' log-probabilities (`hidden_at` is asked for those only)."""
        scored: list[Scored] = [{} for _ in rows]
        for name, head in self.heads.items():
            asked = self.asked[name]
            if head.multi:
                states = torch.stack([hidden_at(q) for q in asked], 1)  # (B, K, H)
                odds = head.yes_logits(states, [head.labels.index(self.labels[q]) for q in asked])  # (B, K)
                yes, no = torch.nn.functional.logsigmoid(odds).tolist(), torch.nn.functional.logsigmoid(-odds).tolist()
                for row, found in enumerate(scored):
                    found.update({q: {YES: yes[row][k], NO: no[row][k]} for k, q in enumerate(asked)})
            else:
                (q,) = asked
                table = head.logprobs(hidden_at(q)).tolist()  # (B, L)
                for row, found in enumerate(scored):
                    found[q] = dict(zip(head.labels, table[row], strict=True))
        return scored
