"""Where the decoder's arithmetic runs: the device, the dtype and the float32 GEMM kernel, each
measured where `auto` asks for it, at the first start on a machine.

The CPUs this runs on differ more than their flags say (AVX2 only, AVX-512 with fast or slow
bf16, AMX), so `auto` times one decoder-sized GEMM instead of trusting /proc/cpuinfo.
`PackedLinear` is the one place that calls oneDNN's private linear ops; the start-up guard
(`worker.transport.guards`) checks that they exist.

How a probe settles and where its verdict is cached: `probes`.

Importing this module bounds oneDNN's two shape-keyed caches (`bound_onednn_caches`) before the
process creates its first oneDNN primitive: every forward batch has its own (rows x width), and at
their default size the caches grow a process by every batch shape it has seen (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import time
from collections.abc import Callable

import torch

from worker.engine.probes import cpu_flags, settled_speedup

log = logging.getLogger(__name__)

# Entries in each of oneDNN's shape-keyed caches: oneDNN's primitive cache and the primitive
# descriptor cache of ideep (torch's oneDNN wrapper). A primitive is made for one (M, K, N), M the
# rows x width of a forward batch, and both caches keep one for every M they see (1,024 each by
# default). A forward batch needs one per distinct linear shape (4 in Qwen2); 64 keep the last 16
# batch shapes. A miss re-creates the same kernel (the same answers, bit for bit); what the bound
# saves and costs is in docs/performance.md.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's and ideep's primitive caches, unless the environment already sets them.

    Both read their capacity once, when the process creates its first primitive: this runs when
    the module is imported, before any. (`LRU_CACHE_CAPACITY=0` crashes torch 2.13's oneDNN linear.)
    """
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


bound_onednn_caches()


def resolve_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def cpu_has_native_bf16() -> bool:
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


# bfloat16 must beat float32 by this much on the probe to be worth its rounding on a CPU.
BF16_MIN_SPEEDUP = 1.25
# The probes' GEMM: Qwen2.5-0.5B's MLP, (rows, HIDDEN) x (HIDDEN, INTERMEDIATE). The probes run
# before the model loads, whatever TICKETQ_MODEL is; a cached verdict is keyed by this shape.
HIDDEN, INTERMEDIATE = 896, 4864


def bf16_matmul_speedup(rows: int = 256, reps: int = 3, threshold: float = BF16_MIN_SPEEDUP) -> float:
    """float32 time / bfloat16 time of one decoder-sized GEMM (Qwen2.5-0.5B's MLP) on this CPU,
    settled against `threshold` and cached (`settled_speedup`): 1.0 where the measurements straddle it.

    "Native bf16" in /proc/cpuinfo is not enough: some CPUs with AVX-512 BF16 run the model far
    faster in bfloat16, others slower. A few GEMMs of timing settle it.
    """
    shape = {"rows": rows, "in": HIDDEN, "out": INTERMEDIATE, "reps": reps}
    return settled_speedup("bf16-matmul", lambda: bf16_gemm_ratio(rows, reps), shape, threshold)


