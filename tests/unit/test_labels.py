"""Label sets whose trie has no choice at the root, or labels that are prefixes of each other.

Labels that all share their first token (`team1,team2`) are decided after it, and a label that is a
prefix of another (`team1`, `team10`) is chosen by the end-of-answer token, a branch beside the
longer label's next token. The batched path must score every such set exactly as the reference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import PROB_TOL, assert_matches_reference, assert_well_formed, snapshot_equal

from producer.synthetic import awkward_texts, generate_tickets
from worker.engine import Engine, EngineOptions
from worker.engine.prompt import LabelTrie, system_text
from worker.engine.replicas import load_engine
from worker.settings import DEFAULT_SYSTEM_PROMPT, SettingsError, load_settings

LABEL_SETS = {  # TICKETQ_LABELS values from the report, and labels nested as prefixes
    "shared-first-token": "team1,team2",
    "shared-first-word": "account security,account deletion",
    "fifty": ",".join(f"team{i}" for i in range(50)),
    "prefixes": "team1,team10,team100",
}


def settings_with_labels(tiny_settings, labels: str):
    """The stand-in's settings with TICKETQ_LABELS=`labels`, validated as at the worker's start-up."""
    return load_settings(**{**tiny_settings.model_dump(), "labels": labels})


@pytest.fixture(scope="module", params=list(LABEL_SETS), ids=list(LABEL_SETS))
def label_engine(request, tiny_settings) -> Engine:
    return load_engine(settings_with_labels(tiny_settings, LABEL_SETS[request.param]))


@pytest.fixture(scope="module")
def tickets() -> list[str]:
    """40 varied tickets: synthetic, awkward, and one long enough to be truncated."""
    long_ = " ".join(t["text"] for t in generate_tickets(40, seed=5))
    return [t["text"] for t in generate_tickets(25, seed=7)] + awkward_texts()[:14] + [long_]


def engine_with(tiny_engine, labels: tuple[str, ...]) -> Engine:
    system = system_text(DEFAULT_SYSTEM_PROMPT, labels, {})
    return Engine(tiny_engine.model, tiny_engine.tokenizer, EngineOptions(labels=labels, system=system))


# ----- the trie ------------------------------------------------------------------------------


def test_no_label_set_from_the_report_chooses_at_the_root(label_engine):
    trie = label_engine.prompt.trie
    assert () not in trie.branches, "every label starts with the same token: the first choice comes after it"
    assert trie.branches


def test_a_prefix_label_ends_where_the_longer_one_goes_on(tiny_engine):
    trie = engine_with(tiny_engine, ("team1", "team10", "team100")).prompt.trie
    end = tiny_engine.prompt.end_of_answer()
    team1, team10, team100 = (trie.sequences[name] for name in ("team1", "team10", "team100"))
    assert team10[: len(team1) - 1] == team1[:-1] and team100[: len(team10) - 1] == team10[:-1]
    # after `team1`: end the answer or go on with `0`; after `team10`: the same again
    assert trie.branches == {
        team1[:-1]: tuple(sorted((end, team10[len(team1) - 1]))),
        team10[:-1]: tuple(sorted((end, team100[len(team10) - 1]))),
    }


def test_labels_only_a_missing_end_token_could_tell_apart_are_refused():
    with pytest.raises(ValueError, match=r"label 'team1' is a prefix of 'team10'"):
        LabelTrie({"team1": (9, 16), "team10": (9, 16, 15)})
    with pytest.raises(ValueError, match="tokenise identically"):
        LabelTrie({"a": (9, 16), "b": (9, 16)})


def test_a_single_label_is_refused_at_start_up(tiny_settings):
    """The engine never sees one label: the settings refuse it, so a prediction always has a runner-up."""
    with pytest.raises(SettingsError, match="TICKETQ_LABELS=team1: needs at least two labels"):
        settings_with_labels(tiny_settings, "team1")


# ----- exactness -----------------------------------------------------------------------------


def test_label_set_matches_reference(label_engine, tickets):
    engine = label_engine
    snapshot = engine.prefix_snapshot()
    predictions, reports = engine.classify(tickets)
    assert any(r.rows > 1 for r in reports)
    worst = assert_matches_reference(predictions, [engine.reference(t) for t in tickets])
    print(f"\nmax diff with {len(engine.labels)} labels {engine.labels[:3]}...: {worst:.3e}")
    for prediction in predictions:
        assert_well_formed(prediction, engine.labels)
    assert snapshot_equal(engine, snapshot)


def end_probability(engine: Engine, full: list[int], path: tuple[int, ...], go_on: int) -> float:
    """The model's probability of ending its answer after `path` rather than going on with `go_on`."""
    end = engine.prompt.end_of_answer()
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([[*full, *path]])).logits[0, -1]  # (V,)
    return float(torch.softmax(logits[[end, go_on]].double(), dim=-1)[0])


def test_a_prefix_label_is_the_models_choice_to_end_its_answer(tiny_engine, tickets):
    """P(team1) = P(end | team1); P(team10) = P(0 | team1) P(end | team10); each softmax over the allowed tokens."""
    engine = engine_with(tiny_engine, ("team1", "team10", "team100"))
    seq = engine.prompt.trie.sequences
    zero = seq["team10"][-2]
    for text in tickets[:3]:
        full = engine.prompt.full_ids(engine.prompt.encode(text))
        after_1 = end_probability(engine, full, seq["team1"][:-1], zero)
        after_10 = end_probability(engine, full, seq["team10"][:-1], zero)
        want = {"team1": after_1, "team10": (1 - after_1) * after_10, "team100": (1 - after_1) * (1 - after_10)}
        got = engine.classify([text])[0][0].probs
        assert got == pytest.approx(want, abs=PROB_TOL)


# ----- any label set -------------------------------------------------------------------------

# Few pieces, so random labels often share their first tokens and are prefixes of each other.
PIECES = ("team", "account", "accounts", " security", "1", "0", "10", "-", "a", "ab")
LABEL = st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map(lambda parts: "".join(parts).strip())
# A stem shared by every label leaves the root a single child: the first choice comes after it.
LABEL_SET = st.builds(
    lambda stem, names: tuple(stem + name for name in names),
    st.sampled_from(("", "team", "account ")),
    st.lists(LABEL, min_size=2, max_size=8, unique=True),
)
SHORT_TICKETS = (
    "My invoice was charged twice this month.",
    "The app crashes on start since the update.",
    "I cannot log in to my account",
    "team10 please, not team1",
    "Emoji only 🙏🔥",
    "?",
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    labels=LABEL_SET,
    texts=st.lists(st.sampled_from(SHORT_TICKETS), min_size=1, max_size=4),
)
def test_any_label_set_matches_reference(tiny_engine, labels, texts):
    engine = engine_with(tiny_engine, labels)
    predictions, _ = engine.classify(texts)
    assert_matches_reference(predictions, [engine.reference(t) for t in texts])
    for prediction in predictions:
        assert_well_formed(prediction, engine.labels)
