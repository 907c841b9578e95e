"""The prompt: system instructions + label set, rendered once with the chat template and split
around the ticket into prefix / ticket / suffix token ids, plus the label trie.

The template is rendered with `enable_thinking=False`: a Qwen3-style template otherwise opens a
`<think>` block after the assistant's header, and the label would be scored inside it. Templates
that do not read the variable ignore it.

The batched path feeds `prefix_ids` once (cached) and `ticket_ids + suffix_ids` per row; the
reference path feeds the three concatenated. Tickets are tokenised on their own with special
tokens split, so a ticket that contains `<|im_end|>` cannot close its own user turn.

`FieldsPrompt` is the same split for a schema of several fields (`ticketq.schema`): the system
prompt describes every field, the ticket and the template's answer opening are shared by all of
them, and each field's answer starts with its own name (`priority:`). Every field's full prompt is
`prefix_ids + ticket ids + answer opening + the field's suffix ids`, the shared part a true token
prefix of each; the suffix starts with a letter after the opening's newline, so the tokens are
also those of the rendered prompt tokenised whole.

Tickets longer than `max_ticket_tokens` are cut by a truncation mode (`ticketq.schema.TRUNCATIONS`):
`head` keeps the first tokens (the default, what ticketq always did), `tail` the last, `head+tail`
the first half and the last half of the limit: `ticketq.schema.truncate`, the one rule (the gateway
cuts a helpdesk's over-long text by it too, in bytes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import pairwise

from ticketq import contract
from ticketq.contract import TicketRejected
from ticketq.schema import TRUNCATIONS, Schema, truncate

TICKET_MARKER = "\x00TICKET\x00"
ANSWER_MARKER = "\x00ANSWER\x00"


class InvalidTicket(TicketRejected):
    """A ticket text the engine refuses under the contract's text rule; `reason` and the message say why."""


# Ticket texts whose encoding a prompt remembers (a few hundred bytes each).
ENCODED_CACHE = 4096


@dataclass(frozen=True)
class EncodedTicket:
    ids: tuple[int, ...]  # ticket tokens + suffix tokens: what one batch row carries
    ticket_tokens: int  # tokens of the ticket itself after truncation
    truncated: bool
    total_tokens: int = 0  # tokens of the ticket before truncation
    truncation: str = "head"  # the mode that cut it, where `truncated`


