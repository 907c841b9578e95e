"""Ticket texts the engine tests share (no fixtures: plain functions)."""

from __future__ import annotations

from producer.synthetic import generate_tickets


def long_text(engine, min_tokens: int, seed: int) -> str:
    """Synthetic tickets joined with blank lines until the text has at least `min_tokens` tokens."""
    parts = []
    for ticket in generate_tickets(200, seed=seed):
        parts.append(ticket["text"])
        if len(engine.tokenizer("\n\n".join(parts), add_special_tokens=False)["input_ids"]) >= min_tokens:
            return "\n\n".join(parts)
    raise AssertionError(f"could not reach {min_tokens} tokens")