def bf16_gemm_ratio(rows: int = 256, reps: int = 3) -> float:
    """One measurement: float32 time / bfloat16 time of the probe's GEMM, the best of `reps` each."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(rows, HIDDEN).to(dtype)
        b = torch.randn(HIDDEN, INTERMEDIATE).to(dtype)
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
        onednn = 1.0
        if matmul != "torch" and PackedLinear.available():  # bf16 must beat float32's faster kernel
            onednn = max(1.0, onednn_linear_speedup())
        bf16 = bf16_matmul_speedup(threshold=round(BF16_MIN_SPEEDUP * onednn, 2))
        speedup = bf16 / onednn
        dtype = torch.bfloat16 if speedup >= BF16_MIN_SPEEDUP else torch.float32
        log.info("dtype auto: bfloat16 GEMM %.2fx float32's (torch), float32 through oneDNN %.2fx torch's: bfloat16 "
                 "%.2fx the faster float32 (needs %.2fx) -> %s", bf16, onednn, speedup, BF16_MIN_SPEEDUP,
                 dtype_name(dtype))  # fmt: skip
        return dtype
    return torch.float32


# int8 must beat float32's faster GEMM by this much to be worth it: its error is larger than
# bfloat16's, so more of its answers are re-checked in float32 (TICKETQ_RECHECK).
INT8_MIN_SPEEDUP = 1.3


def resolve_precision(name: str, device: torch.device, matmul: str = "torch", recheck: bool = True) -> tuple[str, bool]:
    """(the precision batches run in, whether float32 re-checks the answers it cannot settle).

    `auto` with `recheck` (the default): the fastest precision this machine has, checked: bfloat16
    on CUDA, and on a CPU where `resolve_dtype` measures it faster; else int8 on a CPU where its
    GEMM measures INT8_MIN_SPEEDUP x float32's faster one; else float32, as without a fast one.
    `auto` without `recheck`: `resolve_dtype`'s choice, unchecked. A named precision is checked
    where `recheck` and it is not float32.
    """
    if name != "auto":
        return name, recheck and name != "float32"
    if not recheck:
        return dtype_name(resolve_dtype(name, device, matmul)), False
    if device.type == "cuda":
        return "bfloat16", True
    if device.type != "cpu":
        return "float32", False
    if resolve_dtype(name, device, matmul) == torch.bfloat16:
        return "bfloat16", True
    if int8_available():
        onednn = matmul != "torch" and PackedLinear.available() and onednn_linear_speedup() >= ONEDNN_MIN_SPEEDUP
        speedup = int8_linear_speedup(onednn=onednn)
        choice = speedup >= INT8_MIN_SPEEDUP
        log.info("dtype auto: int8 GEMM %.2fx float32's (%s; needs %.2fx) -> %s", speedup,
                 "oneDNN" if onednn else "torch", INT8_MIN_SPEEDUP, "int8, re-checked in float32" if choice
                 else "float32")  # fmt: skip
        if choice:
            return "int8", True
    return "float32", False


def int8_available() -> bool:
    """Whether torch has its x86 int8 kernels (fbgemm) for the dynamic int8 linear layers."""
    engines = torch.backends.quantized.supported_engines
    return platform.machine().lower() in ("x86_64", "amd64") and ("fbgemm" in engines or "x86" in engines)


def int8_linear_speedup(rows: int = 256, reps: int = 3, onednn: bool = False) -> float:
    """float32 time / dynamic int8 time of the probes' GEMM (float32 through oneDNN where `onednn`),
    settled against INT8_MIN_SPEEDUP and cached (`settled_speedup`)."""
    shape = {"rows": rows, "in": HIDDEN, "out": INTERMEDIATE, "reps": reps, "onednn": int(onednn)}
    return settled_speedup("int8-linear", lambda: int8_gemm_ratio(rows, reps, onednn), shape, INT8_MIN_SPEEDUP)


def int8_gemm_ratio(rows: int = 256, reps: int = 3, onednn: bool = False) -> float:
    """One measurement: float32 `linear` time / torch's dynamic int8 `Linear` time, the best of `reps` each."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    x = torch.randn(rows, HIDDEN)
    linear = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False).requires_grad_(False)
    quantized = DynamicLinear(HIDDEN, INTERMEDIATE, bias_=False, dtype=torch.qint8)
    quantized.set_weight_bias(torch.quantize_per_channel(
        linear.weight, linear.weight.abs().amax(1) / 127, torch.zeros(INTERMEDIATE, dtype=torch.long), 0, torch.qint8
    ), None)  # fmt: skip
    return _best_time(PackedLinear(linear) if onednn else linear, x, reps) / _best_time(quantized, x, reps)


