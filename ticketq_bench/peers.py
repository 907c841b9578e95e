"""The CPU peers of `ticketq bench` on the same model and the same tokens: what they share, and OpenVINO.

Every peer takes a `PeerPrompt` (the engine's prefix, labels and trie as plain data: the bench
runs each peer in its own process) and answers `score_many(tickets)`; `choice_logprobs` and
`prediction_of` are the label trie's constrained scoring over a peer's full-vocabulary logits, as
`Engine.reference` scores. The llama.cpp peer is `ticketq_bench.llama_cpp_peer`.

OpenVINO (`pip install 'ticketq[openvino]'`) runs on the model converted to its IR, length-sorted
batches after the same cached prefix:

- `openvino_model` converts the local transformers model with `openvino.convert_model` (a traced
  wrapper: the engine's own transformers model, its KV cache passed in and out as tensors, the
  mask built from each row's length, full-vocabulary logits at each row's answer position), saves
  the IR in float32 and caches it under `out/openvino/` (and once more with int8 weights by NNCF,
  for `openvino-int8`). optimum-intel's exporter is what a user would run, but it pins its own
  torch and transformers, so the bench converts the model itself.
- `OpenVinoScorer` compiles the IR on the CPU (`INFERENCE_PRECISION_HINT` f32 or bf16, the
  bench's threads), computes the prefix's KV once, then scores length-sorted batches of
  right-padded tickets after it, the label read from the answer-position logits through the label
  trie.

This module imports neither torch nor openvino at import time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ticketq.errors import TicketqError
from worker.engine import batching
from worker.engine.prompt import EncodedTicket, LabelTrie, PromptTemplate
from worker.results import BatchReport, Prediction

OPENVINO_HINT = "pip install 'ticketq[openvino]'"
OPENVINO_PRECISIONS = ("f32", "bf16")  # INFERENCE_PRECISION_HINT values
Progress = Callable[[int], None]  # told how many tickets were just scored


@dataclass(frozen=True)
class PeerPrompt:
    """The engine's prompt as plain, picklable data: what a peer needs to score the same tokens."""

    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    labels: tuple[str, ...]
    sequences: dict[str, tuple[int, ...]]  # label -> its token sequence (the trie's input)
    max_ticket_tokens: int

    @classmethod
    def of(cls, prompt: PromptTemplate) -> PeerPrompt:
        return cls(prompt.prefix_ids, prompt.suffix_ids, prompt.labels, dict(prompt.trie.sequences),
                   prompt.max_ticket_tokens)  # fmt: skip

    @property
    def trie(self) -> LabelTrie:
        return LabelTrie(self.sequences)


class PeerUnavailable(TicketqError, RuntimeError):
    """The peer cannot run here; the message is the one-line reason the bench prints."""


def cache_key(model_dir: Path) -> str:
    """The model files' names, sizes and mtimes, hashed: a converted copy is reused until they change."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    key = hashlib.sha256(repr([(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode())
    return f"{Path(model_dir).resolve().name}-{key.hexdigest()[:12]}"


def choice_logprobs(logits, kids: Sequence[int]) -> list[float]:
    """Full-vocabulary log-probs (V,) restricted to `kids` and renormalised over them, as `Engine.reference`."""
    import numpy as np

    full = logits.astype(np.float64)
    full = full - full.max()
    log_z = math.log(float(np.exp(full).sum()))
    allowed = full[list(kids)] - log_z  # (C,) full-vocabulary log-probs, as the reference takes them
    allowed = allowed - allowed.max()
    return list(allowed - math.log(float(np.exp(allowed).sum())))  # renormalised over the choices


def prediction_of(logprobs: dict[str, float], encoded: EncodedTicket) -> Prediction:
    probs = {name: math.exp(lp) for name, lp in logprobs.items()}
    ranked = sorted(probs, key=probs.__getitem__, reverse=True)
    return Prediction(ranked[0], probs, probs[ranked[0]] - probs[ranked[1]], encoded.truncated, encoded.ticket_tokens)


# ----- OpenVINO -----------------------------------------------------------------------------


def openvino_version() -> str:
    """The installed OpenVINO's version, or PeerUnavailable with the install hint."""
    if importlib.util.find_spec("openvino") is None:
        raise PeerUnavailable(f"openvino is not installed ({OPENVINO_HINT})")
    from importlib.metadata import version

    return version("openvino")


