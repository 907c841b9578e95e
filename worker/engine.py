"""The classification engine: the only module that touches tensors.

One model replica, a prompt whose prefix KV cache is computed once, and two ways to classify:

- `classify` — the optimised path: tickets planned into length-sorted batches under a token
  budget (`worker.batching`), each batch's rows right-padded after the cached prefix, and only
  the label rows of the LM head evaluated at each row's last real token.
- `reference` — the obvious path every optimisation is judged against: one ticket at a time,
  the full prompt, no cache, full-vocabulary logits.

Two more exist only as the benchmark's baselines (`worker.bench.baselines`), so that its tensor
code lives here too: `full_prompt_batch` (`reference` a padded batch at a time) and `generate`
(the chat template and `model.generate`, what a newcomer writes).

`TICKETQ_DTYPE=int8` (opt-in, CPU) swaps the optimised path's decoder for a copy whose linear
layers (all but the MLP's down projection) run torch's dynamic int8 kernels; the model, the
prefix cache and `reference` stay float32, so every int8 answer is still judged against float32.

`TICKETQ_MATMUL` (float32 on a CPU) chooses who multiplies the decoder's weights: torch's default
GEMM (MKL), or oneDNN on weights prepacked once (`PackedLinear`). Both are IEEE float32 (only the
summation order differs); where oneDNN measures faster at start-up it serves every path, the
reference included.

Both produce trie-constrained label probabilities: at every point where labels diverge, the
softmax over the allowed next tokens (exactly what constrained decoding would choose from).
"""

from __future__ import annotations

import copy
import ctypes
import functools
import inspect
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

import torch

from worker import batching
from worker.prompt import EncodedTicket, PromptTemplate, canonical_text, system_text
from worker.results import BatchReport, Prediction
from worker.settings import Settings
from worker.standin import STANDIN_MARKER

log = logging.getLogger(__name__)


# on_predictions(indices into the caller's texts, their predictions): one call per forward batch
PredictionsCallback = Callable[[Sequence[int], list[Prediction]], None]
MoreCallback = Callable[[], Sequence[object]]  # tickets that arrived since the last call (or the start)


