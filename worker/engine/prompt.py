"""The prompt: system instructions + label set, rendered once with the chat template and split
around the ticket into prefix / ticket / suffix token ids, plus the label trie.

The template is rendered with `enable_thinking=False`: a Qwen3-style template otherwise opens a
`<think>` block after the assistant's header, and the label would be scored inside it. Templates
that do not read the variable ignore it.

The batched path feeds `prefix_ids` once (cached) and `ticket_ids + suffix_ids` per row; the
reference path feeds the three concatenated. Tickets are tokenised on their own with special
tokens split, so a ticket that contains `<|im_end|>` cannot close its own user turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from ticketq.contract import TicketRejected, check_text

TICKET_MARKER = "\x00TICKET\x00"
ANSWER_MARKER = "\x00ANSWER\x00"


class InvalidTicket(TicketRejected):
    """A ticket text the engine refuses under the contract's text rule; `reason` and the message say why."""


@dataclass(frozen=True)
class EncodedTicket:
    ids: tuple[int, ...]  # ticket tokens + suffix tokens: what one batch row carries
    ticket_tokens: int  # tokens of the ticket itself after truncation
    truncated: bool


def canonical_text(text: object) -> str:
    """The text both paths classify: surrounding whitespace removed (it only moves token boundaries).

    Validity is the contract's text rule (`ticketq.contract.check_text`), less the byte limit that
    the edges apply: the engine reads at most `max_ticket_tokens` tokens of any text instead.
    """
    try:
        return check_text(text).strip()
    except TicketRejected as exc:
        raise InvalidTicket(exc.reason, exc.detail) from None


def system_text(system_prompt: str, labels: tuple[str, ...], descriptions: dict[str, str]) -> str:
    lines = [system_prompt.strip(), "", "Labels:"]
    lines += [f"- {name}: {descriptions[name]}" if name in descriptions else f"- {name}" for name in labels]
    lines += ["", "Answer with exactly one label: " + ", ".join(labels) + "."]
    return "\n".join(lines)


@dataclass
class LabelTrie:
    """Label token sequences (each ending in the end-of-answer token) as a trie.

    Constrained decoding only chooses at nodes with two or more children; the probability of a
    label is the product, over those nodes on its path, of the softmax among the node's children.
    The root is such a node only when the labels differ in their first token (`team1`, `team2`
    share `team`: the first choice is after it). A label that is a prefix of another (`team1`,
    `team10`) is chosen by its end-of-answer token, a child beside the longer label's next token:
    after `team1` the model either ends its answer or goes on, as a constrained decoder lets it.
    """

    sequences: dict[str, tuple[int, ...]]
    # branch node path -> its child tokens (sorted); only nodes where a choice is made
    branches: dict[tuple[int, ...], tuple[int, ...]] = field(init=False)

    def __post_init__(self) -> None:
        self._check_prefix_free()
        children: dict[tuple[int, ...], set[int]] = {}
        for seq in self.sequences.values():
            for depth in range(len(seq)):
                children.setdefault(seq[:depth], set()).add(seq[depth])
        self.branches = {path: tuple(sorted(kids)) for path, kids in children.items() if len(kids) > 1}

    def _check_prefix_free(self) -> None:
        """A sequence that is another's prefix ends at an inner node: no choice could ever pick it."""
        named = sorted((seq, name) for name, seq in self.sequences.items())
        for (seq, name), (longer, other) in pairwise(named):  # a prefix sorts just before its extensions
            if seq == longer:
                raise ValueError(f"labels {name!r} and {other!r} tokenise identically")
            if longer[: len(seq)] == seq:
                raise ValueError(
                    f"label {name!r} is a prefix of {other!r} and no end-of-answer token follows it (the chat "
                    "template closes no answer with a special token, the tokenizer has no eos_token)"
                )

    @property
    def root_only(self) -> bool:
        """True when every label starts with a distinct token: one forward pass decides."""
        return set(self.branches) == {()}

    def decisions(self, name: str) -> list[tuple[tuple[int, ...], int]]:
        """The (branch path, child index) choices that spell `name`."""
        seq = self.sequences[name]
        return [
            (seq[:depth], self.branches[seq[:depth]].index(seq[depth]))
            for depth in range(len(seq))
            if seq[:depth] in self.branches
        ]


class PromptTemplate:
    """Chat-template prompt split around the ticket; owns all tokenisation of tickets and labels."""

    def __init__(self, tokenizer, system: str, labels: tuple[str, ...], max_ticket_tokens: int = 512) -> None:
        self.tokenizer = tokenizer
        self.labels = labels
        self.max_ticket_tokens = max_ticket_tokens
        self.system = system
        rendered = self.render(TICKET_MARKER)
        if rendered.count(TICKET_MARKER) != 1:
            raise ValueError("the chat template must place the user message exactly once")
        self.prefix_text, self.suffix_text = rendered.split(TICKET_MARKER)
        self.prefix_ids = tuple(self._encode_special(self.prefix_text))
        self.suffix_ids = tuple(self._encode_special(self.suffix_text))
        end = self.end_of_answer()
        self.trie = LabelTrie(
            {name: (*self._encode_plain(name), *([end] if end is not None else [])) for name in labels}
        )

    def render(self, ticket: str, system: str | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            self._messages(ticket, system), tokenize=False, add_generation_prompt=True, enable_thinking=False
        )

    def end_of_answer(self) -> int | None:
        """The token that closes the assistant's turn in this template (Qwen's `<|im_end|>`), else the EOS token.

        Read from the template rather than `eos_token`, which a base model's tokenizer sets to its
        end-of-document token. Only an added token counts: a plain-text ending could merge with a
        label's last token, and the label would no longer be its own tokens followed by the end.
        """
        messages = [*self._messages("?", None), {"role": "assistant", "content": ANSWER_MARKER}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
        closing = self._encode_special(rendered.partition(ANSWER_MARKER)[2])
        if closing and closing[0] in self.tokenizer.added_tokens_decoder:
            return closing[0]
        return self.tokenizer.eos_token_id

    def _messages(self, ticket: str, system: str | None) -> list[dict[str, str]]:
        return [{"role": "system", "content": system or self.system}, {"role": "user", "content": ticket}]

    def encode(self, text: object) -> EncodedTicket:
        ids = self._encode_plain(canonical_text(text))
        truncated = len(ids) > self.max_ticket_tokens
        ids = ids[: self.max_ticket_tokens]
        return EncodedTicket(ids=(*ids, *self.suffix_ids), ticket_tokens=len(ids), truncated=truncated)

    def full_ids(self, encoded: EncodedTicket) -> list[int]:
        """The reference path's input: prefix + ticket + suffix, nothing cached."""
        return [*self.prefix_ids, *encoded.ids]

    def _encode_special(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
