"""Schema-field heads (issue 43) on the tiny stand-in: a schema with one single-label field (`team`)
and one multi-label field (`mentions`, one logistic per label), heads fitted on the hidden states
at each question's answer position. They learn what zero-shot cannot on random weights; served
through `FieldsEngine`'s batched path they equal its unbatched reference on every ticket and say
their scorer; a re-checked fast precision serves float32's labels; a head for another prompt,
model or field is refused at start-up in one line."""

from __future__ import annotations

import platform

import pytest
import torch

from producer.synthetic import generate_tickets
from ticketq.schema import SchemaError, load_schema, parse_schema
from worker.engine.head import HeadMismatch
from worker.engine.headfit import collect_fields, fit_field_head, split
from worker.engine.replicas import load_engine

TRAIN, HELD = 400, 200
LABELS = ("billing", "technical", "account")


def schema_text(heads: bool = False, system: str = "You are a support ticket assistant.") -> str:
    """The schema file: with `heads`, each field names its head in `heads/` beside the file. (The tiny
    stand-in's random layers mix the long fields prompt into each answer position: with the default
    system text the team head learns less, 37% against 51% here, so the test names a short one.)"""
    head = (lambda name: f'head = "heads/{name}.safetensors"\n') if heads else (lambda name: "")
    return (f'name = "triage-heads"\nsystem = {system!r}\n\n'
            f'[fields.team]\ninstruction = "Which team should handle the ticket?"\nlabels = {list(LABELS)}\n'
            f'{head("team")}\n'
            f'[fields.mentions]\ninstruction = "Which topics does the ticket mention?"\nlabels = {list(LABELS)}\n'
            f'multi = true\n{head("mentions")}')  # fmt: skip


SCHEMA = schema_text()


@pytest.fixture(scope="module")
def fitted(tiny_engine, tmp_path_factory):
    """Both fields' heads fitted on TRAIN tickets of seed 1 (mentions: the ticket's own topic), saved
    beside a schema file that names them; HELD tickets of seed 2."""
    folder = tmp_path_factory.mktemp("field-heads")
    schema = parse_schema(SCHEMA)
    runner = tiny_engine.fields(schema)
    train = generate_tickets(TRAIN, seed=1)
    states, _ = collect_fields(runner, [t["text"] for t in train])  # (N, Q, H): team's question, then 3 labels'
    parts = split(TRAIN, 0.15)
    team = fit_field_head(states[:, 0], torch.tensor([LABELS.index(t["expected"]) for t in train]),
                          schema.field("team"), parts, runner)  # fmt: skip
    yes = torch.tensor([[int(t["expected"] == label) for label in LABELS] for t in train])  # (N, L)
    mentions = fit_field_head(states[:, 1:], yes, schema.field("mentions"), parts, runner)
    (folder / "heads").mkdir()
    team.save(folder / "heads" / "team.safetensors")
    mentions.save(folder / "heads" / "mentions.safetensors")
    (folder / "schema.toml").write_text(schema_text(heads=True))
    return folder, team, mentions, generate_tickets(HELD, seed=2)


def test_the_heads_learn_what_zero_shot_cannot_on_random_weights(fitted, tiny_engine):
    folder, team, mentions, held = fitted
    texts = [t["text"] for t in held]
    headed, _ = tiny_engine.fields(load_schema(folder / "schema.toml")).classify(texts)
    zero, _ = tiny_engine.fields(parse_schema(SCHEMA)).classify(texts)

    def team_right(answers):
        return sum(a.fields["team"].label == t["expected"] for a, t in zip(answers, held, strict=True)) / HELD

    def mentions_right(answers):  # the exact set: just the ticket's own topic
        return sum(a.fields["mentions"].labels == (t["expected"],) for a, t in zip(answers, held, strict=True)) / HELD

    print(f"\n[field heads] tiny stand-in, {TRAIN} train / {HELD} held-out: team head {team_right(headed):.1%} vs "
          f"zero-shot {team_right(zero):.1%}; mentions head {mentions_right(headed):.1%} vs {mentions_right(zero):.1%}")
    assert team_right(headed) >= team_right(zero) + 0.05
    assert mentions_right(headed) >= mentions_right(zero) + 0.1
    assert team.multi is False and mentions.multi is True and mentions.weight.shape == (3, team.weight.shape[1])


