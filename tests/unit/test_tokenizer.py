"""Tokenizer, chat template and stand-in tests on the tiny stand-in (real Qwen2 tokenizer, CPU).

The engine splits the rendered chat template around the ticket and tokenises the three parts on
their own. That is only correct if the split never moves a token boundary: the guard below checks
it against `apply_chat_template(..., tokenize=True)` for every awkward and synthetic ticket.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from producer.synthetic import awkward_texts, generate_tickets
from ticketq_cli.standin import STANDIN_MARKER, STANDIN_NOTE, build, is_standin
from worker.engine.prompt import PromptTemplate, canonical_text
from worker.engine.replicas import load_engine

ENDOFTEXT, IM_START, IM_END = 151643, 151644, 151645


@pytest.fixture(scope="module")
def tokenizer(tiny_engine):
    return tiny_engine.tokenizer


@pytest.fixture(scope="module")
def special_tokens(tokenizer) -> dict[str, int]:
    """Every added token flagged special (`<|im_start|>` is one, though not in `all_special_tokens`)."""
    return {tok.content: tid for tid, tok in tokenizer.added_tokens_decoder.items() if tok.special}


@pytest.fixture(scope="module")
def untruncated_prompt(tiny_engine) -> PromptTemplate:
    """The engine's prompt with no truncation, so every ticket can be compared with the template whole."""
    return PromptTemplate(tiny_engine.tokenizer, tiny_engine.prompt.system, tiny_engine.labels, 10**6)


def plain_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_ids(tokenizer, system: str, ticket: str) -> list[int]:
    """Token ids of the whole conversation, tokenised in one piece by the chat template."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": ticket}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (input_ids + attention_mask); 4.x returned a plain list
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return list(ids)


# ----- known Qwen2 ids ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("Hello!", [9707, 0]),
        ("Hello world", [9707, 1879]),
        ("<|im_start|>system\n", [IM_START, 8948, 198]),
        ("0123456789", list(range(15, 25))),
    ],
)
def test_known_qwen2_ids(tokenizer, text, ids):
    assert plain_ids(tokenizer, text) == ids


def test_special_token_ids(tokenizer, special_tokens):
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        ENDOFTEXT,
        IM_START,
        IM_END,
    ]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == IM_END
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == ENDOFTEXT
    assert {"<|endoftext|>", "<|im_start|>", "<|im_end|>"} <= set(special_tokens)
    # the tool-call tags are added tokens but, as in Qwen2.5, not special
    assert "<tool_call>" not in special_tokens


@pytest.mark.parametrize("text", ["2024-05-14T09:12:55Z", "Card ending 0042, 1234567890 EUR", "x9y88z777"])
def test_digits_split_one_per_token(tokenizer, text):
    ids = plain_ids(tokenizer, text)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "".join(pieces) == text
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert all(len(p) == 1 for p in digit_pieces), pieces
    assert len(digit_pieces) == sum(c.isdigit() for c in text)


# ----- chat template -----------------------------------------------------------------------


def test_chat_template_renders_system_user_and_assistant_opening(tokenizer):
    messages = [
        {"role": "system", "content": "You route support tickets."},
        {"role": "user", "content": "My invoice is wrong"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou route support tickets.<|im_end|>\n"
        "<|im_start|>user\nMy invoice is wrong<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_default_system_is_qwen25s(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_engine_prompt_is_the_chat_template_split_around_the_ticket(tiny_engine, tokenizer):
    prompt = tiny_engine.prompt
    assert prompt.render("My invoice is wrong") == (
        "<|im_start|>system\nYou are a support ticket router. Read the customer's ticket and answer with "
        "exactly one word: the team that should handle it.\n\nLabels:\n- billing\n- technical\n- account\n\n"
        "Answer with exactly one label: billing, technical, account.<|im_end|>\n"
        "<|im_start|>user\nMy invoice is wrong<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.prefix_text.endswith("<|im_start|>user\n")
    assert prompt.suffix_text == "<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.suffix_ids == (IM_END, 198, IM_START, 77091, 198)
    ticket = "My invoice is wrong"
    assert tokenizer.decode(prompt.full_ids(prompt.encode(ticket))) == prompt.render(ticket)


# Qwen3's shape: the generation prompt opens a thinking block unless `enable_thinking` is false,
# and then closes an empty one, so the answer starts after `</think>`.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def tokenizer_with(tiny_model_dir, **attributes):
    """A fresh copy of the stand-in's tokenizer with `attributes` set (chat_template, eos_token)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for name, value in attributes.items():
        setattr(tokenizer, name, value)
    return tokenizer