def openvino_model(model_dir: Path, cache: Path, weights: str = "f32") -> Path:
    """`model_dir` converted to OpenVINO IR, cached by the model files' size and mtime.

    `weights` "f32" keeps the model's weights in float32; "int8" is that IR with its weights
    compressed by NNCF (`compress_weights`, INT8_ASYM: per output channel, asymmetric), what an
    OpenVINO user's `optimum-cli export openvino --weight-format int8` gives.
    """
    openvino_version()
    if weights == "int8":
        return _int8_weights(openvino_model(model_dir, cache))
    if weights != "f32":
        raise ValueError(f'weights must be "f32" or "int8", got {weights!r}')
    if not Path(model_dir, "config.json").is_file():
        raise PeerUnavailable(f"{model_dir} is not a local model directory; OpenVINO needs one to convert")
    out = cache / "openvino" / cache_key(model_dir) / "model.xml"
    if out.is_file():
        return out
    import openvino as ov
    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.loading import new_cache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = model.config
    if not hasattr(model.get_decoder(), "layers") or not hasattr(new_cache(model.config), "layers"):
        raise PeerUnavailable("the OpenVINO conversion needs a decoder-only model and transformers >= 4.56")
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    past = torch.zeros(layers, 1, kv_heads, 7, head_dim)  # (L, 1, KVH, P, D): an example prefix of 7 tokens
    example = (torch.ones(2, 5, dtype=torch.long), torch.tensor([5, 3]), past, past)
    shapes = [[-1, -1], [-1], [layers, 1, kv_heads, -1, head_dim], [layers, 1, kv_heads, -1, head_dim]]
    with torch.no_grad():
        converted = ov.convert_model(
            _answer_logits_module()(model), example_input=example, input=[ov.PartialShape(shape) for shape in shapes]
        )
    for port, name in zip(converted.inputs, ("input_ids", "lengths", "past_keys", "past_values"), strict=True):
        port.get_tensor().set_names({name})
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name("partial.xml")
    ov.save_model(converted, partial, compress_to_fp16=False)  # float32 weights: the f32 mode must be exact
    partial.with_suffix(".bin").rename(out.with_suffix(".bin"))
    partial.rename(out)
    return out


def _int8_weights(xml: Path) -> Path:
    """The float32 IR beside `xml` with int8 weights (NNCF), converted once."""
    out = xml.with_name("model-int8.xml")
    if out.is_file():
        return out
    if importlib.util.find_spec("nncf") is None:
        raise PeerUnavailable(f"int8 weights need nncf ({OPENVINO_HINT})")
    import nncf
    import openvino as ov

    compressed = nncf.compress_weights(ov.Core().read_model(xml), mode=nncf.CompressWeightsMode.INT8_ASYM)
    partial = out.with_name("partial-int8.xml")
    ov.save_model(compressed, partial, compress_to_fp16=False)
    partial.with_suffix(".bin").rename(out.with_suffix(".bin"))
    partial.rename(out)
    return out


def _answer_logits_module():
    """The wrapper class, defined on first use: this module imports no torch at import time."""
    import inspect

    import torch

    from worker.engine.loading import new_cache

    class AnswerLogits(torch.nn.Module):
        """The traced graph: a batch after a cached prefix, full-vocabulary logits at each row's last token.

        In: input_ids (B, W) right-padded, lengths (B,), past_keys / past_values (L, 1, KVH, P, D),
        the prefix's cache, shared by every row. Out: logits (B, V) at position lengths - 1, and the
        cache after the batch (L, B, KVH, P + W, D): the prefix's is read from it once.
        """

        def __init__(self, model) -> None:
            super().__init__()
            self.model = model
            forward = inspect.signature(model.get_decoder().forward).parameters
            self.cache_kwarg = "cache" if "cache" in forward else "past_key_values"

        def forward(self, input_ids, lengths, past_keys, past_values):
            rows, width = input_ids.shape
            prefix = past_keys.shape[3]
            cache = new_cache(self.model.config)
            for index, layer in enumerate(cache.layers):
                keys = past_keys[index].expand(rows, -1, -1, -1)  # (B, KVH, P, D), a view
                values = past_values[index].expand(rows, -1, -1, -1)
                # set the layer's tensors directly: its first update() would concatenate an empty
                # 1-D tensor, which OpenVINO's converter rejects
                layer.lazy_initialization(keys, values)
                layer.keys, layer.values = keys, values
            slot = torch.arange(prefix + width) - prefix  # (KV,) key position inside the row region
            query = torch.arange(width)  # (W,)
            real = (slot[None, :] >= 0) & (slot[None, :] < lengths[:, None])  # (B, KV)
            allowed = (slot < 0)[None, None, :] | (real[:, None, :] & (slot[None, :] <= query[:, None])[None])
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]
            positions = prefix + query[None, :].expand(rows, -1)  # (B, W)
            out = self.model.get_decoder()(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                **{self.cache_kwarg: cache},
            )  # fmt: skip
            last = out.last_hidden_state[torch.arange(rows), lengths - 1]  # (B, H)
            logits = self.model.get_output_embeddings()(last)  # (B, V)
            keys, values = zip(*((layer.keys, layer.values) for layer in cache.layers), strict=True)
            return logits, torch.stack(keys), torch.stack(values)  # (B, V), (L, B, KVH, P + W, D) twice

    return AnswerLogits


