"""Several fields per ticket in one pass (`worker.engine.fields`), on the tiny stand-in (CPU, float32).

The rule of tests/unit/test_engine.py holds per field: every field's label probabilities equal the
unbatched reference for that field's full prompt (one ticket, no cache, full-vocabulary logits,
trie-constrained) within float32 noise, whatever the batch: tickets of very different lengths,
fields of different label counts, a field whose labels share a first token, a multi-label field.
"""

from __future__ import annotations

import math

import pytest
from texts import long_text

from producer.synthetic import awkward_texts, generate_tickets
from ticketq.schema import DEFAULT_FIELD, TicketFields, default_schema, load_schema, parse_schema
from worker.engine import Engine, EngineOptions, batching
from worker.engine.fields import FieldsEngine, FieldsHost
from worker.engine.prompt import FieldsPrompt, system_text, truncate
from worker.settings import DEFAULT_SYSTEM_PROMPT

PROB_TOL = 1e-4  # batched vs reference, float32 (as tests/unit/test_engine.py)

SCHEMA = {
    "name": "test-fields",
    "fields": {
        "team": {  # three labels, two of them sharing their first token: a trie branch below the root
            "instruction": "Which team should handle the ticket?",
            "labels": {"account": "login, profile", "account security": "hacked, 2FA", "billing": "money"},
            "threshold": 0.3,
        },
        "urgent": {"instruction": "Is the ticket urgent?", "labels": ["yes", "no"], "threshold": 0.05},
        "priority": {"instruction": "How urgent?", "labels": ["low", "normal", "high", "urgent", "critical"]},
        "topics": {  # multi-label: each label its own yes / no question
            "instruction": "Which topics does the ticket mention?",
            "labels": ["refund", "outage", "password"],
            "multi": True,
            "threshold": 0.2,
        },
    },
}


@pytest.fixture(scope="module")
def schema():
    return parse_schema(SCHEMA)


@pytest.fixture(scope="module")
def fields_engine(tiny_engine, schema) -> FieldsEngine:
    return tiny_engine.fields(schema)


@pytest.fixture(scope="module")
def tickets(tiny_engine) -> list[str]:
    """Very different lengths: one-token tickets, the synthetic long tail, 450-900 token ones (truncated)."""
    texts = ["a", "?", "Refund please"]
    texts += [t["text"] for t in generate_tickets(36, seed=5)]
    texts += [long_text(tiny_engine, n, seed) for n, seed in ((450, 41), (700, 42), (900, 43))]
    texts += awkward_texts()[:6]
    return texts


@pytest.fixture(scope="module")
def classified(fields_engine, tickets):
    return fields_engine.classify(tickets)


@pytest.fixture(scope="module")
def references(fields_engine, tickets) -> list[TicketFields]:
    return [fields_engine.reference(text) for text in tickets]


def assert_fields_match(got: list[TicketFields], want: list[TicketFields], tol: float = PROB_TOL) -> float:
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.fields.keys() == b.fields.keys()
        assert (a.tokens, a.ticket_tokens, a.truncation) == (b.tokens, b.ticket_tokens, b.truncation), i
        for name, result in a.fields.items():
            expected = b.fields[name]
            assert result.probs.keys() == expected.probs.keys()
            diff = max(abs(result.probs[k] - expected.probs[k]) for k in result.probs)
            assert diff <= tol, f"ticket {i} field {name}: {result.probs} vs {expected.probs}"
            assert (result.label, result.labels) == (expected.label, expected.labels), (i, name)
            assert result.confidence == pytest.approx(expected.confidence, abs=2 * tol)
            worst = max(worst, diff)
    return worst


# ----- the prompt --------------------------------------------------------------------------


def test_the_shared_part_is_a_true_token_prefix_of_every_fields_prompt(fields_engine):
    """prefix + ticket + opening + suffix ids are the rendered full prompt tokenised whole."""
    prompt, tokenizer = fields_engine.prompt, fields_engine.engine.tokenizer
    assert len(prompt.questions) == 3 + 3  # team, urgent, priority, and one per topic
    texts = ["My invoice is wrong!", "The app crashes?", "Login fails 42", "Grüße 🙏", "x"]
    for text in texts:
        encoded = prompt.encode(text)
        for question in prompt.questions:
            full = prompt.full_ids(encoded, question)
            assert full[: len(prompt.prefix_ids) + len(encoded.ids)] == [*prompt.prefix_ids, *encoded.ids]
            whole = tokenizer(prompt.render(text, question), add_special_tokens=False)["input_ids"]
            assert whole == full, (text, question.field, question.label)
            for name in question.answers:  # each answer's tokens follow the opening as the text would
                seq = question.trie.sequences[name]
                said = tokenizer(prompt.render(text, question) + " " + name, add_special_tokens=False)["input_ids"]
                assert said == full + list(seq[:-1]), (question.field, name)


def test_the_system_prompt_describes_every_field(fields_engine, schema):
    system = fields_engine.prompt.template.system
    for spec in schema.fields:
        assert f"{spec.name}: {spec.instruction}" in system
        assert all(f"- {label}" in system for label in spec.labels)
    assert "- account security: hacked, 2FA" in system


