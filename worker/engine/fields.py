"""Several closed questions ("fields", `ticketq.schema`) per ticket, in one pass over its tokens, exact.

A `FieldsEngine` is a schema compiled on an `Engine`'s model: its own prompt (`FieldsPrompt`), its
own cached prefix (the system prompt describing every field, computed once), and one question per
single-label field or per label of a multi-label field. Every question's full prompt is

    prefix ids + ticket ids + answer opening ids + the question's suffix ids (`priority:`)

so the ticket is computed once per ticket for all of them, in one forward pass per batch. Each
batch row is the ticket and the answer opening (the shared part), then every question's suffix
(and, for a label trie branching below its root, the suffix plus the shared label tokens) as its
own short segment, packed after it:

    [ prefix (cached) ] ticket + opening | category: | priority: | sentiment: | pads

A 4D mask lets each segment see the cached prefix, its own ticket's shared part and itself
(causally), never another segment or a pad, and each segment's position ids start right after the
shared part, so every segment's last token computes exactly what its question's full prompt
computes there. Rows are planned as `Engine.classify` plans its rows (length-sorted, cut by the
cost model under the token budget); every row carries the same segments, so they add no padding.

`reference` is the obvious path the answers must equal (float32 tolerance): one ticket, one
question, its full prompt, no cache, full-vocabulary logits, trie-constrained, a forward per branch.

A field whose schema names a `head` (issue 43, `fieldheads`) is scored by that head from its
questions' answer-position hidden states, in both paths; its result names the head (`scorer`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ticketq.schema import Field, FieldResult, Schema, TicketFields
from worker.engine.batching import Plan, plan_optimal
from worker.engine.cost import CostModel
from worker.engine.fieldheads import FieldHeads, Scored, load_field_heads
from worker.engine.kernels import dtype_name
from worker.engine.layout import packed_mask, padded_ids
from worker.engine.loading import prefix_cache
from worker.engine.prompt import YES, EncodedTicket, FieldsPrompt, PromptTemplate, Question
from worker.engine.scheduler import Exact, Offline, Policy
from worker.engine.scoring import HeadRows, branch_logprobs, choice_logprobs, label_logprobs

Branch = tuple[int, tuple[int, ...]]  # (question index, trie branch path)


class FieldsHost(Protocol):
    """What a `FieldsEngine` uses of the engine whose model it runs on (`model.Engine`): the model,
    its planner settings (read at every plan, so a refitted cost applies here too), and its
    decoder calls."""

    model: Any  # the transformers causal LM (its `config` shapes a batch's cache)
    tokenizer: Any
    prompt: PromptTemplate  # the engine's own: its ticket budget and truncation are the default
    pad_id: int
    device: torch.device
    dtype: torch.dtype
    precision: str  # the arithmetic of its batched path (float32, bfloat16, float16, int8)
    dedup: bool
    max_batch_tokens: int
    max_batch_size: int
    cost: CostModel

    def prime(self, prefix_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]: ...

    def decode(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any,
               keep: torch.Tensor | None = None) -> torch.Tensor: ...  # fmt: skip

    def last_logits(self, ids: Sequence[int]) -> torch.Tensor: ...


class FieldsEngine(Offline):
    """A schema on an engine's model: `classify` (every field in one pass per batch) and `reference`."""

    deferred = False  # its tickets run when planned (`scheduler.BatchEngine`); a re-check's wait

    def __init__(self, engine: FieldsHost, schema: Schema) -> None:
        self.engine = engine
        self.schema = schema
        self.prompt = FieldsPrompt(
            engine.tokenizer, schema, engine.prompt.max_ticket_tokens, engine.prompt.truncation
        )
        self.questions: tuple[Question, ...] = self.prompt.questions
        self.device, self.dtype = engine.device, engine.dtype
        self._prefix_kv = engine.prime(self.prompt.prefix_ids)
        self._rows = {  # (question, path) -> the LM head's rows of that branch's children, (C, H), and its terms
            (q, path): HeadRows.of(engine.model, kids)
            for q, question in enumerate(self.questions)
            for path, kids in question.trie.branches.items()
        }
        # one segment per (question, trie branch): the question's suffix and the branch path; an
        # empty one (the "system" layout's question, scored at the shared part's last token) first
        # (and every question's answer position, where its trie's labels share their first token: a head reads it)
        roots = [(q, ()) for q in range(len(self.questions)) if (q, ()) not in self._rows]
        segments = sorted(
            ((branch, (*self.questions[branch[0]].suffix_ids, *branch[1])) for branch in [*self._rows, *roots]),
            key=lambda item: len(item[1]) > 0,
        )
        self._segments = [branch for branch, _ in segments]
        self.segment_ids = tuple(token for _, ids in segments for token in ids)
        self._segment_of = []  # per segment token: its segment's index
        self._starts = []  # per segment: where it starts in the packed block
        for k, (_, ids) in enumerate(segments):
            self._starts.append(len(self._segment_of))
            self._segment_of += [k] * len(ids)
        self._ends = [start + len(ids) for start, (_, ids) in zip(self._starts, segments, strict=True)]
        self._root = {q: self._segments.index((q, ())) for q in range(len(self.questions))}  # its answer position
        self.heads = FieldHeads(load_field_heads(schema, self.prompt, engine.model), self.questions)
        self.prefix_reuses = 0
        self.policy: Policy = Exact(self)  # how its answers are held to float32's (`Engine.compile`)

    @property
    def dedup(self) -> bool:
        return self.engine.dedup

    @property
    def precision(self) -> str:
        return self.engine.precision

    @property
    def prefix_len(self) -> int:
        return len(self.prompt.prefix_ids)

    def prefix_snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in self._prefix_kv]

    # ----- planning ------------------------------------------------------------------------

    def encode(self, texts: Sequence[object]) -> list[EncodedTicket]:
        return [self.prompt.encode(text) for text in texts]

    def row_length(self, encoded: EncodedTicket) -> int:
        """A batch row: the shared part, then every question's segment."""
        return len(encoded.ids) + len(self.segment_ids)

    def plan(self, encoded: Sequence[EncodedTicket]) -> Plan:
        engine = self.engine
        return plan_optimal(
            [self.row_length(e) for e in encoded],
            max_batch_tokens=engine.max_batch_tokens,
            max_batch_size=engine.max_batch_size,
            cost=engine.cost,
        )

    # ----- the optimised path --------------------------------------------------------------

    @torch.inference_mode()
    def forward_batch(self, tickets: Sequence[EncodedTicket], width: int | None = None) -> list[TicketFields]:
        """One forward over `tickets` (shared part + every segment) right-padded to `width`, after the cached prefix."""
        device, P = self.device, self.prefix_len
        shared = torch.tensor([len(e.ids) for e in tickets], device=device)  # (B,)
        lengths = shared + len(self.segment_ids)  # (B,)
        width = width or int(lengths.max())
        ids = padded_ids([(*e.ids, *self.segment_ids) for e in tickets], width, self.engine.pad_id, device)  # (B, W)
        rows = len(tickets)
        cache = prefix_cache(self.engine.model.config, self._prefix_kv, rows)
        self.prefix_reuses += 1
        # per token: -1 in the shared part, k in segment k, -2 a pad; and its offset inside the packed block
        slot = torch.arange(width, device=device)[None, :] - shared[:, None]  # (B, W) index into the segments
        inside = (slot >= 0) & (slot < len(self.segment_ids))  # (B, W)
        segment_of = torch.tensor(self._segment_of or [0], device=device)  # (S,)
        starts = torch.tensor(self._starts, device=device)  # (K,)
        clamped = slot.clamp(0, max(len(self.segment_ids) - 1, 0))
        segment = torch.where(inside, segment_of[clamped], torch.where(slot < 0, -1, -2))  # (B, W)
        # a segment's tokens are numbered from the end of its own ticket's shared part
        offset = torch.where(inside, starts[segment.clamp(min=0)], 0)  # (B, W)
        positions = P + torch.arange(width, device=device)[None, :] - offset  # (B, W)
        mask = packed_mask(P, segment, self.dtype)  # (B, 1, W, P+W)
        ends = torch.tensor(self._ends, device=device)  # (S,) each segment's end inside the packed block
        hidden = self.engine.decode(ids, mask, positions, cache, keep=shared[:, None] + ends - 1)  # (B, S, H)
        scores = {  # branch -> per row, the log-probs over its children at its segment's last token
            branch: branch_logprobs(hidden[:, index], self._rows[branch]).tolist()  # (B, C)
            for index, branch in enumerate(self._segments) if branch in self._rows
        }
        headed = self.heads.score(lambda q: hidden[:, self._root[q]], tickets)  # issue 43: the fields' heads
        return [self._assemble(e, lambda branch, child, i=i: scores[branch][i][child], headed=headed[i])
                for i, e in enumerate(tickets)]  # fmt: skip

    # ----- reference path ------------------------------------------------------------------

    @torch.inference_mode()
    def reference(self, text: object) -> TicketFields:
        """One ticket, each question's full prompt, no cache, full-vocabulary logits: the answers to match
        in this runner's model (a fast runner's answers are held to its twin's: `policy.reference`)."""
        encoded = self.prompt.encode(text)
        headed = self.heads.score(lambda q: self._reference_state(encoded, q), [encoded])[0]
        logprobs: dict[Branch, torch.Tensor] = {}
        for q, question in enumerate(self.questions):
            full = self.prompt.full_ids(encoded, question)
            for path, kids in question.trie.branches.items() if q not in headed else ():
                logprobs[(q, path)] = choice_logprobs(self.engine.last_logits([*full, *path]), kids)  # (C,)
        return self._assemble(encoded, lambda branch, child: float(logprobs[branch][child]),
                              dtype_name(self.engine.dtype), headed)  # the whole model's precision

    def _reference_state(self, encoded: EncodedTicket, q: int) -> torch.Tensor:
        """Question `q`'s answer-position hidden state (1, H) from its full prompt, no cache (a head reads it)."""
        ids = torch.tensor([self.prompt.full_ids(encoded, self.questions[q])], device=self.device)  # (1, T)
        return self.engine.model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, -1]  # (1, H)

    def _assemble(self, encoded: EncodedTicket, choice: Callable[[Branch, int], float],
                  precision: str | None = None, headed: Scored | None = None) -> TicketFields:  # fmt: skip
        """Each question's answers' log-probs (its head's in `headed`, else from its trie's choices),
        then each field's result."""
        per_question = []
        for q, question in enumerate(self.questions):
            logprobs = (headed or {}).get(q) or label_logprobs(
                question.trie, question.answers, lambda path, child, q=q: choice((q, path), child))  # fmt: skip
            per_question.append({name: math.exp(lp) for name, lp in logprobs.items()})
        fields = {spec.name: field_result(spec, self.questions, per_question, self.heads.scorer_of(spec.name))
                  for spec in self.schema.fields}  # fmt: skip
        return TicketFields(
            schema=self.schema.name,
            fields=fields,
            tokens=encoded.ticket_tokens,
            ticket_tokens=encoded.total_tokens,
            truncation=encoded.truncation if encoded.truncated else None,
            precision=precision or self.engine.precision,
            scorer=self.heads.scorer,
        )


def field_result(spec: Field, questions: Sequence[Question], per_question: Sequence[dict[str, float]],
                 scorer: str) -> FieldResult:  # fmt: skip
    """`spec`'s result from its questions' answer probabilities."""
    asked = [(question, probs) for question, probs in zip(questions, per_question, strict=True)
             if question.field == spec.name]  # fmt: skip
    if spec.multi:
        return FieldResult.several(spec, {q.label: probs[YES] for q, probs in asked}, scorer)
    ((_, probs),) = asked
    return FieldResult.single(spec, probs, scorer)

