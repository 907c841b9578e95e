"""From the settings to a loaded model: device, dtype and GEMM kernel resolved (`kernels`), the
weights prepacked for oneDNN where that kernel was chosen, the stand-in marker read. `ModelInfo`
is what was loaded, as the worker reports it."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.int8 import INT8
from worker.engine.kernels import pack_linears, resolve_device, resolve_dtype, resolve_matmul
from worker.engine.loading import STANDIN_MARKER, load_model
from worker.settings import Settings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    standin: bool
    device: str
    dtype: str
    matmul: str = "torch"  # who runs the decoder's float32 linear layers: "torch" (its GEMM) or "onednn"
    fused: bool = False  # batches run through `FusedDecoder` (oneDNN post-ops, float32 attention)


def load_configured(settings: Settings):
    """(model, tokenizer, ModelInfo) as `settings` ask: threads set, device, dtype and GEMM kernel
    resolved (measured where `auto`), linear layers prepacked for oneDNN where it runs them."""
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
        exact = "bfloat16, the same GEMMs" if dtype == torch.bfloat16 else "float32, exact"
        count = pack_linears(model.get_decoder(), dtype)
        log.info("matmul onednn: %d decoder linear layers prepacked for oneDNN (%s)", count, exact)
    standin = Path(settings.model, STANDIN_MARKER).is_file()
    if standin:
        note = json.loads(Path(settings.model, STANDIN_MARKER).read_text())["note"]
        log.warning("model %s is a STAND-IN: %s", settings.model, note)
    if int8:
        log.warning("dtype int8: the batched path is INEXACT (dynamic int8 linears); the reference stays float32")
    info = ModelInfo(settings.model, standin, str(device), INT8 if int8 else str(dtype).removeprefix("torch."), matmul)
    return model, tokenizer, info