def test_default_schema_prompt_is_the_engines(tiny_engine, tiny_settings):
    schema = default_schema(tiny_engine.labels, DEFAULT_SYSTEM_PROMPT, tiny_settings.label_descriptions)
    assert tiny_engine.schema == schema
    prompt = FieldsPrompt(tiny_engine.tokenizer, schema)
    assert prompt.prefix_ids == tiny_engine.prompt.prefix_ids
    (question,) = prompt.questions
    assert question.suffix_ids == () and question.trie.sequences == tiny_engine.prompt.trie.sequences
    assert prompt.encode("refund me").ids == tiny_engine.prompt.encode("refund me").ids


# ----- exactness ---------------------------------------------------------------------------


def test_every_field_matches_its_reference(fields_engine, tickets, classified, references):
    results, reports = classified
    lengths = [r.tokens for r in results]
    assert min(lengths) <= 2 and max(lengths) == fields_engine.prompt.max_ticket_tokens
    assert sum(r.truncated for r in results) >= 2  # the 700 and 900 token tickets at least
    assert len(reports) == fields_engine.plan(fields_engine.encode(tickets)).forwards > 1  # one per batch
    assert sum(r.rows for r in reports) == len(tickets)
    # one segment per question, and one more for the team field's branch after "account"
    assert len(fields_engine._segments) == len(fields_engine.questions) + 1
    worst = assert_fields_match(results, references)
    print(f"\nmax |p_fields - p_reference| over {len(tickets)} tickets x {len(results[0].fields)} fields: {worst:.3e}")


def test_fields_match_under_a_padding_heavy_plan(fields_engine, tickets, references):
    """Arrival order in batches of 12: short tickets padded to long ones, question rows of every length."""
    encoded = fields_engine.encode(tickets)
    plan = batching.plan_fixed([fields_engine.row_length(e) for e in encoded], 12)
    assert plan.padding_ratio > 0.4
    results, _ = fields_engine.classify_encoded(encoded, plan)
    assert_fields_match(results, references)


def test_a_ticket_alone_equals_the_ticket_in_any_batch(fields_engine, tickets, classified):
    results, _ = classified
    for i in (0, 5, len(tickets) - 8):
        alone = fields_engine.classify([tickets[i]])[0][0]
        assert_fields_match([alone], [results[i]], tol=1e-5)


def test_the_trie_field_is_scored_over_its_whole_continuation(fields_engine, classified):
    team = next(q for q in fields_engine.questions if q.field == "team")
    assert len([path for path in team.trie.branches if path]) == 1  # after "account"
    results, _ = classified
    for result in results:
        probs = result.fields["team"].probs
        assert math.isclose(sum(probs.values()), 1.0, abs_tol=1e-5)
        assert all(0 < p < 1 for p in probs.values())


def test_field_results_are_well_formed(fields_engine, schema, classified):
    results, _ = classified
    for result in results:
        assert tuple(result.fields) == schema.field_names
        for spec in schema.fields:
            answer = result.fields[spec.name]
            assert tuple(answer.probs) == spec.labels
            if spec.multi:
                assert answer.labels == tuple(k for k, p in answer.probs.items() if p > spec.select)
                assert answer.confidence == pytest.approx(min(abs(p - 0.5) for p in answer.probs.values()) * 2)
            else:
                ranked = sorted(answer.probs.values(), reverse=True)
                assert math.isclose(sum(ranked), 1.0, abs_tol=1e-5)
                assert answer.probs[answer.label] == ranked[0]
                assert answer.confidence == pytest.approx(ranked[0] - ranked[1], abs=1e-7)
            assert answer.review == (answer.confidence < spec.threshold)
        assert result.review == any(a.review for a in result.fields.values())
    assert any(r.review for r in results) and not all(r.review for r in results)


def test_the_cached_prefix_is_never_written(fields_engine, tickets):
    snapshot, before = fields_engine.prefix_snapshot(), fields_engine.prefix_reuses
    fields_engine.classify(tickets[:20])
    assert fields_engine.prefix_reuses > before
    assert all(
        (k == k0).all() and (v == v0).all()
        for (k, v), (k0, v0) in zip(fields_engine._prefix_kv, snapshot, strict=True)
    )


def test_tickets_arriving_between_forwards_join_and_stream(fields_engine, tickets, references):
    arrivals = [tickets[10:20], [], tickets[20:]]
    streamed: dict[int, TicketFields] = {}

    def on_results(indices, answers) -> None:
        assert not streamed.keys() & set(indices)
        streamed.update(zip(indices, answers, strict=True))

    def more() -> list[str]:
        return arrivals.pop(0) if arrivals else []

    results, _ = fields_engine.classify(tickets[:10], on_answers=on_results, more=more)
    assert sorted(streamed) == list(range(len(tickets)))
    assert all(streamed[i] is r for i, r in enumerate(results))
    assert_fields_match(results, references)


# ----- the default schema ------------------------------------------------------------------