def test_thinking_template_is_rendered_with_thinking_off(tiny_model_dir):
    tokenizer = tokenizer_with(tiny_model_dir, chat_template=THINKING_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    opened = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert opened.endswith("<|im_start|>assistant\n<think>\n")  # left to itself, the template opens one
    prompt = PromptTemplate(tokenizer, "Route tickets.", ("billing", "technical"))
    assert prompt.suffix_text == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt.render("hi").endswith("</think>\n\n")
    assert prompt.end_of_answer() == IM_END


def test_engine_under_a_thinking_template_matches_its_reference(tiny_engine, tiny_model_dir):
    from worker.engine import Engine, EngineOptions

    tokenizer = tokenizer_with(tiny_model_dir, chat_template=THINKING_TEMPLATE)
    engine = Engine(tiny_engine.model, tokenizer,
        EngineOptions(labels=("team1", "team2", "billing"), system="Route tickets."))
    texts = [t["text"] for t in generate_tickets(12, seed=3)]
    predictions, _ = engine.classify(texts)
    for got, text in zip(predictions, texts, strict=True):
        want = engine.reference(text)
        assert got.label == want.label
        assert max(abs(got.probs[k] - want.probs[k]) for k in want.probs) <= 1e-4


def test_end_of_answer_is_the_templates_not_the_eos_token(tiny_model_dir):
    """A base model's tokenizer ends documents with `<|endoftext|>`; its template ends answers with `<|im_end|>`."""
    tokenizer = tokenizer_with(tiny_model_dir, eos_token="<|endoftext|>")
    prompt = PromptTemplate(tokenizer, "Route tickets.", ("team1", "team10"))
    assert prompt.end_of_answer() == IM_END
    assert {seq[-1] for seq in prompt.trie.sequences.values()} == {IM_END}


def test_an_answer_ended_by_plain_text_falls_back_to_the_eos_token(tiny_model_dir):
    """Text after the answer could merge with a label's last token: only an added token ends a label."""
    template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n\\n' }}{% endfor %}{{ 'assistant: ' }}"
    tokenizer = tokenizer_with(tiny_model_dir, chat_template=template, eos_token="<|endoftext|>")
    prompt = PromptTemplate(tokenizer, "Route tickets.", ("team1", "team10"))
    assert prompt.end_of_answer() == ENDOFTEXT
    assert prompt.trie.sequences["team1"] == (*plain_ids(tokenizer, "team1"), ENDOFTEXT)


# ----- token boundary guard ----------------------------------------------------------------


def has_special_literal(text: str, special_tokens: dict[str, int]) -> bool:
    return any(literal in text for literal in special_tokens)


@pytest.mark.parametrize("text", awkward_texts(), ids=lambda t: repr(t[:24]))
def test_awkward_ticket_tokenises_as_in_the_whole_template(tokenizer, untruncated_prompt, special_tokens, text):
    prompt = untruncated_prompt
    encoded = prompt.encode(text)
    ticket_ids = encoded.ids[: encoded.ticket_tokens]
    if has_special_literal(text, special_tokens):
        # By design a special-token literal inside a ticket is plain text: a ticket cannot close its
        # own turn or open the assistant's. The template (which trusts its content) would differ here.
        assert not set(ticket_ids) & set(special_tokens.values()), ticket_ids
        assert tokenizer.decode(ticket_ids) == canonical_text(text)
        full = prompt.full_ids(encoded)
        assert full.count(IM_START) == 3 and full.count(IM_END) == 2
    else:
        assert prompt.full_ids(encoded) == template_ids(tokenizer, prompt.system, canonical_text(text))


def test_synthetic_tickets_tokenise_as_in_the_whole_template(tokenizer, untruncated_prompt, special_tokens):
    texts = [t["text"] for seed in (0, 1) for t in generate_tickets(300, seed=seed)]
    prompt = untruncated_prompt
    checked, mismatched = 0, []
    for text in texts:
        assert not has_special_literal(text, special_tokens)
        if prompt.full_ids(prompt.encode(text)) != template_ids(tokenizer, prompt.system, canonical_text(text)):
            mismatched.append(text[:80])
        checked += 1
    assert checked == 600
    assert mismatched == []


def test_truncated_ticket_keeps_the_template_around_its_first_tokens(tiny_engine, tokenizer):
    prompt = tiny_engine.prompt
    text = " ".join(t["text"] for t in generate_tickets(40, seed=5))
    encoded = prompt.encode(text)
    assert encoded.truncated and encoded.ticket_tokens == prompt.max_ticket_tokens
    whole = template_ids(tokenizer, prompt.system, canonical_text(text))
    full = prompt.full_ids(encoded)
    cut = len(prompt.prefix_ids) + prompt.max_ticket_tokens
    assert full[:cut] == whole[:cut]
    assert tuple(full[cut:]) == prompt.suffix_ids


# ----- stand-in ----------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_standin_build_is_deterministic_per_seed(tiny_model_dir, tmp_path):
    first = build("tiny", tmp_path / "a", seed=0)
    # conftest built tiny_model_dir with seed 0 for this test run, unless it reuses a cached directory
    # (TICKETQ_TEST_TINY_MODEL) that an older builder may have written: then build again here
    fresh = not os.environ.get("TICKETQ_TEST_TINY_MODEL")
    again = tiny_model_dir if fresh else build("tiny", tmp_path / "b", seed=0)
    other = build("tiny", tmp_path / "c", seed=1)
    names = sorted(p.name for p in first.iterdir())
    assert "model.safetensors" in names and STANDIN_MARKER in names
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:  # weights, tokenizer, config, marker: all byte-identical
        assert sha256(first / name) == sha256(again / name), name
    assert sha256(first / "model.safetensors") != sha256(other / "model.safetensors")
    assert sha256(first / "tokenizer.json") == sha256(other / "tokenizer.json")


def test_standin_marker_is_present_and_reported(tiny_model_dir, tiny_engine):
    marker = json.loads((tiny_model_dir / STANDIN_MARKER).read_text())
    assert marker["standin"] is True and marker["size"] == "tiny"
    assert marker["note"] == STANDIN_NOTE
    assert is_standin(tiny_model_dir)
    assert tiny_engine.info.standin is True
    assert tiny_engine.info.name == str(tiny_model_dir)


def test_model_without_marker_is_not_reported_as_standin(tiny_model_dir, tiny_settings, tmp_path):
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (copy / STANDIN_MARKER).unlink()
    assert not is_standin(copy)
    engine = load_engine(tiny_settings.model_copy(update={"model": str(copy)}))
    assert engine.info.standin is False
