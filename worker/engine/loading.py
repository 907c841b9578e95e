"""Loading a model: `from_pretrained` for a hub id or a local directory, with the garbage
collector paused (`paused_gc`), and the transformers cache API across the versions ticketq
supports. Importing this module imports no torch, so `paused_gc` can cover torch's import too."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from ticketq.errors import TicketqError
from ticketq.process import paused_gc
from worker.settings import decoder_only_problem

if TYPE_CHECKING:
    import torch

# A file in a stand-in's directory: its presence marks the model as one (labels mean nothing).
STANDIN_MARKER = "ticketq_standin.json"


class ModelNotFound(TicketqError, RuntimeError):
    """The model could not be loaded; the message names the stand-in command."""


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
    # Without a reachable hub, look only in the local cache: fail in a second, not after a minute of retries.
    local_only = not Path(name_or_path).is_dir() and not hub_reachable()
    try:
        with paused_gc():
            from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

            _check_decoder_only(name_or_path, AutoConfig.from_pretrained(name_or_path, local_files_only=local_only))
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_only)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, local_files_only=local_only)
    except (OSError, ValueError) as exc:  # ValueError: a directory without a (complete) model
        raise ModelNotFound(_not_loaded(name_or_path, exc)) from exc
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def _check_decoder_only(name_or_path: str, config) -> None:
    problem = decoder_only_problem(name_or_path, config.to_dict())
    if problem:
        raise ModelNotFound(problem)


def _not_loaded(name_or_path: str, exc: BaseException) -> str:
    """One line on why the model did not load, and the fix that applies to what was named."""
    why = f"{exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if Path(name_or_path).is_dir():
        return (f"TICKETQ_MODEL={name_or_path}: the directory holds no loadable model ({why}); it needs the "
                "files save_pretrained writes (config.json, the tokenizer, the weights)")
    return (f"TICKETQ_MODEL={name_or_path}: cannot load it from the model hub or its local cache ({why}); "
            "without hub access, build a stand-in (`ticketq standin --out models/qwen2.5-0.5b-standin`) and "
            "set TICKETQ_MODEL=models/qwen2.5-0.5b-standin")


def cache_class():
    from transformers import DynamicCache

    return DynamicCache


def new_cache(config):
    """An empty KV cache for a model of `config` (older transformers take no config)."""
    try:
        return cache_class()(config=config)
    except TypeError:
        return cache_class()()


def prefix_cache(config, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int):
    """A fresh cache holding a prefix's K/V expanded to `rows` rows: views, so the prefix is never
    written (the cache's first concatenation copies them into storage of its own)."""
    cache = new_cache(config)
    for layer, (k, v) in enumerate(prefix_kv):
        cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), layer)
    return cache


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))