class OpenVinoScorer:
    """The IR compiled on the CPU, the prefix's KV computed once; length-sorted batches scored after it."""

    def __init__(self, xml: Path, prompt: PeerPrompt, threads: int, precision: str, batch_size: int) -> None:
        import numpy as np
        import openvino as ov

        if precision not in OPENVINO_PRECISIONS:
            raise ValueError(f"precision must be one of {OPENVINO_PRECISIONS}, got {precision!r}")
        self.prompt, self.trie, self.batch_size = prompt, prompt.trie, batch_size
        self.core = ov.Core()
        self.config = {
            "INFERENCE_PRECISION_HINT": precision,  # f32 must be asked for: bf16 is the default on AMX CPUs
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1,
        }
        model = self.core.read_model(xml)
        layers, _, kv_heads, _, head_dim = _static_dims(model.input("past_keys").get_partial_shape())
        empty = np.zeros((layers, 1, kv_heads, 0, head_dim), np.float32)  # no cache before the prefix
        with_cache = self.core.compile_model(model, "CPU", self.config)
        prefix = np.array([prompt.prefix_ids], np.int64)  # (1, P)
        out = with_cache([prefix, np.array([prefix.shape[1]], np.int64), empty, empty])
        self.past = (out[1].copy(), out[2].copy())  # (L, 1, KVH, P, D) each: the prompt cache
        del with_cache, out
        # the same graph without the cache outputs: batches read only their answer-position logits
        logits_only = ov.Model([model.get_results()[0]], model.get_parameters(), "answer-logits")
        self.compiled = self.core.compile_model(logits_only, "CPU", self.config)
        self.request = self.compiled.create_infer_request()
        self.prefix_len = prefix.shape[1]
        self.precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").to_string()  # "f32", "bf16"

    def _logits(self, rows: Sequence[Sequence[int]], width: int):
        """(B, V) float32 logits at each row's last token; rows right-padded to `width`."""
        import numpy as np

        ids = np.full((len(rows), width), self.prompt.suffix_ids[0], np.int64)  # (B, W); pads are masked out
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
        lengths = np.array([len(row) for row in rows], np.int64)  # (B,)
        self.request.infer([ids, lengths, *self.past])
        return self.request.get_output_tensor(0).data  # (B, V)

    def score_batch(self, rows: Sequence[EncodedTicket], width: int) -> tuple[list[Prediction], list[BatchReport]]:
        """One forward per trie branch: the root after the tickets, a shared label prefix appended to each."""
        branch, reports = {}, []
        for path, kids in self.trie.branches.items():
            started = time.perf_counter()
            sequences = [(*row.ids, *path) for row in rows]
            logits = self._logits(sequences, width + len(path))
            branch[path] = [choice_logprobs(logits[i], kids) for i in range(len(rows))]
            real = sum(map(len, sequences))
            reports.append(BatchReport(len(rows), width + len(path), real, time.perf_counter() - started))
        predictions = []
        for i, row in enumerate(rows):
            logprobs = {
                name: sum(branch[path][i][child] for path, child in self.trie.decisions(name))
                for name in self.prompt.labels
            }
            predictions.append(prediction_of(logprobs, row))
        return predictions, reports

    def score_many(
        self, tickets: Sequence[EncodedTicket], progress: Progress | None = None
    ) -> tuple[list[Prediction], list[BatchReport]]:
        """Length-sorted batches of `batch_size` rows, each padded to its longest; answers in ticket order."""
        plan = batching.plan_fixed([len(t.ids) for t in tickets], self.batch_size, sort=True)
        predictions: list[Prediction | None] = [None] * len(tickets)
        reports = []
        for batch in plan.batches:
            got, batch_reports = self.score_batch([tickets[i] for i in batch.indices], batch.width)
            for index, prediction in zip(batch.indices, got, strict=True):
                predictions[index] = prediction
            reports += batch_reports
            if progress is not None:
                progress(batch.rows)
        return predictions, reports  # type: ignore[return-value]


def _static_dims(shape) -> tuple[int, int, int, int, int]:
    """(L, 1, KVH, P, D) of the cache input, P dynamic (read as 0)."""
    return tuple(dim.get_length() if dim.is_static else 0 for dim in shape)  # type: ignore[return-value]
