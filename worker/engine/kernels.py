"""Where the decoder's arithmetic runs: the device, the dtype and the float32 GEMM kernel, each
measured at start-up where `auto` asks for it.

The CPUs this runs on differ more than their flags say (AVX2 only, AVX-512 with fast or slow
bf16, AMX), so `auto` times one decoder-sized GEMM instead of trusting /proc/cpuinfo.
`PackedLinear` is the one place that calls oneDNN's private linear ops; the start-up guard
(`worker.transport.guards`) checks that they exist.

Importing this module bounds oneDNN's two shape-keyed caches (`bound_onednn_caches`) before the
process creates its first oneDNN primitive: every forward batch has its own (rows x width), and at
their default 1,024 entries the caches grew a process by up to 0.7 GB (docs/bench/soak.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Entries in each of oneDNN's shape-keyed caches: oneDNN's primitive cache and the primitive
# descriptor cache of ideep (torch's oneDNN wrapper). A primitive is made for one (M, K, N), M the
# rows x width of a forward batch, and both caches keep one for every M they see, 1,024 each by
# default at 0.3-0.6 MB an entry. A forward batch needs one per distinct linear shape (4 in Qwen2);
# 64 keep the last 16 batch shapes. A miss re-creates the same kernel (the same answers, bit for
# bit) in 1-2.5 ms: measured, 1.4 more misses a forward batch than at 1,024, no more time in all.
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
        replace_module(decoder, name, PackedLinear(decoder.get_submodule(name)))
        release_freed_memory()  # else glibc keeps every replaced weight: +1.4 GB RSS on the 0.5B model
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
