"""`Engine`: one model replica, a prompt whose prefix KV cache is computed once, and two ways to classify:

- `classify` — the optimised path: tickets planned into length-sorted batches under a token
  budget (`worker.engine.batching`), each batch's rows right-padded after the cached prefix, and only
  the label rows of the LM head evaluated at each row's last real token.
- `reference` — the obvious path every optimisation is judged against: one ticket at a time,
  the full prompt, no cache, full-vocabulary logits.

Two more exist only as the benchmark's baselines (`worker.tools.bench.baselines`), so that its tensor
code lives here too: `full_prompt_batch` (`reference` a padded batch at a time) and `generate`
(the chat template and `model.generate`, what a newcomer writes).

`TICKETQ_DTYPE=int8` (opt-in, CPU) swaps the optimised path's decoder for a copy whose linear
layers (all but the MLP's down projection) run torch's dynamic int8 kernels; the model, the
prefix cache and `reference` stay float32, so every int8 answer is still judged against float32.

`TICKETQ_MATMUL` (on a CPU) chooses who multiplies the decoder's weights: torch's default GEMM
(MKL for float32), or oneDNN on weights prepacked once (`PackedLinear`). In float32 both are IEEE
float32 (only the summation order differs); where oneDNN measures faster at start-up it serves
every path, the reference included. In bfloat16 (a CPU with native bf16) torch's GEMM is oneDNN's
already, re-laying out the plain weight in every call: packed once, the same bits, faster.

`fields(schema)` answers several closed questions per ticket in one pass over its tokens
(`worker.engine.fields`); the engine's own `schema` is the single field `classify` answers.

Both produce trie-constrained label probabilities: at every point where labels diverge, the
softmax over the allowed next tokens (exactly what constrained decoding would choose from). A label
that is a prefix of another ends with the template's end-of-answer token, one of those choices.
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ticketq.schema import Schema, default_schema
from worker.engine import batching
from worker.engine.fused import FusedDecoder
from worker.engine.int8 import INT8, quantize_linears_int8
from worker.engine.kernels import (
    pack_linears,
    resolve_device,
    resolve_dtype,
    resolve_matmul,
)
from worker.engine.loading import STANDIN_MARKER, ModelNotFound, cache_tensors, load_model, prefix_cache
from worker.engine.prompt import EncodedTicket, PromptTemplate, canonical_text, system_text
from worker.results import BatchReport, Prediction
from worker.settings import Settings

log = logging.getLogger(__name__)


# on_predictions(indices into the caller's texts, their predictions): one call per forward batch
PredictionsCallback = Callable[[Sequence[int], list[Prediction]], None]
MoreCallback = Callable[[], Sequence[object]]  # tickets that arrived since the last call (or the start)
Ticketed = tuple[object, EncodedTicket]  # (the engine that computes it, an encoded ticket): a PlannedRun's unit


class NoChatTemplate(ModelNotFound):
    """The tokenizer has no chat template to render the prompt with; the message names the fix."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    standin: bool
    device: str
    dtype: str
    matmul: str = "torch"  # who runs the decoder's float32 linear layers: "torch" (its GEMM) or "onednn"
    fused: bool = False  # batches run through `FusedDecoder` (oneDNN post-ops, float32 attention)