def _best_time(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    """The fastest of `reps` calls of `layer(x)`, after one to warm up (kernel selection, packing)."""
    layer(x)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        layer(x)
        best = min(best, time.perf_counter() - start)
    return best


# oneDNN must beat torch's float32 GEMM by this much on the probe to be worth packing the weights.
ONEDNN_MIN_SPEEDUP = 1.15


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose weight is prepacked for oneDNN's matmul (`mkldnn::_linear_pointwise`).

    torch's float32 `linear` goes to MKL's GEMM, which on some AMD CPUs runs well below the
    machine's AVX-512 peak (docs/performance.md); oneDNN picks its kernels by CPU features. The
    same float32 arithmetic, summed in another order (a float32 rounding apart). The packed weight is an opaque oneDNN
    tensor that replaces the dense one (no second copy); `to_linear` unpacks it. A bfloat16 weight
    packs too: torch's own bf16 `linear` on a CPU already runs this oneDNN kernel, re-laying out the
    plain weight in every call, so packed it computes the same bits, faster.
    """

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)  # (out, in), blocked
        self.bias = linear.bias

    @staticmethod
    def available() -> bool:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")

    def forward(self, x: torch.Tensor, post: str = "none") -> torch.Tensor:  # (..., in) -> (..., out)
        """`post` is an elementwise op oneDNN applies to the result inside the GEMM ("swish": SiLU)."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, post, [], "")

    def then(self, x: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
        """`self(x) <op> other` in one oneDNN call, `op` "add" or "mul"; `other` has the output's shape."""
        return torch.ops.mkldnn._linear_pointwise(x, other.contiguous(), self.packed, self.bias, op)

    def to_linear(self) -> torch.nn.Linear:
        """A dense `nn.Linear` with this layer's weight and bias, sharing no storage with it: a copy
        cast to another dtype (`configure.cast_copy`) casts its parameters in place, and a bias shared
        with this layer would become bfloat16 under a float32 weight, which oneDNN has no kernel for."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight = torch.nn.Parameter(self.packed.to_dense(), requires_grad=False)
        if self.bias is not None:
            linear.bias = torch.nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return linear

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        return self  # read-only, and an opaque tensor cannot be copied: copies of a decoder share it

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(decoder: torch.nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Replace every `nn.Linear` of `dtype` (float32, or bfloat16 on a CPU with native bf16) in
    `decoder` by a `PackedLinear`, in place; how many."""
    names = [
        name
        for name, module in decoder.named_modules()
        if type(module) is torch.nn.Linear and module.weight.dtype == dtype
    ]
    for name in names:
        replace_module(decoder, name, PackedLinear(decoder.get_submodule(name)))
        release_freed_memory()  # else glibc keeps every replaced weight mapped (docs/performance.md)
    return len(names)


def replace_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` where `root.get_submodule(name)` was."""
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, module)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):  # another C library: nothing to trim with
        return None


def release_freed_memory() -> None:
    """Hand memory freed by Python back to the OS (glibc keeps large freed heap chunks mapped)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache  # asked twice a start-up: resolve_dtype and resolve_matmul
def onednn_linear_speedup(rows: int = 256, reps: int = 3) -> float:
    """torch's float32 `linear` time / oneDNN's on prepacked weights, one decoder-sized GEMM (the MLP's),
    settled against ONEDNN_MIN_SPEEDUP and cached (`settled_speedup`): 1.0 where the measurements
    straddle it."""
    shape = {"rows": rows, "in": HIDDEN, "out": INTERMEDIATE, "reps": reps}
    return settled_speedup("onednn-linear", lambda: onednn_gemm_ratio(rows, reps), shape, ONEDNN_MIN_SPEEDUP)


def onednn_gemm_ratio(rows: int = 256, reps: int = 3) -> float:
    """One measurement: torch's float32 `linear` time / oneDNN's, the best of `reps` each."""
    x = torch.randn(rows, HIDDEN)
    linear = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False).requires_grad_(False)
    return _best_time(linear, x, reps) / _best_time(PackedLinear(linear), x, reps)


def resolve_matmul(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """Who runs the decoder's linear layers on a CPU: "torch" or "onednn" (weights prepacked once).

    float32: oneDNN's own GEMM, exact float32 but another summation order; `auto` measures it
    against torch's. bfloat16 on a CPU with native bf16: torch's GEMM is already oneDNN's, which
    re-lays out the plain weight in every call; packed once the same kernel gives the same bits,
    faster (docs/performance.md), so `auto` packs there without measuring.
    """
    cpu = device.type == "cpu" and PackedLinear.available()
    float32 = cpu and dtype == torch.float32
    bfloat16 = cpu and dtype == torch.bfloat16 and cpu_has_native_bf16()
    if name == "onednn" and not (float32 or bfloat16):
        raise ValueError(f"TICKETQ_MATMUL=onednn needs float32, or bfloat16 on a CPU with native bf16, on a CPU "
                         f"with oneDNN; got {dtype} on {device}")  # fmt: skip
    if name != "auto":
        return name
    if bfloat16:
        return "onednn"
    if not float32:
        return "torch"
    speedup = onednn_linear_speedup()
    choice = "onednn" if speedup >= ONEDNN_MIN_SPEEDUP else "torch"
    log.info("matmul auto: oneDNN's float32 GEMM runs %.2fx torch's on this CPU -> %s", speedup, choice)
    return choice


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: how settings, results and metrics name a precision."""
    return str(dtype).removeprefix("torch.")


@functools.cache
def full_range_dynamic_linear() -> type[torch.nn.Module]:
    """torch.ao's dynamic int8 `Linear` with its activations quantised on 8 bits (`reduce_range=False`)."""
    from torch.ao.nn.quantized.dynamic import Linear

    class FullRangeDynamicLinear(Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # the packed weight `Linear.forward` passes too (a private name: the int8 tests run this)
            packed = self._packed_params._packed_params
            return torch.ops.quantized.linear_dynamic(x, packed, reduce_range=False).to(x.dtype)

    return FullRangeDynamicLinear
