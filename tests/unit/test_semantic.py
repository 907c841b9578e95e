"""The labels are wired to the right rows and positions: train the tiny model, then route with it.

Random weights cannot show this: a prediction read at the wrong position, a label scored with the
wrong LM-head row or a mask that hides the ticket still agrees with a reference that makes the same
mistake, and with random weights nobody can tell. So a fresh copy of the tiny stand-in is trained
here (CPU, ~20 s) on synthetic tickets, with the prompt exactly as the engine builds it and the
label token sequence as its target, and must then route held-out tickets through `classify`.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from producer.synthetic import generate_tickets
from worker.engine import Engine, EngineOptions
from worker.engine.prompt import PromptTemplate

TRAIN_SEED, HELDOUT_SEED = 101, 202
STEPS, BATCH, MAX_LR = 150, 16, 5e-3
MAX_TRAIN_TOKENS = 240  # prompt + ticket + label; shorter examples keep the run fast on two cores
MIN_ACCURACY = 0.95


def training_examples(prompt: PromptTemplate, tickets: list[dict]) -> list[tuple[list[int], int, tuple[int, ...]]]:
    """(input ids, position that predicts the first label token, label token sequence) per ticket.

    The inputs are the engine's own full prompt followed by the label minus its last token, so
    each label token is the target one position earlier (teacher forcing through the label).
    """
    examples = []
    for ticket in tickets:
        full = prompt.full_ids(prompt.encode(ticket["text"]))
        label_ids = prompt.trie.sequences[ticket["expected"]]
        ids = [*full, *label_ids[:-1]]
        if len(ids) <= MAX_TRAIN_TOKENS:
            examples.append((ids, len(full) - 1, label_ids))
    return examples


def train(model, examples, pad_id: int) -> list[float]:
    """AdamW on next-token cross-entropy of the label tokens at the answer positions."""
    torch.manual_seed(0)
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=MAX_LR, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=MAX_LR, total_steps=STEPS, pct_start=0.1)
    model.train()
    losses = []
    for _ in range(STEPS):
        batch = rng.sample(examples, BATCH)
        width = max(len(ids) for ids, _, _ in batch)
        ids = torch.full((BATCH, width), pad_id)  # (B, W), right-padded
        mask = torch.zeros((BATCH, width), dtype=torch.long)  # (B, W)
        rows, positions, targets = [], [], []
        for i, (row, answer_at, label_ids) in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
            for j, token in enumerate(label_ids):
                rows.append(i)
                positions.append(answer_at + j)
                targets.append(token)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, W, H)
        logits = model.get_output_embeddings()(hidden[rows, positions])  # (N, V): label positions only
        loss = F.cross_entropy(logits, torch.tensor(targets))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval().requires_grad_(False)
    return losses


@pytest.fixture(scope="module")
def trained_engine(tiny_model_dir, tiny_engine) -> Engine:
    from transformers import AutoModelForCausalLM

    # a fresh copy: the shared tiny_engine model stays untouched for the other tests
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompt = tiny_engine.prompt
    examples = training_examples(prompt, generate_tickets(2000, seed=TRAIN_SEED))
    assert len(examples) > 1500
    # One intra-op thread: ops this small gain nothing from a second one, and on a busy two-core
    # machine the threads' synchronisation made training four times slower (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = train(model, examples, tiny_engine.pad_id)
    finally:
        torch.set_num_threads(threads)
    assert sum(losses[-10:]) / 10 < 0.2, losses[-10:]
    engine = Engine(model, tiny_engine.tokenizer, EngineOptions(labels=tiny_engine.labels, system=prompt.system))
    assert engine.prompt.prefix_ids == prompt.prefix_ids and engine.prompt.trie.sequences == prompt.trie.sequences
    return engine


@pytest.fixture(scope="module")
def heldout() -> list[dict]:
    return generate_tickets(300, seed=HELDOUT_SEED)


@pytest.fixture(scope="module")
def classified(trained_engine, heldout):
    return trained_engine.classify([t["text"] for t in heldout])


def test_trained_model_routes_heldout_tickets(trained_engine, heldout, classified):
    predictions, reports = classified
    assert any(r.rows > 1 for r in reports)  # the batched, cached path
    correct = Counter(t["expected"] for t, p in zip(heldout, predictions, strict=True) if p.label == t["expected"])
    total = Counter(t["expected"] for t in heldout)
    accuracy = sum(correct.values()) / len(heldout)
    print(f"\nheld-out accuracy {accuracy:.1%}; per label " + ", ".join(f"{k} {correct[k]}/{total[k]}" for k in total))
    assert accuracy >= MIN_ACCURACY
    for label in trained_engine.labels:  # no label is routed by accident
        assert correct[label] >= 0.85 * total[label], (label, correct[label], total[label])


def test_trained_model_classify_matches_reference(trained_engine, heldout, classified):
    texts = [t["text"] for t in heldout]
    predictions, _ = classified
    worst = 0.0
    for text, got in zip(texts, predictions, strict=True):
        want = trained_engine.reference(text)
        diff = max(abs(got.probs[k] - want.probs[k]) for k in want.probs)
        assert got.label == want.label and diff <= 1e-4, (text[:60], got.probs, want.probs)
        worst = max(worst, diff)
    print(f"\ntrained model: max |p_classify - p_reference| {worst:.3e}")
