"""From the settings to a loaded model: device, dtype and GEMM kernel resolved (`kernels`), the
weights prepacked for oneDNN where that kernel was chosen, the stand-in marker read. `ModelInfo`
is what was loaded, as the worker reports it."""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.int8 import INT8
from worker.engine.kernels import (
    PackedLinear,
    pack_linears,
    replace_module,
    resolve_device,
    resolve_matmul,
    resolve_precision,
)
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
    fused: bool = False  # batches run through `FusedDecoder` (oneDNN post-ops; bf16 on a float32 residual stream)
    recheck: bool = False  # answers within the precision's error bound are computed again in float32
    # the load-time self-check's verdict (`selfcheck.verify`): the batched path's largest |Δp| against
    # the reference, and whether the fused decoder had to give way to transformers' layers
    self_check: str = ""
    scorer: str = "zero-shot"  # who scores the labels: the LM head's label rows, or a fitted head (TICKETQ_HEAD)
    heads: str = ""  # the schemas' field heads (TICKETQ_SCHEMAS): `schema.field=head:<digest>`, space-separated


def load_configured(settings: Settings):
    """(model, tokenizer, ModelInfo, float32 model or None) as `settings` ask: threads set, device,
    precision and GEMM kernel resolved (measured where `auto`), linear layers prepacked for oneDNN
    where it runs them. The first model runs the batches in `info.dtype`; the last is its float32
    twin where that precision is re-checked (`info.recheck`): the same model for int8 (its decoder
    is quantised in a copy), else the loaded float32 model, the fast one a copy cast from it."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = resolve_device(settings.device)
    precision, recheck = resolve_precision(settings.dtype, device, settings.matmul, settings.recheck != "never")
    int8 = precision == INT8
    if int8 and device.type != "cpu":
        raise ValueError(f"TICKETQ_DTYPE=int8 runs on the CPU only (torch's dynamic int8 kernels), not {device}")
    dtype = torch.float32 if int8 or recheck else getattr(torch, precision)
    matmul = resolve_matmul(settings.matmul, device, dtype)
    model, tokenizer = load_model(settings.model, device, dtype)
    exact = None
    if recheck and not int8:  # the fast copy, cast before the float32 model is packed; ModelInfo reports its kernel
        exact, (model, fast_matmul) = model, cast_copy(model, getattr(torch, precision), settings.matmul)
        _pack(exact, matmul, torch.float32)
        matmul = fast_matmul
    else:
        _pack(model, matmul, dtype)
        exact = model if recheck else None  # int8: the engine quantises a copy of the decoder
    standin = Path(settings.model, STANDIN_MARKER).is_file()
    if standin:
        note = json.loads(Path(settings.model, STANDIN_MARKER).read_text())["note"]
        log.warning("model %s is a STAND-IN: %s", settings.model, note)
    if recheck:
        log.info("dtype %s, re-checked: answers within its measured error bound are computed again in float32 "
                 "(TICKETQ_RECHECK), so the labels are float32's", precision)  # fmt: skip
    elif int8 or precision in ("bfloat16", "float16"):
        log.warning("dtype %s unchecked (TICKETQ_RECHECK=never): the batched path is INEXACT; the reference stays "
                    "%s", precision, "float32" if int8 else precision)  # fmt: skip
    info = ModelInfo(settings.model, standin, str(device), precision, matmul, recheck=recheck)
    return model, tokenizer, info, exact


def cast_copy(model, dtype: torch.dtype, matmul: str = "auto"):
    """(a copy of `model` in `dtype`, the GEMM kernel resolved for it), its decoder's weights packed
    for oneDNN where `matmul` resolves so. The copy's linear layers are its own (dense again where
    `model`'s are packed: a packed weight is shared by copies); `model` is left as it is. The copy
    is cast as it is made (`_cast_as_copied`), never held whole in float32. Its embedding table and
    LM head are `model`'s, each row cast as it is read (`CastTable`): `model` is the copy's float32
    twin and stays resident beside it (`load_configured`, the bench)."""
    tables = _tables(model)
    copied = copy.deepcopy(model, _cast_as_copied(model, dtype, skip=[t.weight for t in tables.values()]))
    decoder = copied.get_decoder()
    for name, module in list(decoder.named_modules()):
        if isinstance(module, PackedLinear):
            replace_module(decoder, name, module.to_linear())
    copied = copied.to(dtype)
    if "input" in tables:
        copied.set_input_embeddings(CastTable(tables["input"], dtype))
    if "output" in tables:
        copied.set_output_embeddings(CastTable(tables["output"], dtype))
    chosen = resolve_matmul(matmul, copied.device, dtype)
    _pack(copied, chosen, dtype)
    return copied, chosen


class CastTable(torch.nn.Module):
    """A float32 model's embedding table or LM head read by its copy in a low precision: the rows a
    lookup takes, or the whole weight for a full-vocabulary head (the unbatched reference only; the
    batches score the label rows, `scoring.HeadRows`, cast once), cast to `dtype` as they are read.
    The same values as a cast copy's (a cast is elementwise), without a second table resident (a
    vocabulary of 151,936 x 896 is 272 MB in bfloat16). `weight` is the float32 one; `dtype` says
    what the copy computes in. The source is not a submodule: neither cast nor moved with the copy."""

    def __init__(self, source: torch.nn.Embedding | torch.nn.Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.__dict__["source"] = source
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.source.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.source, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.source, torch.nn.Embedding):
            return self.source(x).to(self.dtype)
        bias = None if self.bias is None else self.bias.to(self.dtype)
        return torch.nn.functional.linear(x, self.weight.to(self.dtype), bias)


def _tables(model) -> dict[str, torch.nn.Module]:
    """`model`'s input embeddings and LM head where they are a plain float32 `nn.Embedding` and
    `nn.Linear` (a cast copy reads those, `CastTable`); a table of another kind is copied."""
    tables = {"input": model.get_input_embeddings(), "output": model.get_output_embeddings()}
    kinds = {"input": torch.nn.Embedding, "output": torch.nn.Linear}
    return {side: table for side, table in tables.items()
            if type(table) is kinds[side] and table.weight.dtype == torch.float32}  # fmt: skip


def _cast_as_copied(model, dtype: torch.dtype, skip: list[torch.Tensor] = ()) -> dict:
    """A `copy.deepcopy` memo that maps each floating-point parameter and buffer of `model` to its
    cast to `dtype`, so the copy is built cast tensor by tensor: a whole float32 copy is never held
    (peak: the model and its cast copy, never a second float32 model). A cast is
    elementwise, so the values are those of casting a float32 copy; tied weights stay tied (one
    tensor, one entry). Those in `skip` (the tables the copy will read from `model`) map to an empty
    tensor: never cast whole."""
    memo: dict = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point() and id(tensor) not in memo:
            cast = tensor.detach().to(dtype) if not any(tensor is t for t in skip) else torch.empty(0, dtype=dtype)
            is_param = isinstance(tensor, torch.nn.Parameter)
            memo[id(tensor)] = torch.nn.Parameter(cast, requires_grad=tensor.requires_grad) if is_param else cast
    return memo


def _pack(model, matmul: str, dtype: torch.dtype) -> None:
    if matmul == "onednn":
        exact = "bfloat16, the same GEMMs" if dtype == torch.bfloat16 else "float32, exact"
        count = pack_linears(model.get_decoder(), dtype)
        log.info("matmul onednn: %d decoder linear layers prepacked for oneDNN (%s)", count, exact)
