"""`ticketq eval`: the figures, checked by hand on fixed answers and against the reference path on a real model."""

from __future__ import annotations

import json
import re

import pytest
from commands import run

from ticketq.schema import Schema, load_schema
from ticketq_bench.procs import ROOT
from ticketq_cli.evaluate import Scores, SetScores, parse_expected

LABELS = ("billing", "technical", "account")
# The fixture's kernels (float32, torch's GEMM, one thread): the in-process answers below run the same ones.
TINY_ENV = {"TICKETQ_DTYPE": "float32", "TICKETQ_DEVICE": "cpu", "TICKETQ_MATMUL": "torch", "TICKETQ_THREADS": "1"}


def test_scores_by_hand():
    scores = Scores(LABELS)
    for expected, predicted, margin in [
        ("billing", "billing", 0.9), ("billing", "account", 0.1), ("technical", "technical", 0.5),
        ("technical", "billing", 0.3), ("account", "account", 0.7), ("refunds", "billing", 0.8),
    ]:  # fmt: skip
        scores.add(expected, predicted, margin)
    assert scores.scored == 5 and scores.unknown == {"refunds": 1}  # a label the model lacks is not scored
    assert scores.accuracy == pytest.approx(3 / 5)
    table = scores.per_label()
    assert table["billing"] == pytest.approx({"precision": 1 / 2, "recall": 1 / 2, "f1": 1 / 2, "support": 2})
    assert table["account"] == pytest.approx({"precision": 1 / 2, "recall": 1.0, "f1": 2 / 3, "support": 1})
    coverage = {row["threshold"]: (row["coverage"], row["accuracy"]) for row in scores.coverage((0.0, 0.3, 0.6, 0.95))}
    assert coverage[0.0] == pytest.approx((1.0, 3 / 5))
    assert coverage[0.3] == pytest.approx((4 / 5, 3 / 4))  # a margin equal to the threshold is answered
    assert coverage[0.6] == pytest.approx((2 / 5, 1.0))
    assert coverage[0.95] == (0.0, 0.0)
    assert scores.as_dict()["confusion"]["technical"] == {"billing": 1, "technical": 1, "account": 0}