class ModelNotFound(RuntimeError):
    """The model could not be loaded; the message names the stand-in command."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    standin: bool
    device: str
    dtype: str
    matmul: str = "torch"  # who runs the decoder's float32 linear layers: "torch" (its GEMM) or "onednn"


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(line.partition(":")[2].split()) for line in lines if line.startswith("flags")), set())


def cpu_has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


# bfloat16 must beat float32 by this much on the probe to be worth its rounding on a CPU.
BF16_MIN_SPEEDUP = 1.25


def bf16_matmul_speedup(rows: int = 256, reps: int = 3) -> float:
    """float32 time / bfloat16 time of one decoder-sized GEMM (Qwen2.5-0.5B's MLP) on this CPU.

    "Native bf16" in /proc/cpuinfo is not enough: some CPUs with AVX-512 BF16 run the model about
    twice as fast in bfloat16, others (measured here) about twice as slow. A tenth of a second of
    timing settles it.
    """
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(rows, 896).to(dtype)
        b = torch.randn(896, 4864).to(dtype)
        a @ b  # warm-up: kernel selection, packing
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        timings[dtype] = best
    return timings[torch.float32] / timings[torch.bfloat16]


def resolve_dtype(name: str, device: torch.device, matmul: str = "torch") -> torch.dtype:
    """`auto`: bfloat16 on CUDA; on a CPU, bfloat16 only where it has native bf16 AND measures faster
    than float32 (through oneDNN too, unless `matmul` is "torch")."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_has_native_bf16():
        speedup = bf16_matmul_speedup()
        if matmul != "torch" and PackedLinear.available():  # bf16 must beat float32's faster kernel
            speedup /= max(1.0, onednn_linear_speedup())
        dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
        log.info(
            "dtype auto: a bfloat16 GEMM runs %.2fx float32's speed on this CPU -> %s",
            speedup,
            str(dtype).removeprefix("torch."),
        )
        return dtype
    return torch.float32


# oneDNN must beat torch's float32 GEMM by this much on the probe to be worth packing the weights.
ONEDNN_MIN_SPEEDUP = 1.15


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose float32 weight is prepacked for oneDNN's matmul (`mkldnn::_linear_pointwise`).

    torch's float32 `linear` goes to MKL's GEMM, which on some AMD CPUs runs well below the
    machine's AVX-512 peak (measured on a Zen 5 EPYC: 160-210 GFLOPS against oneDNN's 400-480 on
    the decoder's shapes); oneDNN picks its kernels by CPU features. The same float32 arithmetic,
    summed in another order (|difference| ~1e-6 relative). The packed weight is an opaque oneDNN
    tensor that replaces the dense one (no second copy); `to_linear` unpacks it.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)  # (out, in), blocked
        self.bias = linear.bias

    @staticmethod
    def available() -> bool:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def to_linear(self) -> torch.nn.Linear:
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = torch.nn.Parameter(self.packed.to_dense(), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        return self  # read-only, and an opaque tensor cannot be copied: copies of a decoder share it

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(decoder: torch.nn.Module) -> int:
    """Replace every float32 `nn.Linear` in `decoder` by a `PackedLinear`, in place; how many."""
    names = [
        name
        for name, module in decoder.named_modules()
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
    ]
    for name in names:
        _replace_module(decoder, name, PackedLinear(decoder.get_submodule(name)))
        _release_freed_memory()  # else glibc keeps every replaced weight: +1.4 GB RSS on the 0.5B model
    return len(names)


def _replace_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` where `root.get_submodule(name)` was."""
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):  # another C library: nothing to trim with
        return None


def _release_freed_memory() -> None:
    """Hand memory freed by Python back to the OS (glibc keeps freed heap chunks of ~17 MB mapped)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache  # measured once per process: resolve_dtype and resolve_matmul both ask
def onednn_linear_speedup(rows: int = 256, reps: int = 3) -> float:
    """torch's float32 `linear` time / oneDNN's on prepacked weights, one decoder-sized GEMM (the MLP's)."""
    x = torch.randn(rows, 896)
    linear = torch.nn.Linear(896, 4864, bias=False).requires_grad_(False)
    packed = PackedLinear(linear)
    timings = []
    for layer in (linear, packed):
        layer(x)  # warm-up: kernel selection
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - start)
        timings.append(best)
    return timings[0] / timings[1]


def resolve_matmul(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """Who runs the decoder's float32 linear layers: "torch" or "onednn" (`auto`: measured here)."""
    applies = device.type == "cpu" and dtype == torch.float32
    if name == "onednn" and not (applies and PackedLinear.available()):
        raise ValueError(f"TICKETQ_MATMUL=onednn needs float32 on a CPU with oneDNN, got {dtype} on {device}")
    if name != "auto" or not applies or not PackedLinear.available():
        return name if name != "auto" else "torch"
    speedup = onednn_linear_speedup()
    choice = "onednn" if speedup >= ONEDNN_MIN_SPEEDUP else "torch"
    log.info("matmul auto: oneDNN's float32 GEMM runs %.2fx torch's on this CPU -> %s", speedup, choice)
    return choice


INT8 = "int8"  # TICKETQ_DTYPE value: float32 model, int8 decoder linears on the batched path
# Decoder linears the int8 path keeps in float32: the MLP's down projection reads silu(gate) * up,
# whose heavy tail makes one per-batch activation scale too coarse (most of the int8 error, measured).
INT8_FLOAT_LINEARS = ("mlp.down_proj",)


def int8_full_range() -> bool:
    """Whether int8 activations may use all 8 bits: only where the CPU has AVX512-VNNI.

    Without VNNI, fbgemm sums pairs of u8 x s8 products in saturating int16 (vpmaddubsw), which
    is why torch.ao's dynamic linear quantises activations on 7 bits (`reduce_range=True`); VNNI
    accumulates in int32, so the 8th bit is free and halves the activation rounding.
    """
    return "avx512_vnni" in cpu_flags()


@functools.cache
def _full_range_dynamic_linear() -> type[torch.nn.Module]:
    """torch.ao's dynamic int8 `Linear` with its activations quantised on 8 bits (`reduce_range=False`)."""
    from torch.ao.nn.quantized.dynamic import Linear

    class FullRangeDynamicLinear(Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # the packed weight `Linear.forward` passes too (a private name: tests/test_engine.py runs this)
            packed = self._packed_params._packed_params
            return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=False).to(x.dtype)

    return FullRangeDynamicLinear


def quantize_linears_int8(decoder: torch.nn.Module, full_range: bool | None = None) -> torch.nn.Module:
    """A copy of `decoder` whose linear layers but `INT8_FLOAT_LINEARS` run dynamic int8.

    int8 weights with one scale per output channel; activations quantised per batch, on 8 bits
    where `full_range` (default: `int8_full_range()`), else on torch's 7. Chosen by measurement
    (docs/bench/int8-variants.md: 2 x 200 tickets, the full-size stand-in, one thread, a 2-core
    Intel Xeon with AVX512-VNNI; agreement with the float32 reference off the near-ties): every
    linear with one scale per matrix, the first version, 94.3% at 1.75-2.0x float32; per-channel
    scales alone 95.8%, with 8-bit activations 98.2%; down_proj in float32 as well, 99.2% with
    7-bit activations (what a CPU without VNNI runs) and 99.5% with 8 (this), at ~1.5x float32
    (1.49x and 1.59x, best of 3 and of 2 rounds). Most of the error was down_proj's input,
    silu(gate) * up, heavy-tailed under one per-batch scale.

    Speed, measured on a 2-core AVX2 EPYC against float32 on the decoder's GEMM shapes: torch's
    `quantize_dynamic` (fbgemm/x86 int8 kernels) 1.6-3x faster; the int8 weight-only and int8 x
    int8 ops that torchao's CPU configs call (`_weight_int8pack_mm`, `_int_mm`) 20-40x slower
    (on the AVX512-VNNI Xeon, `_int_mm` is on par with fbgemm; `_weight_int8pack_mm` still ~60x).
    The copy shares every float parameter (embeddings, norms, down_proj) with `decoder`, which is
    left untouched for the float32 reference.
    """
    try:
        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic
    except ImportError as exc:  # torch.ao.quantization is deprecated in favour of torchao
        raise RuntimeError(
            f"TICKETQ_DTYPE=int8 needs torch.ao.quantization.quantize_dynamic, absent in torch {torch.__version__}"
        ) from exc
    full_range = int8_full_range() if full_range is None else full_range
    shared = {id(t): t for t in (*decoder.parameters(), *decoder.buffers())}
    quantized = copy.deepcopy(decoder, memo=shared)  # new module tree, the same tensors
    for name, module in list(quantized.named_modules()):  # oneDNN-packed linears to quantise: dense again
        if isinstance(module, PackedLinear) and not name.endswith(INT8_FLOAT_LINEARS):
            _replace_module(quantized, name, module.to_linear())
    spec = {  # by module name: the linears to convert, each with per-channel weight scales
        name: per_channel_dynamic_qconfig
        for name, module in quantized.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith(INT8_FLOAT_LINEARS)
    }
    mapping = {torch.nn.Linear: _full_range_dynamic_linear() if full_range else DynamicLinear}
    with warnings.catch_warnings():  # its deprecation notice, once per start-up, says nothing actionable here
        warnings.simplefilter("ignore")
        quantize_dynamic(quantized, spec, dtype=torch.qint8, mapping=mapping, inplace=True)
    log.info(
        "int8: %d decoder linears in int8 (per-channel weights, %d-bit activations), %s in float32",
        len(spec),
        8 if full_range else 7,
        ", ".join(INT8_FLOAT_LINEARS),
    )
    return quantized


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the model hub answers at all (machines may have no internet)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype):
    """`from_pretrained` for a hub id or a local directory; a clear error when neither works."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Without a reachable hub, look only in the local cache: fail in a second, not after a minute of retries.
    local_only = not Path(name_or_path).is_dir() and not hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, local_files_only=local_only)
    except (OSError, ValueError) as exc:  # ValueError: a directory without a (complete) model
        raise ModelNotFound(
            f"cannot load model {name_or_path!r} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}). "
            "Without model hub access, build the stand-in and point TICKETQ_MODEL at it:\n"
            "    ticketq standin --out models/qwen2.5-0.5b-standin\n"
            "    export TICKETQ_MODEL=models/qwen2.5-0.5b-standin"
        ) from exc
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def _cache_class():
    from transformers import DynamicCache

    return DynamicCache


def _cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.labels = labels
        self.prompt = PromptTemplate(tokenizer, system, labels, max_ticket_tokens)
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
        self._prefix_kv = self._prime_prefix()
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
        if matmul == "onednn":
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
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_size=settings.max_batch_size,
            cost=batching.CostModel(settings.cost_fixed_ms, settings.cost_token_ms, settings.cost_quad_ms),
            info=info,
            int8=int8,
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
        )

    # ----- prefix cache -------------------------------------------------------------------

    @torch.inference_mode()
    def _prime_prefix(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run the shared prompt prefix once; its per-layer K/V are reused by every batch."""
        ids = torch.tensor([self.prompt.prefix_ids], device=self.device)  # (1, P)
        out = self.float_decoder(input_ids=ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        # (1, kv_heads, P, head_dim) per layer, owned by the engine and never written again
        return [(k.detach().clone(), v.detach().clone()) for k, v in _cache_tensors(cache)]

    @property
    def prefix_len(self) -> int:
        return len(self.prompt.prefix_ids)

    def prefix_snapshot(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the base cache, for tests that prove it is never mutated."""
        return [(k.clone(), v.clone()) for k, v in self._prefix_kv]

    def _batch_cache(self, rows: int):
        """A fresh cache for one batch holding the prefix, expanded to `rows` (the base is untouched)."""
        cache_cls = _cache_class()
        try:
            cache = cache_cls(config=self.model.config)
        except TypeError:  # older transformers
            cache = cache_cls()
        for layer, (k, v) in enumerate(self._prefix_kv):
            # expand is a view; the cache's first concatenation copies it into batch-owned storage
            cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
        self.prefix_reuses += 1
        return cache

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
        encoded = list(encoded)
        batches = list((plan or self.plan(encoded)).batches)
        results: list[Prediction | None] = [None] * len(encoded)
        reports = []
        arrived = more() if more else ()  # what came while the caller set up: the first forward sees it too
        while True:
            if arrived:
                encoded.extend(self.encode(arrived))
                results.extend([None] * len(arrived))
                batches = self._replan(encoded, batches, range(len(encoded) - len(arrived), len(encoded)))
            if not batches:
                break
            batch = batches.pop(0)
            start = time.perf_counter()
            predictions = self.forward_batch([encoded[i] for i in batch.indices], width=batch.width)
            report = BatchReport(batch.rows, batch.width, batch.real_tokens, time.perf_counter() - start)
            for index, prediction in zip(batch.indices, predictions, strict=True):
                results[index] = prediction
            reports.append(report)
            if on_batch:
                on_batch(report)
            if on_predictions:
                on_predictions(batch.indices, predictions)
            arrived = more() if more else ()
        assert all(r is not None for r in results), "the plan must cover every ticket"
        return results, reports  # type: ignore[return-value]

    def _replan(
        self, encoded: Sequence[EncodedTicket], batches: Sequence[batching.Batch], arrived: range
    ) -> list[batching.Batch]:
        """One plan over the tickets of `batches` (not computed yet) and the `arrived` ones."""
        waiting = [i for batch in batches for i in batch.indices] + list(arrived)
        plan = self.plan([encoded[i] for i in waiting])  # indices into `waiting`
        return [replace(batch, indices=tuple(waiting[j] for j in batch.indices)) for batch in plan.batches]

    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[EncodedTicket], width: int | None = None) -> list[Prediction]:
        """One forward pass over `rows` right-padded to `width`, after the cached prefix."""
        lengths = torch.tensor([len(r.ids) for r in rows], device=self.device)  # (B,)
        width = width or int(lengths.max())
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=self.device)  # (B, W)
        for i, row in enumerate(rows):
            ids[i, : len(row.ids)] = torch.tensor(row.ids, device=self.device)
        cache = self._batch_cache(len(rows))
        mask = self._mask(lengths, width, extra=0)  # (B, 1, W, P+W)
        positions = self.prefix_len + torch.arange(width, device=self.device).expand(len(rows), -1)  # (B, W)
        hidden = self._decode(ids, mask, positions, cache)  # (B, W, H)
        last = hidden[torch.arange(len(rows), device=self.device), lengths - 1]  # (B, H)
        scores = {(): self._branch_scores((), last)}
        for path in self.prompt.trie.branches:
            if path:
                scores[path] = self._continuation_scores(path, lengths, width, cache)
        return [self._prediction(i, row, scores) for i, row in enumerate(rows)]

    def _continuation_scores(
        self, path: tuple[int, ...], lengths: torch.Tensor, width: int, cache
    ) -> torch.Tensor:
        """Scores after a shared label prefix `path`, appended to each row's real tokens via the batch cache."""
        extra = cache.get_seq_length() - (self.prefix_len + width)
        if extra:  # drop a previous continuation's tokens (negative crop works across transformers versions)
            cache.crop(-extra)
        rows = lengths.shape[0]
        ids = torch.tensor(path, device=self.device).expand(rows, -1)  # (B, k)
        mask = self._mask(lengths, width, extra=len(path))  # (B, 1, k, P+W+k)
        positions = self.prefix_len + lengths[:, None] + torch.arange(len(path), device=self.device)  # (B, k)
        hidden = self._decode(ids, mask, positions, cache)  # (B, k, H)
        return self._branch_scores(path, hidden[:, -1])

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

    def _decode(self, ids, mask, positions, cache) -> torch.Tensor:
        out = self.decoder(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_kwarg: cache},
        )
        return out.last_hidden_state

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
            branch_logprobs[path] = _choice_logprobs(logits, kids)  # (C,)
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
        return _choice_logprobs(logits, kids).cpu()  # (B, C)

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


def _choice_logprobs(logits: torch.Tensor, kids: tuple[int, ...]) -> torch.Tensor:
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