def test_served_heads_equal_their_unbatched_reference_and_say_their_scorer(fitted, tiny_engine):
    folder, team, mentions, held = fitted
    runner = tiny_engine.fields(load_schema(folder / "schema.toml"))
    texts = [t["text"] for t in held[:40]]
    served, _ = runner.classify(texts)
    for text, answer in zip(texts, served, strict=True):
        want = runner.reference(text)
        assert answer.scorer == want.scorer == f"team={team.scorer},mentions={mentions.scorer}"
        for name, result in answer.fields.items():
            assert result.labels == want.fields[name].labels and result.scorer == want.fields[name].scorer
            assert max(abs(p - want.fields[name].probs[k]) for k, p in result.probs.items()) < 1e-5
    assert served[0].to_json()["fields"]["team"]["scorer"] == team.scorer
    (zero,), _ = tiny_engine.fields(parse_schema(SCHEMA)).classify(texts[:1])
    assert "scorer" not in zero.to_json()["fields"]["team"] and zero.scorer == "zero-shot"


FAST = ["bfloat16"] + (["int8"] if platform.machine() in ("x86_64", "AMD64") else [])


@pytest.mark.parametrize("precision", FAST)
def test_a_rechecked_fast_precision_serves_float32s_field_head_labels(fitted, tiny_settings, tmp_path, monkeypatch,
                                                                       precision):  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its own calibration, measured with the heads
    folder, _, _, held = fitted
    schema = load_schema(folder / "schema.toml")
    exact = load_engine(tiny_settings).fields(schema)
    fast = load_engine(tiny_settings.model_copy(update={"dtype": precision, "recheck": "always"})).fields(schema)
    assert fast.policy.checked and fast.precision == precision
    texts = [t["text"] for t in held]
    served, _ = fast.classify(texts)
    want = [exact.reference(text) for text in texts]
    for got, ref in zip(served, want, strict=True):
        assert {n: r.labels for n, r in got.fields.items()} == {n: r.labels for n, r in ref.fields.items()}
    assert {a.scorer for a in served} == {want[0].scorer}


def test_the_worker_names_the_field_heads_and_refuses_another_prompts_in_one_line(fitted, tiny_settings, tmp_path):
    folder, team, mentions, _ = fitted
    engine = load_engine(tiny_settings.model_copy(update={"schemas": str(folder / "schema.toml")}))
    assert engine.info.heads == f"triage-heads.team={team.scorer} triage-heads.mentions={mentions.scorer}"
    other = tmp_path / "schema.toml"
    (tmp_path / "heads").symlink_to(folder / "heads")
    other.write_text(schema_text(heads=True, system="Route the ticket."))
    with pytest.raises(HeadMismatch, match="another prompt") as refused:
        load_engine(tiny_settings.model_copy(update={"schemas": str(other)}))
    assert "\n" not in str(refused.value) and "field team" in str(refused.value)


def test_a_head_for_another_field_or_as_ticketq_head_is_refused(fitted, tiny_settings, tmp_path):
    folder, *_ = fitted
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "team.safetensors").symlink_to(folder / "heads" / "mentions.safetensors")
    (tmp_path / "heads" / "mentions.safetensors").symlink_to(folder / "heads" / "mentions.safetensors")
    (tmp_path / "schema.toml").write_text(schema_text(heads=True))
    with pytest.raises(HeadMismatch, match="other labels"):
        load_engine(tiny_settings.model_copy(update={"schemas": str(tmp_path / "schema.toml")}))
    with pytest.raises(HeadMismatch, match="schema field 'team'"):
        load_engine(tiny_settings.model_copy(update={"head": str(folder / "heads" / "team.safetensors")}))


def test_a_head_for_another_model_is_refused(fitted, tiny_settings, tmp_path):
    from ticketq_cli.standin import build

    folder, *_ = fitted
    other = build("tiny", tmp_path / "other", seed=1)
    with pytest.raises(HeadMismatch, match="another model"):
        load_engine(tiny_settings.model_copy(update={"model": str(other), "schemas": str(folder / "schema.toml")}))


def test_a_field_head_is_a_path_relative_to_its_schema_file(tmp_path):
    (tmp_path / "s.toml").write_text(SCHEMA.replace("multi = true", 'multi = true\nhead = "h/m.safetensors"'))
    schema = load_schema(tmp_path / "s.toml")
    assert schema.field("mentions").head == str(tmp_path / "h" / "m.safetensors") and schema.field("team").head is None
    with pytest.raises(SchemaError, match="head must be the path of a head file"):
        parse_schema(SCHEMA.replace("multi = true", "multi = true\nhead = 3"))
