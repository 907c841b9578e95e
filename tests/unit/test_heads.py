"""Label heads (issue 43) on the tiny stand-in: a head fitted on the answer position's hidden states
learns the synthetic tickets' labels (zero-shot is chance on random weights), serves in the batched
path exactly as its unbatched reference, keeps float32's labels in a re-checked fast precision, and
is refused in one line for another model or another prompt."""

from __future__ import annotations

import platform

import pytest
import torch

from producer.synthetic import generate_tickets
from worker.engine.head import HeadMismatch, LabelHead, answer_labels, zero_shot
from worker.engine.headfit import collect, expected_calibration_error, fit_head, split
from worker.engine.replicas import load_engine

TRAIN, HELD = 400, 200


def changed(settings, **changes):
    return settings.model_copy(update=changes)


@pytest.fixture(scope="module")
def fitted(tiny_engine, tmp_path_factory):
    """A head fitted on TRAIN tickets of seed 1, saved; HELD tickets of seed 2 and their zero-shot answers."""
    train, held = generate_tickets(TRAIN, seed=1), generate_tickets(HELD, seed=2)
    labels = ("account", "billing", "technical")
    states, _ = collect(tiny_engine, [t["text"] for t in train])  # (N, H)
    targets = torch.tensor([labels.index(t["expected"]) for t in train])
    head = fit_head(states, targets, labels, split(TRAIN, 0.15), tiny_engine)
    path = tmp_path_factory.mktemp("head") / "head.safetensors"
    head.save(path)
    held_states, zero = collect(tiny_engine, [t["text"] for t in held])
    return path, head, held, held_states, zero


def accuracy(answers, tickets) -> float:
    return sum(a.label == t["expected"] for a, t in zip(answers, tickets, strict=True)) / len(tickets)


def test_a_head_learns_what_zero_shot_cannot_on_random_weights(fitted, tiny_engine):
    _, head, held, states, zero = fitted
    answers = head.answers(states, tiny_engine.encode([t["text"] for t in held]), "float32")
    learned, chance = accuracy(answers, held), accuracy(zero, held)
    print(f"\n[heads] tiny stand-in, {TRAIN} train / {HELD} held-out: head {learned:.1%}, zero-shot {chance:.1%}")
    assert learned >= chance + 0.1 and learned > 0.45
    assert not tiny_engine.head  # the tap is gone once the states are collected


def test_the_head_file_holds_tensors_and_metadata_and_round_trips(fitted):
    path, head, *_ = fitted
    loaded = LabelHead.load(path)
    assert loaded.digest == head.digest and loaded.labels == head.labels
    assert torch.equal(loaded.weight, head.weight) and loaded.summary["train"] == head.summary["train"]
    assert path.read_bytes()[8:9] == b"{"  # safetensors: a length, then a JSON header; no pickle anywhere


@pytest.fixture(scope="module")
def head_engine(fitted, tiny_settings):
    return load_engine(changed(tiny_settings, head=str(fitted[0])))


def test_the_served_head_equals_its_unbatched_reference_on_every_ticket(fitted, head_engine):
    _, head, held, *_ = fitted
    texts = [t["text"] for t in held]
    served, _ = head_engine.classify(texts)
    assert {p.scorer for p in served} == {head.scorer} and head_engine.info.scorer == head.scorer
    assert answer_labels(head_engine) == head.labels
    for text, answer in zip(texts, served, strict=True):
        want = head_engine.reference(text)
        assert answer.label == want.label and want.scorer == head.scorer
        assert max(abs(answer.probs[k] - want.probs[k]) for k in want.probs) < 1e-5


def test_zero_shot_view_of_a_head_engine_answers_with_the_lm_head(fitted, head_engine, tiny_engine):
    _, _, held, _, zero = fitted
    base, _ = zero_shot(head_engine).classify([t["text"] for t in held[:20]])
    assert [a.label for a in base] == [a.label for a in zero[:20]] and {a.scorer for a in base} == {"zero-shot"}
    assert head_engine.head is not None


FAST = ["bfloat16"] + (["int8"] if platform.machine() in ("x86_64", "AMD64") else [])


@pytest.mark.parametrize("precision", FAST)
def test_a_rechecked_fast_precision_serves_float32s_head_labels(fitted, tiny_settings, tmp_path, monkeypatch,
                                                                 precision):  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # its own calibration, measured with the head
    path, head, held, *_ = fitted
    exact = load_engine(changed(tiny_settings, head=str(path)))
    fast = load_engine(changed(tiny_settings, head=str(path), dtype=precision, recheck="always"))
    assert fast.policy.checked and fast.precision == precision
    texts = [t["text"] for t in held]
    served, _ = fast.classify(texts)
    assert sum(a.rechecked for a in served) > 0  # the tiny model's near-ties: some answers re-checked
    assert [a.label for a in served] == [exact.reference(text).label for text in texts]
    assert {a.scorer for a in served} == {head.scorer}


def test_a_head_for_another_model_is_refused_in_one_line(fitted, tiny_settings, tmp_path):
    from ticketq_cli.standin import build

    other = build("tiny", tmp_path / "other", seed=1)
    with pytest.raises(HeadMismatch, match="another model") as refused:
        load_engine(changed(tiny_settings, model=str(other), head=str(fitted[0])))
    assert "\n" not in str(refused.value) and "ticketq fit" in str(refused.value)


def test_a_head_for_another_prompt_is_refused_in_one_line(fitted, tiny_settings, tmp_path):
    other = changed(tiny_settings, head=str(fitted[0]), system_prompt="Route this ticket to a team.")
    with pytest.raises(HeadMismatch, match="another prompt") as refused:
        load_engine(other)
    assert "\n" not in str(refused.value)
    (tmp_path / "junk").write_bytes(b"not a head")
    with pytest.raises(HeadMismatch, match="cannot be read"):
        load_engine(changed(tiny_settings, head=str(tmp_path / "junk")))


def test_expected_calibration_error():
    assert expected_calibration_error([1.0, 1.0], [True, True]) == 0.0
    assert expected_calibration_error([0.9, 0.9], [False, False]) == pytest.approx(0.9)
    assert expected_calibration_error([0.55, 0.95], [True, False]) == pytest.approx(0.5 * 0.45 + 0.5 * 0.95)


def test_the_fingerprint_is_the_models_whatever_its_precision_or_kernels(tiny_engine):
    import copy

    from worker.engine.head import model_fingerprint

    fast = copy.deepcopy(tiny_engine.model).to(torch.bfloat16)  # a worker's unchecked bfloat16 copy
    assert model_fingerprint(fast) == model_fingerprint(tiny_engine.model)
