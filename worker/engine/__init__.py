"""The classification engine: the only package that touches tensors.

- `model` — `Engine`: the model, its cached prefix, the optimised path and the unbatched reference.
- `fields` — `FieldsEngine`: several closed questions (a schema) per ticket in one pass.
- `schemas` — the schemas one worker serves, their `FieldsEngine`s kept LRU-bounded.
- `scheduler` — `PlannedRun`: tickets of one or more engines, one planned forward at a time: `add`,
  `schedule`, `update` (no torch, no callbacks; the loop is its caller's).
- `scoring` — trie-constrained label scoring: the softmax over the allowed tokens.
- `layout` — a batch's tensors after the cached prefix: padded ids, the additive 4D masks.
- `batching` — planning and padding arithmetic (plain Python, no torch).
- `cost` — `CostModel`: the predicted time of a forward pass, and its fit (numpy, no torch).
- `configure` — from the settings to a loaded model (device, dtype, GEMM kernel); `ModelInfo`.
- `prompt` — the chat template split into prefix / ticket / suffix, and the ticket's canonical text.
- `kernels` — device, dtype and GEMM-kernel choice, measured on a machine's first start and cached;
  oneDNN's `PackedLinear`.
- `fused` — `FusedDecoder`: the batched decoder forward with its elementwise work inside oneDNN's GEMMs.
- `selfcheck` — at load, the batched path held to the reference: the fused decoder's fallback, or a refusal.
- `int8` — the dynamic int8 decoder.
- `precision` — decision gaps and errors of a fast precision's answers; `ErrorBound` (no torch).
- `policy` — the precision policy the scheduler consults: which engine computes a ticket first, and
  which answers a fast runner's float32 twin computes again.
- `loading` — `from_pretrained` (the garbage collector paused) and the transformers cache API.
- `autotune` — the planner's cost model fitted to the device: measured at start-up, refitted while serving.
- `head`, `headfit`, `fieldheads` — label heads (TICKETQ_HEAD, a schema field's `head =`): the head
  file and its checks, `ticketq fit`'s hidden states and fits, a schema's field heads.

Importing the package imports no torch; `Engine`, `EngineOptions`, `ModelInfo` and `ModelNotFound` load it on
first use, so `from worker.engine import batching` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.configure import ModelInfo
    from worker.engine.loading import ModelNotFound
    from worker.engine.model import Engine, EngineOptions

__all__ = ["Engine", "EngineOptions", "ModelInfo", "ModelNotFound"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from worker.engine.model import Engine

        return Engine
    if name == "EngineOptions":
        from worker.engine.model import EngineOptions

        return EngineOptions
    if name == "ModelInfo":
        from worker.engine.configure import ModelInfo

        return ModelInfo
    if name == "ModelNotFound":
        from worker.engine.loading import ModelNotFound

        return ModelNotFound
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")