def test_the_default_schema_answers_as_classify(tiny_engine, tickets):
    runner = tiny_engine.fields()
    assert tiny_engine.fields() is runner  # built once per schema
    results, _ = runner.classify(tickets)
    predictions, _ = tiny_engine.classify(tickets)
    for result, prediction in zip(results, predictions, strict=True):
        answer = result.fields[DEFAULT_FIELD]
        assert answer.label == prediction.label and not answer.review
        assert max(abs(answer.probs[k] - prediction.probs[k]) for k in answer.probs) <= 1e-6
        assert answer.confidence == pytest.approx(prediction.margin, abs=1e-6)
        assert (result.truncated, result.tokens) == (prediction.truncated, prediction.tokens)
    reference = runner.reference(tickets[3]).fields[DEFAULT_FIELD]
    assert reference.probs == pytest.approx(tiny_engine.reference(tickets[3]).probs, abs=1e-6)


def test_an_engine_without_a_schema_asks_for_one(tiny_engine):
    bare = Engine(tiny_engine.model, tiny_engine.tokenizer,
        EngineOptions(labels=tiny_engine.labels, system=tiny_engine.prompt.system))
    with pytest.raises(ValueError, match="without a schema"):
        bare.fields()


def test_the_example_schema_runs_exactly(tiny_engine, tickets):
    runner = tiny_engine.fields(load_schema("examples/schema.toml"))
    sample = tickets[:6] + tickets[-9:-6]
    results, _ = runner.classify(sample)
    assert_fields_match(results, [runner.reference(t) for t in sample])
    assert {r.truncation for r in results} == {None, "head+tail"}


# ----- truncation --------------------------------------------------------------------------


def test_truncate_keeps_head_tail_or_both_ends():
    ids = list(range(10))
    assert truncate(ids, 4, "head") == [0, 1, 2, 3]
    assert truncate(ids, 4, "tail") == [6, 7, 8, 9]
    assert truncate(ids, 5, "head+tail") == [0, 1, 2, 8, 9]
    assert truncate(ids, 10, "tail") == ids
    with pytest.raises(ValueError, match="truncation must be one of"):
        truncate(ids, 4, "middle")


@pytest.mark.parametrize("mode", ["head", "tail", "head+tail"])
def test_each_truncation_mode_reads_its_part_of_a_long_ticket(tiny_engine, mode):
    engine = Engine(tiny_engine.model, tiny_engine.tokenizer,
        EngineOptions(labels=tiny_engine.labels, system=tiny_engine.prompt.system, max_ticket_tokens=16,
            truncation=mode))  # fmt: skip
    digits = "".join(str(i % 10) for i in range(40))  # one token per digit
    kept = {"head": digits[:16], "tail": digits[-16:], "head+tail": digits[:8] + digits[-8:]}[mode]
    encoded = engine.prompt.encode(digits)
    assert encoded.ids[:16] == tuple(engine.prompt.encode(kept).ids[:16])
    assert (encoded.truncated, encoded.ticket_tokens, encoded.total_tokens, encoded.truncation) == (True, 16, 40, mode)
    prediction = engine.classify([digits])[0][0]
    assert prediction.probs == pytest.approx(engine.reference(kept).probs, abs=PROB_TOL)  # the kept part, exactly
    schema = parse_schema({**SCHEMA, "truncation": mode})
    result = engine.fields(schema).classify([digits, "short"])[0]
    assert (result[0].truncation, result[0].tokens, result[0].ticket_tokens) == (mode, 16, 40)
    assert result[1].truncation is None and not result[1].truncated
    assert_fields_match(result, [engine.fields(schema).reference(t) for t in (digits, "short")])


def test_the_schema_truncation_overrides_the_engines(tiny_engine):
    assert tiny_engine.prompt.truncation == "head"
    runner = tiny_engine.fields(parse_schema({**SCHEMA, "name": "tail-schema", "truncation": "tail"}))
    assert runner.prompt.truncation == "tail"
    assert tiny_engine.fields(parse_schema(SCHEMA)).prompt.truncation == "head"  # none given: the engine's


def test_a_single_field_system_layout_is_classify_with_its_labels(tiny_engine):
    one = parse_schema({"name": "one", "fields": {"team": SCHEMA["fields"]["team"]}})
    assert one.layout == "system"
    labels = ("account", "account security", "billing")
    system = system_text("\n\n".join([one.system, "Which team should handle the ticket?"]), labels,
                         SCHEMA["fields"]["team"]["labels"])  # fmt: skip
    engine = Engine(tiny_engine.model, tiny_engine.tokenizer, EngineOptions(labels=labels, system=system))
    texts = ["my account got hacked", "refund the second charge please", "a"]
    results, _ = tiny_engine.fields(one).classify(texts)
    predictions, _ = engine.classify(texts)
    for result, prediction in zip(results, predictions, strict=True):
        assert result.fields["team"].probs == pytest.approx(prediction.probs, abs=1e-6)


def test_the_engine_offers_what_a_fields_engine_uses(tiny_engine):
    """`FieldsHost` names what a FieldsEngine uses of its engine; the engine has each, public."""
    needed = [*FieldsHost.__annotations__, "prime", "decode", "last_logits"]
    assert all(not name.startswith("_") and hasattr(tiny_engine, name) for name in needed)
