"""`TICKETQ_DTYPE=int8` (opt-in, CPU): a copy of the decoder whose linear layers run torch's
dynamic int8 kernels; the model, the prefix cache and the reference path stay float32, so every
int8 answer is still judged against float32.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch

from worker.engine.kernels import PackedLinear, cpu_flags, full_range_dynamic_linear, replace_module

log = logging.getLogger(__name__)

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
            replace_module(quantized, name, module.to_linear())
    spec = {  # by module name: the linears to convert, each with per-channel weight scales
        name: per_channel_dynamic_qconfig
        for name, module in quantized.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith(INT8_FLOAT_LINEARS)
    }
    mapping = {torch.nn.Linear: full_range_dynamic_linear() if full_range else DynamicLinear}
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