def test_eval_on_a_file_matches_the_reference_answers(tmp_path, tiny_model_dir, tiny_engine):
    texts = ["I was charged twice this month", "the app crashes on start", "reset my password please",
             "refund my last invoice " * 8, "export to CSV times out", "delete my account"]  # fmt: skip
    expected = ["billing", "technical", "account", "billing", "technical", "account"]
    rows = [{"id": f"L-{n}", "text": text, "expected": label}
            for n, (text, label) in enumerate(zip(texts, expected, strict=True))]  # fmt: skip
    rows.append({"id": "no-label", "text": "hello"})  # counted, not scored
    rows.append({"id": "empty", "text": " ", "expected": "billing"})  # refused: empty text
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "eval.json"

    # The fixture's kernels (float32, torch's GEMM, one thread): the reference below runs the same ones.
    env = {"TICKETQ_MODEL": str(tiny_model_dir), "TICKETQ_DTYPE": "float32", "TICKETQ_DEVICE": "cpu",
           "TICKETQ_MATMUL": "torch", "TICKETQ_THREADS": "1"}  # fmt: skip
    result = run(["ticketq", "eval", str(path), "--json", str(out), "--no-progress", "--thresholds", "0,0.05"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())

    reference = [tiny_engine.reference(text) for text in texts]
    correct = [p.label == label for p, label in zip(reference, expected, strict=True)]
    assert (figures["scored"], figures["rows"], figures["unlabelled"], figures["refused"]) == (6, 8, 1, 1)
    assert figures["accuracy"] == pytest.approx(sum(correct) / 6)
    for label in LABELS:
        predicted = sum(p.label == label for p in reference)
        assert sum(figures["confusion"][e][label] for e in LABELS) == predicted
    above = [ok for p, ok in zip(reference, correct, strict=True) if p.margin >= 0.05]
    assert figures["coverage"][1]["coverage"] == pytest.approx(len(above) / 6)
    assert figures["coverage"][1]["accuracy"] == pytest.approx(sum(above) / len(above) if above else 0.0)
    assert figures["standin"] is True and "these figures mean nothing" in result.stderr
    assert "scored 6 of 8 rows" in result.stdout


def test_eval_refuses_bad_thresholds(tmp_path):
    path = tmp_path / "labelled.jsonl"
    path.write_text('{"text": "hi", "expected": "billing"}\n', encoding="utf-8")
    result = run(["ticketq", "eval", str(path), "--thresholds", "0.5,2"], {"TICKETQ_MODEL": str(tmp_path)})
    assert result.returncode == 2 and "--thresholds" in result.stderr, result.stderr


def test_set_scores_by_hand():
    scores = SetScores(("refund", "outage", "password"))
    for expected, predicted, confidence in [
        (("refund",), ("refund",), 0.8), (("refund", "outage"), ("outage",), 0.4), ((), ("password",), 0.1),
        (("password",), ("password",), 0.6),
    ]:  # fmt: skip
        scores.add(expected, predicted, confidence)
    assert scores.scored == 4 and scores.accuracy == pytest.approx(2 / 4)  # exact sets: rows 1 and 4
    table = scores.per_label()
    assert table["refund"] == pytest.approx({"precision": 1.0, "recall": 1 / 2, "f1": 2 / 3, "support": 2})
    assert table["password"] == pytest.approx({"precision": 1 / 2, "recall": 1.0, "f1": 2 / 3, "support": 1})
    assert table["outage"]["precision"] == 1.0 and table["outage"]["recall"] == 1.0
    coverage = {row["threshold"]: (row["coverage"], row["accuracy"]) for row in scores.coverage((0.0, 0.5, 0.9))}
    assert coverage == {0.0: (1.0, 0.5), 0.5: (0.5, 1.0), 0.9: (0.0, 0.0)}


def test_parse_expected_names_what_is_wrong():
    schema = load_schema(ROOT / "examples" / "schema-topics.toml")
    # a multi-label field's labels come back in the schema's order
    assert parse_expected(schema, {"team": "billing", "topics": ["invoice", "refund"]}) == {
        "team": "billing", "topics": ("refund", "invoice")}  # fmt: skip
    assert parse_expected(schema, '{"topics": []}') == {"topics": ()}  # a CSV cell; no topic is an answer too
    assert parse_expected(schema, {"topics": "outage"}) == {"topics": ("outage",)}
    for expected, problem in [
        ({"tema": "billing"}, "unknown field 'tema' (fields of support-topics: team, topics)"),
        ({"team": "refunds"}, "'expected' team: unknown label 'refunds' (labels: billing, technical, account)"),
        ({"topics": ["refund", "spam"]}, "'expected' topics: unknown label 'spam'"),
        ({"team": ["billing", "account"]}, "'expected' team: takes one label"),
        ("billing", "'billing' names no field"),
        ('{"team": billing}', "'expected' is not a JSON object"),
    ]:
        with pytest.raises(ValueError, match=re.escape(problem)):
            parse_expected(schema, expected)
    one = load_schema(ROOT / "examples" / "schema.toml")
    only = Schema("one", (one.field("category"),), layout="system")
    assert parse_expected(only, "account") == {"category": "account"}  # one field: its label alone


def test_eval_schema_counts_match_the_fields_engine(tmp_path, tiny_model_dir, tiny_engine):
    """A crafted file: expectations built from the FieldsEngine's own answers, so every count is known."""
    schema = load_schema(ROOT / "examples" / "schema-topics.toml")
    texts = ["I was charged twice this month", "the app crashes on start", "reset my password please",
             "refund my last invoice " * 8, "the site is down again", "delete my account"]  # fmt: skip
    answers, _ = tiny_engine.fields(schema).classify(texts)
    team = schema.field("team")
    wrong = {label: next(other for other in team.labels if other != label) for label in team.labels}
    rows, expected_team, expected_topics = [], [], []
    for n, (text, answer) in enumerate(zip(texts, answers, strict=True)):
        got_team, got_topics = answer.fields["team"].label, set(answer.fields["topics"].labels)
        want_team = got_team if n < 4 else wrong[got_team]  # rows 4 and 5: the team is wrong
        want_topics = got_topics if n % 2 == 0 else got_topics ^ {"outage"}  # rows 1, 3, 5: one topic off
        expected_team.append(want_team)
        expected_topics.append(want_topics)
        rows.append({"id": f"L-{n}", "text": text, "expected": {"team": want_team, "topics": sorted(want_topics)}})
    rows.append({"id": "team-only", "text": texts[0], "expected": {"team": answers[0].fields["team"].label}})
    rows.append({"id": "no-label", "text": "hello"})
    rows.append({"id": "typo", "text": "hello", "expected": {"taem": "billing"}})
    rows.append({"id": "odd-label", "text": "hello", "expected": {"topics": ["spam"]}})
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "eval.json"

    result = run(["ticketq", "eval", str(path), "--schema", str(ROOT / "examples" / "schema-topics.toml"),
                  "--json", str(out), "--no-progress", "--thresholds", "0,0.05"], TINY_ENV | {
                  "TICKETQ_MODEL": str(tiny_model_dir)})  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    assert (figures["rows"], figures["unlabelled"], figures["refused"], figures["scored"]) == (10, 1, 2, 7)
    assert f"{path}:9: invalid_expected: 'expected' names unknown field 'taem'" in result.stderr
    assert f"{path}:10: invalid_expected: 'expected' topics: unknown label 'spam'" in result.stderr

    single = figures["fields"]["team"]
    assert single["kind"] == "single" and single["scored"] == 7 and single["missing"] == 0
    assert single["accuracy"] == pytest.approx(5 / 7)  # rows 0-3 and team-only right, 4 and 5 wrong
    predicted = [a.fields["team"].label for a in answers] + [answers[0].fields["team"].label]
    wanted = [*expected_team, answers[0].fields["team"].label]
    for label in team.labels:
        assert sum(single["confusion"][e][label] for e in team.labels) == predicted.count(label)
        assert single["per_label"][label]["support"] == wanted.count(label)
    assert [row["threshold"] for row in single["coverage"]] == [0.0, 0.05, team.threshold]  # the schema's own too
    confident = [(a.fields["team"].confidence >= 0.05, ok) for a, ok in
                 zip([*answers, answers[0]], [True] * 4 + [False] * 2 + [True], strict=True)]  # fmt: skip
    assert single["coverage"][1]["answered"] == sum(c for c, _ in confident)

    multi = figures["fields"]["topics"]
    assert multi["kind"] == "multi" and multi["scored"] == 6 and multi["missing"] == 1  # team-only left it out
    assert multi["accuracy"] == pytest.approx(3 / 6)  # rows 0, 2, 4 exact
    for label in schema.field("topics").labels:
        chosen = sum(label in a.fields["topics"].labels for a in answers)
        hits = sum(label in a.fields["topics"].labels and label in want
                   for a, want in zip(answers, expected_topics, strict=True))  # fmt: skip
        support = sum(label in want for want in expected_topics)
        assert multi["per_label"][label]["support"] == support
        assert multi["per_label"][label]["precision"] == pytest.approx(hits / chosen if chosen else 0.0)
        assert multi["per_label"][label]["recall"] == pytest.approx(hits / support if support else 0.0)
    assert figures["standin"] is True and "these figures mean nothing" in result.stderr
    assert "team (single-label): 7 rows scored" in result.stdout
    assert "topics (multi-label): 6 rows scored, 1 row without it; exact-set accuracy 50.0%" in result.stdout


def test_eval_schema_refusals_before_the_model(tmp_path):
    path = tmp_path / "labelled.jsonl"
    path.write_text('{"text": "hi", "expected": {"category": "billing"}}\n', encoding="utf-8")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n', encoding="utf-8")
    result = run(["ticketq", "eval", str(path), "--schema", str(bad)], {"TICKETQ_MODEL": str(tmp_path)})
    assert result.returncode == 2 and "fields" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_eval_without_schema_refuses_an_object_and_says_why(tmp_path, tiny_model_dir):
    path = tmp_path / "labelled.jsonl"
    path.write_text('{"id": "a", "text": "refund please", "expected": "billing"}\n'
                    '{"id": "b", "text": "the app crashes", "expected": {"category": "technical"}}\n',
                    encoding="utf-8")  # fmt: skip
    result = run(["ticketq", "eval", str(path), "--no-progress"], TINY_ENV | {"TICKETQ_MODEL": str(tiny_model_dir)})
    assert result.returncode == 0, result.stderr
    assert f"{path}:2: invalid_expected: an object of fields; score it with --schema" in result.stderr
    assert "scored 1 of 2 rows" in result.stdout


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_eval_of_an_empty_file_is_one_line_before_the_model(tmp_path, content):
    path = tmp_path / "labelled.jsonl"
    path.write_text(content, encoding="utf-8")
    # No model at all: the refusal must come before the model is looked at, let alone loaded.
    result = run(["ticketq", "eval", str(path)], {"TICKETQ_MODEL": str(tmp_path / "no-model-here")})
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {path}: no rows to score (the file is empty); each row "
                                                  "needs a text and an expected label"]  # fmt: skip
    assert result.stdout == ""