def canonical_text(text: object) -> str:
    """The text both paths classify (`ticketq.contract.canonical_text`), an invalid one `InvalidTicket`.

    Validity is the contract's text rule (`ticketq.contract.check_text`), less the byte limit that
    the edges apply: the engine reads at most `max_ticket_tokens` tokens of any text instead.
    """
    try:
        return contract.canonical_text(text)
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

    def __init__(
        self,
        tokenizer,
        system: str,
        labels: tuple[str, ...],
        max_ticket_tokens: int = 512,
        truncation: str = "head",
    ) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATIONS)}, got {truncation!r}")
        self.tokenizer = tokenizer
        self.labels = labels
        self.max_ticket_tokens = max_ticket_tokens
        self.truncation = truncation
        self.system = system
        rendered = self.render(TICKET_MARKER)
        if rendered.count(TICKET_MARKER) != 1:
            raise ValueError("the chat template must place the user message exactly once")
        self.prefix_text, self.suffix_text = rendered.split(TICKET_MARKER)
        self.prefix_ids = tuple(self._encode_special(self.prefix_text))
        self.suffix_ids = tuple(self._encode_special(self.suffix_text))
        self.trie = self.label_trie(labels)
        self._encoded: OrderedDict[str, EncodedTicket] = OrderedDict()  # canonical text -> its encoding, LRU
        self._encoded_lock = threading.Lock()  # the shadow checker's thread encodes too

    def label_trie(self, labels: tuple[str, ...], lead: str = "") -> LabelTrie:
        """Each label's tokens (after `lead`, e.g. the space that follows `priority:`), then the end of the answer."""
        end = self.end_of_answer()
        closing = [end] if end is not None else []
        return LabelTrie({name: (*self._encode_plain(lead + name), *closing) for name in labels})

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
        """The ticket's row: its tokens (truncated) and the suffix's. The last ENCODED_CACHE texts'
        encodings are remembered, so a duplicate (an outage's flood) is tokenized once."""
        canonical = canonical_text(text)
        with self._encoded_lock:
            known = self._encoded.get(canonical)
            if known is not None:
                self._encoded.move_to_end(canonical)
                return known
        whole = self._encode_plain(canonical)
        ids = truncate(whole, self.max_ticket_tokens, self.truncation)
        encoded = EncodedTicket(
            ids=(*ids, *self.suffix_ids),
            ticket_tokens=len(ids),
            truncated=len(whole) > len(ids),
            total_tokens=len(whole),
            truncation=self.truncation,
        )
        with self._encoded_lock:
            self._encoded[canonical] = encoded
            if len(self._encoded) > ENCODED_CACHE:
                self._encoded.popitem(last=False)
        return encoded

    def full_ids(self, encoded: EncodedTicket) -> list[int]:
        """The reference path's input: prefix + ticket + suffix, nothing cached."""
        return [*self.prefix_ids, *encoded.ids]

    def _encode_special(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


# ----- schemas of several fields ---------------------------------------------------------------

YES, NO = "yes", "no"  # the answers of a multi-label field's question about one label


@dataclass(frozen=True)
class Question:
    """One scored answer: a single-label field, or one label of a multi-label field (yes / no)."""

    field: str
    label: str | None  # multi-label: the label asked about; single-label: None
    suffix_text: str  # after the shared part: the answer's opening (`priority:`)
    suffix_ids: tuple[int, ...]
    trie: LabelTrie
    answers: tuple[str, ...]  # the trie's labels: the field's labels, or (yes, no)


class FieldsPrompt:
    """A schema's prompt: one cached prefix, the ticket and answer opening shared by every field, a
    short suffix per question.

    Layout "system" (one single-label field; the default schema): exactly `PromptTemplate`'s prompt,
    the field's labels in the system prompt and its answer straight after the ticket, so the one
    question's suffix is empty. Layout "fields": the system prompt describes every field; after the
    ticket and the template's answer opening, each question's suffix is its field's name and a colon
    (`priority:`), or for a multi-label field `topics: refund?`, answered ` yes` or ` no`.
    """

    def __init__(self, tokenizer, schema: Schema, max_ticket_tokens: int = 512, truncation: str = "head") -> None:
        self.schema = schema
        truncation = schema.truncation or truncation
        if schema.layout == "system":
            (only,) = schema.fields
            system = system_text(_joined(schema.system, only.instruction), only.labels, dict(only.descriptions))
            self.template = PromptTemplate(tokenizer, system, only.labels, max_ticket_tokens, truncation)
            self.questions = (Question(only.name, None, "", (), self.template.trie, only.labels),)
        else:
            system = fields_system_text(schema)
            self.template = PromptTemplate(tokenizer, system, (), max_ticket_tokens, truncation)
            self.questions = tuple(self._questions())
        self.prefix_ids = self.template.prefix_ids

    def _questions(self):
        def ids(text: str) -> tuple[int, ...]:
            return tuple(self.template._encode_special(text))

        yes_no = self.template.label_trie((YES, NO), lead=" ")
        for spec in self.schema.fields:
            if spec.multi:
                for label in spec.labels:
                    text = f"{spec.name}: {label}?"
                    yield Question(spec.name, label, text, ids(text), yes_no, (YES, NO))
            else:
                text = f"{spec.name}:"
                trie = self.template.label_trie(spec.labels, lead=" ")
                yield Question(spec.name, None, text, ids(text), trie, spec.labels)

    @property
    def max_ticket_tokens(self) -> int:
        return self.template.max_ticket_tokens

    @property
    def truncation(self) -> str:
        return self.template.truncation

    def encode(self, text: object) -> EncodedTicket:
        """The shared part after the prefix: the ticket's tokens (truncated) and the answer opening."""
        return self.template.encode(text)

    def full_ids(self, encoded: EncodedTicket, question: Question) -> list[int]:
        """A question's whole prompt, as the reference reads it: prefix + ticket + opening + its suffix."""
        return [*self.prefix_ids, *encoded.ids, *question.suffix_ids]

    def render(self, ticket: str, question: Question) -> str:
        """A question's whole prompt as text (the chat template's rendering plus the suffix)."""
        return self.template.render(ticket) + question.suffix_text


def fields_system_text(schema: Schema) -> str:
    """The system prompt of the "fields" layout: the shared instructions, then every field and its labels."""
    lines = [schema.system.strip(), ""]
    lines.append(
        "After the ticket, each answer starts with the name of its field and a colon, followed by the label."
    )
    for spec in schema.fields:
        lines += ["", f"{spec.name}: {spec.instruction}"]
        lines += [f"- {name}: {spec.descriptions[name]}" if name in spec.descriptions else f"- {name}"
                  for name in spec.labels]  # fmt: skip
        if spec.multi:
            asked = f'"{spec.name}: <label>?"'
            lines.append(f"Several labels may apply: for each label, {asked} is answered {YES} or {NO}.")
        else:
            lines.append(f"Answer with exactly one label: {', '.join(spec.labels)}.")
    return "\n".join(lines)


def _joined(*parts: str) -> str:
    return "\n\n".join(part.strip() for part in parts if part.strip())
