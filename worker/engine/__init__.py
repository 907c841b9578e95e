"""The classification engine: the only package that touches tensors.

- `core` — `Engine`: the cached prefix, the optimised path and the unbatched reference.
- `batching` — planning and padding arithmetic (plain Python, no torch).
- `prompt` — the chat template split into prefix / ticket / suffix, and the ticket's canonical text.
- `kernels` — device, dtype and GEMM-kernel choice, measured on a machine's first start and cached;
  oneDNN's `PackedLinear`.
- `int8` — the opt-in dynamic int8 decoder.
- `loading` — `from_pretrained` (the garbage collector paused) and the transformers cache API.
- `autotune` — the planner's cost model, measured at start-up.

Importing the package imports no torch; `Engine`, `ModelInfo` and `ModelNotFound` load it on
first use, so `from worker.engine import batching` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.engine.core import Engine, ModelInfo
    from worker.engine.loading import ModelNotFound

__all__ = ["Engine", "ModelInfo", "ModelNotFound"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "ModelInfo"):
        from worker.engine import core

        return getattr(core, name)
    if name == "ModelNotFound":
        from worker.engine.loading import ModelNotFound

        return ModelNotFound
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")
