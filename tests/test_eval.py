"""`ticketq eval`: the figures, checked by hand on fixed answers and against the reference path on a real model."""

from __future__ import annotations

import json

import pytest
from test_cli import run

from worker.tools.evaluate import Scores

LABELS = ("billing", "technical", "account")


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


@pytest.mark.integration
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
