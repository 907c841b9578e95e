"""Tiny random decoders of each model family the engine serves, built from configs (no model hub).

Each is the stand-in's tokenizer and chat template beside a two-layer, 64-wide model of its
family, seeded; the family's own terms set away from their neutral values (Granite's multipliers
and `logits_scaling`, a SmolLM3 layer without rotary positions), so a path that skipped one would
show it.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# the stand-in's vocabulary; untied heads, so the label-only scorer reads the head's own rows
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=151936, initializer_range=0.2, max_position_embeddings=4096, tie_word_embeddings=False)


def _configs() -> dict[str, Callable[[], object]]:
    import transformers as t

    return {
        "llama": lambda: t.LlamaConfig(**COMMON),
        "mistral": lambda: t.MistralConfig(**COMMON, sliding_window=None),
        "qwen2": lambda: t.Qwen2Config(**COMMON),
        "qwen3": lambda: t.Qwen3Config(**COMMON, head_dim=16),  # per-head q/k norms
        "phi3": lambda: t.Phi3Config(**COMMON, pad_token_id=0),  # gate and up in one linear
        "gemma2": lambda: t.Gemma2Config(**COMMON, head_dim=16),  # GELU, final logit soft-capping
        "granite": lambda: t.GraniteConfig(**COMMON, logits_scaling=4.0, residual_multiplier=0.5,
                                           embedding_multiplier=3.0, attention_multiplier=0.2),
        "smollm3": lambda: t.SmolLM3Config(**COMMON, no_rope_layers=[1, 0]),  # the second layer without rotary
        "gpt2": lambda: t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=4096, vocab_size=151936,
                                     initializer_range=0.2),  # given a chat template
    }  # fmt: skip


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "granite", "smollm3", "gpt2")
# the families the fused decoder computes (worker.engine.fused.FAMILIES); the others run transformers' layers
FUSED = {"llama", "mistral", "qwen2", "qwen3", "granite", "smollm3"}


def build_family(family: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a tiny random `family` model with `tokenizer_dir`'s tokenizer and chat template to `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _configs()[family]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
