"""The shape of a schema's answers: one field's (`FieldResult`) and a ticket's (`TicketFields`).

The contract layer: plain Python, no torch. `ticketq.schema` re-exports both beside the schemas
whose fields they answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

ZERO_SHOT = "zero-shot"  # the scorer that reads the LM head's label rows (a fitted head: "head:<digest>")


class Field(Protocol):
    """What an answer reads of its field (`ticketq.schema.Field`)."""

    name: str
    labels: Sequence[str]
    threshold: float
    select: float


@dataclass(frozen=True)
class FieldResult:
    """One field's answer for one ticket.

    Single-label: `label` is the most probable label, `probs` sums to 1 over the labels, and
    `confidence` is the top probability's margin over the runner-up. Multi-label: `labels` are the
    labels whose yes-probability is above the field's `select`, `probs` holds each label's own
    yes-probability, and `confidence` is the weakest of those yes/no decisions: the smallest distance
    of a probability from `select`, over the farthest it could be (with `select` 0.5, |p(yes) - p(no)|).
    `review` is `confidence < threshold`. `scorer` names a fitted head that scored the field (the
    field's `head`, issue 43): its JSON carries it then, and only then.
    """

    field: str
    label: str | None  # single-label: the answer; multi-label: None
    labels: tuple[str, ...]  # the chosen labels (single-label: just `label`)
    probs: dict[str, float]
    confidence: float
    review: bool
    multi: bool = False
    scorer: str = ZERO_SHOT  # who scored it: the LM head's label rows, or the field's head ("head:<digest>")

    def to_json(self) -> dict[str, Any]:
        answer: dict[str, Any] = {"labels": list(self.labels)} if self.multi else {"label": self.label}
        scorer = {"scorer": self.scorer} if self.scorer != ZERO_SHOT else {}
        return {**answer, "probs": self.probs, "confidence": self.confidence, "review": self.review, **scorer}

    @classmethod
    def single(cls, spec: Field, probs: dict[str, float], scorer: str = ZERO_SHOT) -> FieldResult:
        ranked = sorted(probs, key=probs.__getitem__, reverse=True)
        confidence = probs[ranked[0]] - probs[ranked[1]]
        return cls(spec.name, ranked[0], (ranked[0],), probs, confidence, confidence < spec.threshold, scorer=scorer)

    @classmethod
    def several(cls, spec: Field, probs: dict[str, float], scorer: str = ZERO_SHOT) -> FieldResult:
        chosen = tuple(name for name in spec.labels if probs[name] > spec.select)
        reach = max(spec.select, 1.0 - spec.select)
        confidence = min(abs(p - spec.select) for p in probs.values()) / reach
        return cls(spec.name, None, chosen, probs, confidence, confidence < spec.threshold, multi=True, scorer=scorer)


@dataclass(frozen=True)
class TicketFields:
    """Every field's answer for one ticket, and how much of the ticket the model read."""

    schema: str
    fields: dict[str, FieldResult]
    tokens: int  # ticket tokens the model read (after truncation)
    ticket_tokens: int  # ticket tokens before truncation
    truncation: str | None  # None: read whole; else the mode that cut it (head, tail, head+tail)
    precision: str = "float32"  # the arithmetic that answered: float32, bfloat16, float16 or int8
    rechecked: bool = False  # answered in float32 after the fast precision's answer fell within its error bound
    # who scored the labels: "zero-shot", or each field with a head as `field=head:<digest>`, comma-separated
    scorer: str = ZERO_SHOT

    @property
    def truncated(self) -> bool:
        return self.truncation is not None

    @property
    def review(self) -> bool:
        return any(result.review for result in self.fields.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "fields": {name: result.to_json() for name, result in self.fields.items()},
            "review": self.review,
            "truncated": self.truncated,
            "truncation": self.truncation,
            "tokens": self.tokens,
            "ticket_tokens": self.ticket_tokens,
        }
