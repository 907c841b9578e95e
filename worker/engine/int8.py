"""`TICKETQ_DTYPE=int8` (opt-in, CPU): a copy of the decoder whose linear layers run torch's
dynamic int8 kernels; the model, the prefix cache and the reference path stay float32, so every
int8 answer is still judged against float32.
"""

from __future__ import annotations

import copy
import logging
import warnings

import torch

from worker.engine.kernels import PackedLinear, full_range_dynamic_linear, replace_module
from worker.engine.probes import cpu_flags

log = logging.getLogger(__name__)

INT8 = "int8"  # TICKETQ_DTYPE value: float32 model, int8 decoder linears on the batched path
# Decoder linears the int8 path keeps in float32: the MLP's down projection reads silu(gate) * up,
# whose heavy tail makes one per-batch activation scale too coarse (most of the int8 error).
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
    where `full_range` (default: `int8_full_range()`), else on torch's 7. The variant was chosen by
    its agreement with the float32 reference and its speed (docs/performance.md, "Figures behind
    the engine's choices"; docs/bench/int8-variants.md): most of the error of an all-int8 decoder is
    down_proj's input, silu(gate) * up, heavy-tailed under one per-batch scale, so down_proj stays
    float32; torch's `quantize_dynamic` (fbgemm/x86 int8 kernels) is the int8 kernel that runs
    faster than float32 on the CPU, where torchao's CPU int8 ops run slower.
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