class Engine:
    """A loaded model + prompt, ready to classify. Build with `Engine.from_settings`."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        labels: tuple[str, ...],
        system: str,
        max_ticket_tokens: int = 512,
        max_batch_tokens: int = 1024,
        max_batch_size: int = 64,
        cost: batching.CostModel | None = None,
        info: ModelInfo | None = None,
        int8: bool = False,
        truncation: str = "head",
        schema: Schema | None = None,
        fuse: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.labels = labels
        _check_chat_template(tokenizer)
        self.prompt = PromptTemplate(tokenizer, system, labels, max_ticket_tokens, truncation)
        # the single field `classify` answers, as a schema (`fields(schema)` answers it too); None
        # where the engine was built from a ready system text rather than a system prompt and labels
        self.schema = schema
        self._fields: dict[str, object] = {}  # schema name -> its FieldsEngine, built on first use
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.cost = cost or batching.CostModel(fixed_ms=25.0, token_ms=0.8)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.info = info or ModelInfo(
            getattr(model, "name_or_path", "?"), False, str(self.device), INT8 if int8 else str(self.dtype)
        )
        if int8 and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"TICKETQ_DTYPE=int8 needs a float32 model on the CPU, got {self.dtype} on {self.device}")
        self.int8 = int8
        self.float_decoder = model.get_decoder()  # the prefix cache is computed once, exactly, in float32
        self.decoder = quantize_linears_int8(self.float_decoder) if int8 else self.float_decoder
        # the batches' forward with the elementwise work inside oneDNN's GEMMs, where the weights
        # are prepacked; None runs transformers' decoder (the reference path always does)
        self._fused = FusedDecoder.build(self.decoder) if fuse else None
        self.info = replace(self.info, fused=self._fused is not None)
        self.label_head = model.get_output_embeddings()  # (V, H) weight; only label rows are used
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"
        )
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.prompt.suffix_ids[0]
        )
        self.prefix_reuses = 0
        # full-vocabulary logits, but only at the last position (older transformers compute all)
        forward_params = inspect.signature(model.forward).parameters
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}
        self._prefix_kv = self.prime(self.prompt.prefix_ids)
        self._branch_rows = {
            path: self.label_head.weight[list(kids)].detach()  # (C, H)
            for path, kids in self.prompt.trie.branches.items()
        }

    @classmethod
    def from_settings(cls, settings: Settings) -> Engine:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        device = resolve_device(settings.device)
        int8 = settings.dtype == INT8
        if int8 and device.type != "cpu":
            raise ValueError(f"TICKETQ_DTYPE=int8 runs on the CPU only (torch's dynamic int8 kernels), not {device}")
        dtype = torch.float32 if int8 else resolve_dtype(settings.dtype, device, settings.matmul)
        matmul = resolve_matmul(settings.matmul, device, dtype)
        model, tokenizer = load_model(settings.model, device, dtype)
        if matmul == "onednn" and dtype == torch.bfloat16:
            count = pack_linears(model.get_decoder(), torch.bfloat16)
            log.info("matmul onednn: %d decoder linear layers prepacked for oneDNN (bfloat16, the same GEMMs)", count)
        elif matmul == "onednn":
            count = pack_linears(model.get_decoder())
            log.info("matmul onednn: %d decoder linear layers prepacked for oneDNN (float32, exact)", count)
        standin = Path(settings.model, STANDIN_MARKER).is_file()
        if standin:
            note = json.loads(Path(settings.model, STANDIN_MARKER).read_text())["note"]
            log.warning("model %s is a STAND-IN: %s", settings.model, note)
        if int8:
            log.warning("dtype int8: the batched path is INEXACT (dynamic int8 linears); the reference stays float32")
        info = ModelInfo(
            settings.model, standin, str(device), INT8 if int8 else str(dtype).removeprefix("torch."), matmul
        )
        labels = settings.label_names
        return cls(
            model,
            tokenizer,
            labels=labels,
            system=system_text(settings.system_prompt, labels, settings.label_descriptions),
            max_ticket_tokens=settings.max_ticket_tokens,
            truncation=settings.truncation,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_size=settings.max_batch_size,
            cost=batching.CostModel(settings.cost_fixed_ms, settings.cost_token_ms, settings.cost_quad_ms),
            info=info,
            int8=int8,
            schema=default_schema(labels, settings.system_prompt, settings.label_descriptions),
            fuse=settings.fuse,
        )

    def with_int8(self) -> Engine:
        """The same model, prompt and planner with the int8 batched path (the bench compares both in one run)."""
        return Engine(
            self.model,
            self.tokenizer,
            labels=self.labels,
            system=self.prompt.system,
            max_ticket_tokens=self.prompt.max_ticket_tokens,
            max_batch_tokens=self.max_batch_tokens,
            max_batch_size=self.max_batch_size,
            cost=self.cost,
            info=replace(self.info, dtype=INT8),
            int8=True,
            truncation=self.prompt.truncation,
            schema=self.schema,
            fuse=self._fused is not None,
        )

    def fields(self, schema: Schema | None = None):
        """The `FieldsEngine` for `schema` (default: the engine's own) on this model, built once per schema name."""
        from worker.engine.fields import FieldsEngine

        schema = schema or self.schema
        if schema is None:
            raise ValueError("this engine was built without a schema: pass one (ticketq.schema.load_schema)")
        runner = self._fields.get(schema.name)
        if runner is None or runner.schema != schema:
            runner = self._fields[schema.name] = FieldsEngine(self, schema)
        return runner

    # ----- prefix cache -------------------------------------------------------------------

    @torch.inference_mode()
    def prime(self, prefix_ids: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run a shared prompt prefix once, in float32; its per-layer K/V are reused by every batch."""
        ids = torch.tensor([list(prefix_ids)], device=self.device)  # (1, P)
        out = self.float_decoder(input_ids=ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        # (1, kv_heads, P, head_dim) per layer, owned by the engine and never written again
        return [(k.detach().clone(), v.detach().clone()) for k, v in cache_tensors(cache)]

    @property
    def prefix_len(self) -> int:
        return len(self.prompt.prefix_ids)

    def prefix_snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the base cache, for tests that prove it is never mutated."""
        return [(k.clone(), v.clone()) for k, v in self._prefix_kv]

    def _batch_cache(self, rows: int):
        """A fresh cache for one batch holding the prefix, expanded to `rows` (the base is untouched)."""
        self.prefix_reuses += 1
        return prefix_cache(self.model.config, self._prefix_kv, rows)

    # ----- optimised path ------------------------------------------------------------------

    def encode(self, texts: Sequence[object]) -> list[EncodedTicket]:
        return [self.prompt.encode(text) for text in texts]

    def plan(self, encoded: Sequence[EncodedTicket]) -> batching.Plan:
        return batching.plan_optimal(
            [len(e.ids) for e in encoded],
            max_batch_tokens=self.max_batch_tokens,
            max_batch_size=self.max_batch_size,
            cost=self.cost,
        )

    def classify(
        self,
        texts: Sequence[object],
        plan: batching.Plan | None = None,
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: PredictionsCallback | None = None,
        more: MoreCallback | None = None,
    ) -> tuple[list[Prediction], list[BatchReport]]:
        """Classify `texts` (in their order) with the planned, cached, label-only path.

        `on_predictions(indices, predictions)` gets each forward batch's answers as soon as that
        batch is computed (indices into `texts`), so a server can publish them without waiting
        for the rest of the plan. `more()`, asked before the first forward and after every one,
        returns tickets that arrived meanwhile: they join the ones not yet computed and the rest is
        planned again, so every forward is chosen from everything waiting at its start. Their
        indices follow `texts` (the first one returned is `len(texts)`), and so do their predictions.
        """
        encoded = self.encode(texts)
        return self.classify_encoded(encoded, plan, on_batch, on_predictions, more)

    def classify_encoded(
        self,
        encoded: Sequence[EncodedTicket],
        plan: batching.Plan | None = None,
        on_batch: Callable[[BatchReport], None] | None = None,
        on_predictions: PredictionsCallback | None = None,
        more: MoreCallback | None = None,
    ) -> tuple[list[Prediction], list[BatchReport]]:
        return run_planned(self, encoded, plan, on_batch, on_predictions, more)

    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[EncodedTicket], width: int | None = None) -> list[Prediction]:
        """One forward pass over `rows` right-padded to `width`, after the cached prefix."""
        lengths = torch.tensor([len(r.ids) for r in rows], device=self.device)  # (B,)
        width = width or int(lengths.max())
        ids = padded_ids([row.ids for row in rows], width, self.pad_id, self.device)  # (B, W)
        cache = self._batch_cache(len(rows))
        mask = self._mask(lengths, width, extra=0)  # (B, 1, W, P+W)
        positions = self.prefix_len + torch.arange(width, device=self.device).expand(len(rows), -1)  # (B, W)
        last = self._decode(ids, mask, positions, cache, keep=(lengths - 1)[:, None])[:, 0]  # (B, H)
        scores = {}
        for path in self.prompt.trie.branches:  # the root is one only where the labels' first tokens differ
            after = self._continuation(path, lengths, width, cache) if path else last  # (B, H)
            scores[path] = self._branch_scores(path, after)  # (B, C)
        return [self._prediction(i, row, scores) for i, row in enumerate(rows)]

    def _continuation(self, path: tuple[int, ...], lengths: torch.Tensor, width: int, cache) -> torch.Tensor:
        """Hidden state after a shared label prefix `path`, appended to each row's real tokens via the batch cache."""
        extra = cache.get_seq_length() - (self.prefix_len + width)
        if extra:  # drop a previous continuation's tokens (negative crop works across transformers versions)
            cache.crop(-extra)
        rows = lengths.shape[0]
        ids = torch.tensor(path, device=self.device).expand(rows, -1)  # (B, k)
        mask = self._mask(lengths, width, extra=len(path))  # (B, 1, k, P+W+k)
        positions = self.prefix_len + lengths[:, None] + torch.arange(len(path), device=self.device)  # (B, k)
        keep = torch.full((rows, 1), len(path) - 1, device=self.device)  # the continuation's last token
        return self._decode(ids, mask, positions, cache, keep)[:, 0]  # (B, H)

    def _branch_scores(self, path: tuple[int, ...], hidden: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax((hidden @ self._branch_rows[path].T).float(), dim=-1)  # (B, C)

    def _mask(self, lengths: torch.Tensor, width: int, extra: int) -> torch.Tensor:
        """Additive 4D mask: prefix always visible, each row's real tokens causally, pads never.

        With `extra` > 0 the queries are `extra` continuation tokens stored after the padded rows.
        """
        P = self.prefix_len
        kv = torch.arange(P + width + extra, device=self.device)  # (KV,)
        q = torch.arange(extra or width, device=self.device)  # (Q,)
        slot = kv - P  # position of a key inside the row region
        real = (slot >= 0) & (slot < width) & (slot[None, :] < lengths[:, None])  # (B, KV)
        if extra:
            own = (kv >= P + width)[None, :] & (kv[None, :] - P - width <= q[:, None])  # (Q, KV)
            allowed = (slot < 0)[None, None, :] | real[:, None, :] | own[None]  # (B, Q, KV)
        else:
            causal = slot[None, :] <= q[:, None]  # (Q, KV)
            allowed = (slot < 0)[None, None, :] | (real[:, None, :] & causal[None])  # (B, Q, KV)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]  # (B, 1, Q, KV)

    def _decode(self, ids, mask, positions, cache, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (B, W, H) of `ids` (B, W) after `cache`, or (B, K, H) at positions `keep` (B, K)."""
        if self._fused is not None:
            return self._fused(ids, mask, positions, cache, keep)
        out = self.decoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        hidden = out.last_hidden_state
        return hidden if keep is None else hidden.gather(1, keep[:, :, None].expand(-1, -1, hidden.shape[-1]))

    def _prediction(self, row: int, encoded: EncodedTicket, scores: dict) -> Prediction:
        logprobs = {
            name: sum(float(scores[path][row, child]) for path, child in self.prompt.trie.decisions(name))
            for name in self.labels
        }
        return _make_prediction(logprobs, encoded)

    # ----- reference path ------------------------------------------------------------------

    @torch.inference_mode()
    def reference(self, text: object) -> Prediction:
        """One ticket, full prompt, no cache, full-vocabulary logits: the answer to match."""
        encoded = self.prompt.encode(text)
        full = self.prompt.full_ids(encoded)
        branch_logprobs = {}
        for path, kids in self.prompt.trie.branches.items():
            ids = torch.tensor([[*full, *path]], device=self.device)  # (1, T)
            logits = (
                self.model(input_ids=ids, use_cache=False, **self._last_only).logits[0, -1].float()
            )  # (V,)
            branch_logprobs[path] = choice_logprobs(logits, kids)  # (C,)
        logprobs = {
            name: sum(float(branch_logprobs[path][child]) for path, child in self.prompt.trie.decisions(name))
            for name in self.labels
        }
        return _make_prediction(logprobs, encoded)

    # ----- baselines (the benchmark measures the paths above against these) ----------------

    @torch.inference_mode()
    def full_prompt_batch(
        self, rows: Sequence[EncodedTicket], width: int | None = None
    ) -> tuple[list[Prediction], list[BatchReport]]:
        """`rows` as whole prompts (prefix + ticket + suffix, nothing cached), right-padded to prefix + `width`.

        `reference` a batch at a time, for the bench's naive, naive-global and sorted modes: at each
        label-trie branch one forward of every row's prompt plus the branch path, and the
        full-vocabulary log-softmax at each row's last real token, restricted to the branch's
        children and renormalised. One report per forward (distinct first label tokens: one in all).
        """
        width = width or max(len(row.ids) for row in rows)
        scores, reports = {}, []
        for path, kids in self.prompt.trie.branches.items():
            sequences = [[*self.prompt.prefix_ids, *row.ids, *path] for row in rows]
            padded = self.prefix_len + width + len(path)
            start = time.perf_counter()
            scores[path] = self._full_prompt_scores(sequences, padded, kids)  # (B, C)
            reports.append(BatchReport(len(rows), padded, sum(map(len, sequences)), time.perf_counter() - start))
        return [self._prediction(i, row, scores) for i, row in enumerate(rows)], reports

    def _full_prompt_scores(self, sequences: list[list[int]], width: int, kids: tuple[int, ...]) -> torch.Tensor:
        """Choice log-probs at each sequence's last real token; the sequences right-padded to `width`, no cache."""
        lengths = torch.tensor([len(s) for s in sequences], device=self.device)  # (B,)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long, device=self.device)  # (B, T)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq, device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None]).long()  # (B, T), 1 = real
        # the batched path's decoder (int8 where this engine is), every position computed
        hidden = self.decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # (B, T, H)
        last = hidden[torch.arange(len(sequences), device=self.device), lengths - 1]  # (B, H)
        logits = self.label_head(last).float()  # (B, V): full vocabulary, last real token only
        return choice_logprobs(logits, kids).cpu()  # (B, C)

    @torch.inference_mode()
    def generate(self, text: object, max_new_tokens: int) -> tuple[str, int, int]:
        """The bench's `generate` baseline: the rendered chat prompt and greedy `model.generate`.

        Returns (the decoded new text, prompt tokens, new tokens actually generated); the caller
        looks for a label in the text, as a newcomer's code would.
        """
        rendered = self.prompt.render(canonical_text(text))
        ids = self.tokenizer(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"].to(self.device)
        out = self.model.generate(
            ids,  # (1, T)
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=self.pad_id,
        )  # (1, T + new)
        new = out[0, ids.shape[1] :]  # (new,)
        return self.tokenizer.decode(new, skip_special_tokens=True), ids.shape[1], int(new.shape[0])


def run_planned(engine, encoded: Sequence[EncodedTicket], plan: batching.Plan | None,
                on_batch: Callable[[BatchReport], None] | None, on_answers: Callable | None,
                more: MoreCallback | None) -> tuple[list, list[BatchReport]]:  # fmt: skip
    """Run `plan` (default `engine.plan(encoded)`) one forward at a time through `engine.forward_batch`;
    between two forwards, tickets `more()` returns join the ones not yet computed and the rest is
    planned again. For `Engine` and `FieldsEngine` alike (each with its own `encode`, `plan` and
    `forward_batch`); answers come back in the order of `encoded` then of the arrivals."""
    run = PlannedRun(on_batch, on_answers)
    run.add([(engine, e) for e in encoded], plan)
    arrivals = None
    if more is not None:
        def arrivals() -> list[Ticketed]:
            texts = more()
            return [(engine, e) for e in engine.encode(texts)] if texts else []
    return run.run(arrivals)


class PlannedRun:
    """Tickets, each with the engine that computes it (an `Engine`, or one `FieldsEngine` per
    schema: each engine its own cached prefix), run one planned forward at a time.

    Each engine's waiting tickets are planned together (`engine.plan`); a forward holds one
    engine's tickets only. The next forward is the next one planned for the engine whose oldest
    waiting ticket came first, so no schema waits behind another's stream of arrivals. Tickets
    added between forwards join their engine's waiting ones and those are planned again: every
    forward is chosen from everything waiting at its start.
    """

    def __init__(self, on_batch: Callable[[BatchReport], None] | None = None,
                 on_answers: Callable | None = None) -> None:  # fmt: skip
        self.on_batch, self.on_answers = on_batch, on_answers
        self.encoded: list[EncodedTicket] = []
        self.results: list = []
        self.reports: list[BatchReport] = []
        self._plans: dict[int, tuple[object, list[batching.Batch]]] = {}  # id(engine) -> (engine, batches)

    def add(self, tickets: Sequence[Ticketed], plan: batching.Plan | None = None) -> None:
        """Tickets (engine, encoded) join the run, indexed after those before them. `plan`: the
        plan of the first tickets of a one-engine run (indices into `tickets`), else planned here."""
        start = len(self.encoded)
        joining: dict[int, list[int]] = {}
        for index, (engine, encoded) in enumerate(tickets, start):
            self.encoded.append(encoded)
            self.results.append(None)
            joining.setdefault(id(engine), []).append(index)
            self._plans.setdefault(id(engine), (engine, []))
        for key, indices in joining.items():
            engine, batches = self._plans[key]
            if plan is not None and not batches and len(joining) == 1:
                given = plan.batches
            else:
                indices = [i for batch in batches for i in batch.indices] + indices
                given = engine.plan([self.encoded[i] for i in indices]).batches
            self._plans[key] = (engine, [replace(b, indices=tuple(indices[j] for j in b.indices)) for b in given])

    def run(self, more: Callable[[], Sequence[Ticketed]] | None = None) -> tuple[list, list[BatchReport]]:
        """Every forward until nothing waits; `more()` is asked before the first and after each one.
        Returns the answers in ticket order, and one report per forward."""
        arrived = more() if more else ()  # what came while the caller set up: the first forward sees it too
        while True:
            if arrived:
                self.add(arrived)
            plans = self._plans.items()
            oldest = {key: min(i for b in batches for i in b.indices) for key, (_, batches) in plans if batches}
            if not oldest:
                break
            engine, batches = self._plans[min(oldest, key=oldest.__getitem__)]
            batch = batches.pop(0)
            start = time.perf_counter()
            answers = engine.forward_batch([self.encoded[i] for i in batch.indices], width=batch.width)
            report = BatchReport(batch.rows, batch.width, batch.real_tokens, time.perf_counter() - start)
            for index, answer in zip(batch.indices, answers, strict=True):
                self.results[index] = answer
            self.reports.append(report)
            if self.on_batch:
                self.on_batch(report)
            if self.on_answers:
                self.on_answers(batch.indices, answers)
            arrived = more() if more else ()
        assert all(r is not None for r in self.results), "the plan must cover every ticket"
        return self.results, self.reports


def padded_ids(rows: Sequence[Sequence[int]], width: int, pad_id: int, device: torch.device) -> torch.Tensor:
    """Token rows right-padded with `pad_id` to `width`: (B, W)."""
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, device=device)
    return ids


def _check_chat_template(tokenizer) -> None:
    """A model without a chat template (a base model) cannot render the prompt: say so in one line."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "?"
        raise NoChatTemplate(
            f"model {name!r} has no chat template to render the prompt with: use an instruct (chat) model, "
            'or add a "chat_template" to its tokenizer_config.json (or a chat_template.jinja beside it)'
        )


def choice_logprobs(logits: torch.Tensor, kids: tuple[int, ...]) -> torch.Tensor:
    """Full-vocabulary log-probs restricted to a branch's children, renormalised over them: (..., V) -> (..., C)."""
    allowed = torch.log_softmax(logits, dim=-1)[..., list(kids)]  # (..., C) full-vocab log-probs
    return torch.log_softmax(allowed, dim=-1)  # (..., C) renormalised over the choices


def _make_prediction(logprobs: dict[str, float], encoded: EncodedTicket) -> Prediction:
    probs = {name: float(torch.tensor(lp).exp()) for name, lp in logprobs.items()}
    ranked = sorted(probs, key=probs.__getitem__, reverse=True)
    return Prediction(
        label=ranked[0],
        probs=probs,
        margin=probs[ranked[0]] - probs[ranked[1]],
        truncated=encoded.truncated,
        tokens=encoded.ticket_tokens,
    )

