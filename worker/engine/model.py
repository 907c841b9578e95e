"""`Engine`: one model replica, a prompt whose prefix KV cache is computed once, and two ways to classify:

- `classify` — the optimised path: tickets planned into length-sorted batches under a token
  budget (`batching`, run by `scheduler`), each batch's rows right-padded after the cached prefix
  (`layout`), and only the label rows of the LM head evaluated at each row's last real token
  (`scoring`).
- `reference` — the obvious path every optimisation is judged against: one ticket at a time,
  the full prompt, no cache, full-vocabulary logits.

`TICKETQ_DTYPE=int8` (CPU) swaps the optimised path's decoder for a copy whose linear layers (all
but the MLP's down projection) run torch's dynamic int8 kernels; the model, the prefix cache and
`reference` stay float32, so every int8 answer is still judged against float32. A fast precision
(bfloat16, int8) is re-checked by default: the engine's `policy` (`worker.engine.policy.Checked`)
holds it to its float32 twin, and the scheduler consults it for which engine computes a ticket and
which answers are computed again, so the labels are float32's. The engine itself only computes,
in its own precision: `forward_batch` and `reference` never hand a ticket to another engine.
`TICKETQ_MATMUL` chooses who multiplies the decoder's weights on a CPU (`kernels`); with the
weights prepacked for oneDNN, batches run through `fused.FusedDecoder`.

`fields(schema)` answers several closed questions per ticket in one pass over its tokens
(`fields.FieldsEngine`); the engine's own `schema` is the single field `classify` answers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ticketq.schema import DEFAULT_SCHEMA_NAME, Schema, TicketFields
from worker.engine.batching import Plan, plan_optimal
from worker.engine.configure import ModelInfo
from worker.engine.cost import CostModel
from worker.engine.fields import FieldsEngine
from worker.engine.fused import FusedDecoder
from worker.engine.head import LabelHead
from worker.engine.int8 import INT8, quantize_linears_int8
from worker.engine.kernels import dtype_name
from worker.engine.layout import padded_ids, prefix_mask
from worker.engine.loading import ModelNotFound, cache_tensors, prefix_cache
from worker.engine.policy import Checked, check
from worker.engine.precision import fields_of
from worker.engine.prompt import EncodedTicket, PromptTemplate
from worker.engine.scheduler import Exact, Offline, Policy
from worker.engine.scoring import HeadRows, branch_logprobs, choice_logprobs, label_logprobs, make_prediction
from worker.results import Prediction

__all__ = ["Engine", "EngineOptions", "ModelInfo", "NoChatTemplate"]

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, kv_heads, P, head_dim) keys and values


class NoChatTemplate(ModelNotFound):
    """The tokenizer has no chat template to render the prompt with; the message names the fix."""


@dataclass(frozen=True)
class EngineOptions:
    """What an engine answers and how it plans: its labels and system prompt, the ticket budget and
    truncation, the batch budget, its own field as a schema (None where built from a ready system
    text), whether batches run fused (`fused`) and whether a run computes duplicates once."""

    labels: tuple[str, ...]
    system: str
    max_ticket_tokens: int = 512
    truncation: str = "head"
    max_batch_tokens: int = 1024
    max_batch_size: int = 64
    schema: Schema | None = None
    fuse: bool = True
    dedup: bool = True  # TICKETQ_DEDUP


class Engine(Offline):
    """A loaded model + prompt, ready to classify. Build a worker's with `replicas.load_engine`."""

    deferred = False  # its tickets run when planned (`scheduler.BatchEngine`); a re-check's wait
    compiles = True  # `compile(schema)` answers a schema's fields on this model (`schemas.SchemaSet`)

    def __init__(self, model, tokenizer, options: EngineOptions, *, cost: CostModel | None = None,
                 info: ModelInfo | None = None, int8: bool = False) -> None:  # fmt: skip
        self.model, self.tokenizer, self.options, self.labels = model, tokenizer, options, options.labels
        _check_chat_template(tokenizer)
        self.prompt = PromptTemplate(tokenizer, options.system, options.labels, options.max_ticket_tokens,
                                     options.truncation)  # fmt: skip
        self.schema = options.schema  # the single field `classify` answers, as a schema (`fields(schema)` too)
        self._fields: dict[str, FieldsEngine] = {}  # schema name -> its FieldsEngine, built on first use
        self.max_batch_tokens, self.max_batch_size = options.max_batch_tokens, options.max_batch_size
        self.dedup = options.dedup
        self.cost = cost or CostModel(fixed_ms=25.0, token_ms=0.8)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.info = info or ModelInfo(
            getattr(model, "name_or_path", "?"), False, str(self.device), INT8 if int8 else str(self.dtype)
        )
        if int8 and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"TICKETQ_DTYPE=int8 needs a float32 model on the CPU, got {self.dtype} on {self.device}")
        self.int8 = int8
        self.policy: Policy = Exact(self)  # how its answers are held to float32's (`replicas.check_with`)
        self.head: LabelHead | None = None  # issue 43: a fitted label head scores the answer position (`head`)
        self.checks: dict[str, Checked] = {}  # schema name -> its runner's re-check policy, where checked
        self.force_recheck = False  # checked whatever the calibration predicts (TICKETQ_RECHECK=always)
        self.float_decoder = model.get_decoder()  # the prefix cache is computed once, exactly, in float32
        self.decoder = quantize_linears_int8(self.float_decoder) if int8 else self.float_decoder
        # the batches' forward with the elementwise work inside oneDNN's GEMMs, where the weights
        # are prepacked; None runs transformers' decoder (the reference path always does)
        self._fused = FusedDecoder.build(self.decoder) if options.fuse else None
        self.info = replace(self.info, fused=self._fused is not None)
        self.label_head = model.get_output_embeddings()  # (V, H) weight; only label rows are used
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.prompt.suffix_ids[0]
        self.prefix_reuses = 0
        # full-vocabulary logits, but only at the last position (older transformers compute all)
        keep_param = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if keep_param else {}
        self._prefix_kv = self.prime(self.prompt.prefix_ids)
        self._branch_rows = {  # label-trie branch -> its children's rows of the LM head, (C, H), and its terms
            path: HeadRows.of(model, kids) for path, kids in self.prompt.trie.branches.items()
        }

    def held_to(self, policy: Checked) -> None:
        """From now on the scheduler routes and screens this engine's tickets by `policy` (its float32 twin's)."""
        self.policy = policy
        self.checks[self._own_schema] = policy

    @property
    def fused(self) -> bool:
        return self._fused is not None

    def unfuse(self) -> None:
        """Run batches through transformers' layers from now on (the self-check's fallback, `selfcheck`)."""
        self._fused, self.options = None, replace(self.options, fuse=False)  # as an engine on its options (`sibling`)
        self.info = replace(self.info, fused=False)

    def error_bounds(self) -> dict[str, tuple[str, float]]:
        """Each re-checked runner's (precision, bound) by schema name (the metrics read it)."""
        return {name: (check.bound.precision, check.bound.bound) for name, check in list(self.checks.items())}

    def observe_shadow(self, served: Prediction | TicketFields, reference: Prediction | TicketFields) -> None:
        """A live shadow check of a fast answer: its error against the reference may widen the bound."""
        check = self.checks.get(served.schema if isinstance(served, TicketFields) else self._own_schema)
        if check is not None and served.precision != "float32":
            check.observe(served, reference, "shadow check")

    @property
    def _own_schema(self) -> str:
        return self.schema.name if self.schema is not None else DEFAULT_SCHEMA_NAME

    @property
    def precision(self) -> str:
        """The arithmetic of the batched path: float32, bfloat16, float16 or int8."""
        return self.info.dtype

    def fields(self, schema: Schema | None = None) -> FieldsEngine:
        """The `FieldsEngine` for `schema` (default: the engine's own) on this model, built once per schema name."""
        schema = schema or self.schema
        if schema is None:
            raise ValueError("this engine was built without a schema: pass one (ticketq.schema.load_schema)")
        runner = self._fields.get(schema.name)
        if runner is None or runner.schema != schema:
            runner = self._fields[schema.name] = self.compile(schema)
        return runner

    def compile(self, schema: Schema) -> FieldsEngine:
        """A new `FieldsEngine` for `schema` on this model, re-checked by the float32 twin's where this engine is."""
        runner = FieldsEngine(self, schema)
        if not isinstance(self.policy, Checked):
            return runner
        exact = self.policy.exact.compile(schema)
        policy = check(runner, exact, self.precision, [*runner.prompt.prefix_ids, -1, *runner.segment_ids],
                       fields_of(schema), self.force_recheck, schema.name)  # fmt: skip
        if policy is None:  # the check would not pay for this schema: float32 answers it
            return exact
        runner.policy = policy
        self.checks[schema.name] = policy
        return runner

    # ----- the model: prefix cache, batched decode, last-position logits --------------------

    @torch.inference_mode()
    def prime(self, prefix_ids: Sequence[int]) -> KV:
        """Run a shared prompt prefix once, in float32; its per-layer K/V are reused by every batch."""
        out = self.float_decoder(input_ids=torch.tensor([list(prefix_ids)], device=self.device), use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        # (1, kv_heads, P, head_dim) per layer, owned by the engine and never written again
        return [(k.detach().clone(), v.detach().clone()) for k, v in cache_tensors(cache)]

    @property
    def prefix_len(self) -> int:
        return len(self.prompt.prefix_ids)

    def prefix_snapshot(self) -> KV:
        """A copy of the base cache, for tests that prove it is never mutated."""
        return [(k.clone(), v.clone()) for k, v in self._prefix_kv]

    def batch_cache(self, rows: int):
        """A fresh cache for one batch holding the prefix, expanded to `rows` (the base is untouched)."""
        self.prefix_reuses += 1
        return prefix_cache(self.model.config, self._prefix_kv, rows)

    def decode(self, ids, mask, positions, cache, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, W, H) of `ids` (B, W) after `cache`, or (B, K, H) at positions `keep` (B, K),
        through the batched path's decoder (fused, int8 where this engine is)."""
        if self._fused is not None:
            return self._fused(ids, mask, positions, cache, keep)
        kwargs = {self._cache_kwarg: cache}
        hidden = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                              **kwargs).last_hidden_state  # fmt: skip
        return hidden if keep is None else hidden.gather(1, keep[:, :, None].expand(-1, -1, hidden.shape[-1]))

    @torch.inference_mode()
    def last_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Full-vocabulary logits (V,) in float32 after the whole sequence `ids`, no cache: the reference's forward."""
        tensor = torch.tensor([list(ids)], device=self.device)  # (1, T)
        return self.model(input_ids=tensor, use_cache=False, **self._last_only).logits[0, -1].float()

    # ----- optimised path ------------------------------------------------------------------

    def encode(self, texts: Sequence[object]) -> list[EncodedTicket]:
        return [self.prompt.encode(text) for text in texts]

    def plan(self, encoded: Sequence[EncodedTicket]) -> Plan:
        return plan_optimal([len(e.ids) for e in encoded], max_batch_tokens=self.max_batch_tokens,
                                     max_batch_size=self.max_batch_size, cost=self.cost)  # fmt: skip

    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[EncodedTicket], width: int | None = None) -> list[Prediction]:
        """One forward pass over `rows` right-padded to `width`, after the cached prefix, in this engine's precision."""
        lengths = torch.tensor([len(r.ids) for r in rows], device=self.device)  # (B,)
        width = width or int(lengths.max())
        ids = padded_ids([row.ids for row in rows], width, self.pad_id, self.device)  # (B, W)
        cache = self.batch_cache(len(rows))
        mask = prefix_mask(self.prefix_len, lengths, width, 0, self.dtype)  # (B, 1, W, P+W)
        positions = self.prefix_len + torch.arange(width, device=self.device).expand(len(rows), -1)  # (B, W)
        last = self.decode(ids, mask, positions, cache, keep=(lengths - 1)[:, None])[:, 0]  # (B, H)
        scores = {}
        for path in self.prompt.trie.branches:  # the root is one only where the labels' first tokens differ
            after = self._continuation(path, lengths, width, cache) if path else last  # (B, H)
            scores[path] = branch_logprobs(after, self._branch_rows[path])  # (B, C)
        answers = [self._prediction(row, lambda path, child, i=i: float(scores[path][i, child]))
                   for i, row in enumerate(rows)]  # fmt: skip
        return self.head.answers(last, rows, self.precision, answers) if self.head else answers  # issue 43, `head`

    def _continuation(self, path: tuple[int, ...], lengths: torch.Tensor, width: int, cache) -> torch.Tensor:
        """Hidden state after a shared label prefix `path`, appended to each row's real tokens via the batch cache."""
        extra = cache.get_seq_length() - (self.prefix_len + width)
        if extra:  # drop a previous continuation's tokens (negative crop works across transformers versions)
            cache.crop(-extra)
        rows = lengths.shape[0]
        ids = torch.tensor(path, device=self.device).expand(rows, -1)  # (B, k)
        mask = prefix_mask(self.prefix_len, lengths, width, len(path), self.dtype)  # (B, 1, k, P+W+k)
        positions = self.prefix_len + lengths[:, None] + torch.arange(len(path), device=self.device)  # (B, k)
        keep = torch.full((rows, 1), len(path) - 1, device=self.device)  # the continuation's last token
        return self.decode(ids, mask, positions, cache, keep)[:, 0]  # (B, H)

    def _prediction(self, encoded: EncodedTicket, choice, precision: str | None = None) -> Prediction:
        """`precision`: what computed it (default: the batched path's)."""
        return make_prediction(label_logprobs(self.prompt.trie, self.labels, choice), encoded,
                               precision or self.precision)  # fmt: skip

    # ----- reference path ------------------------------------------------------------------

    @torch.inference_mode()
    def reference(self, text: object) -> Prediction:
        """The answer to match: one ticket, full prompt, no cache, full logits, in this model (`policy.reference`)."""
        encoded = self.prompt.encode(text)
        if self.head is not None:  # issue 43: the head on the full prompt's last hidden state (`head`)
            return self.head.reference_answer(self, encoded)
        full = self.prompt.full_ids(encoded)
        branch = {path: choice_logprobs(self.last_logits([*full, *path]), kids)  # (C,) per branch
                  for path, kids in self.prompt.trie.branches.items()}  # fmt: skip
        return self._prediction(encoded, lambda path, child: float(branch[path][child]), dtype_name(self.dtype))


def _check_chat_template(tokenizer) -> None:
    """A model without a chat template (a base model) cannot render the prompt: say so in one line."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "?"
        raise NoChatTemplate(
            f"model {name!r} has no chat template to render the prompt with: use an instruct (chat) model, "
            'or add a "chat_template" to its tokenizer_config.json (or a chat_template.jinja beside it)'
        )
