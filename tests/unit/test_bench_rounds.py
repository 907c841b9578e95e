"""`ticketq bench --rounds`: medians, ranges, speedup from the medians, answers compared across rounds (no torch)."""

from __future__ import annotations

import pytest

from ticketq_bench.cli import parse_args
from ticketq_bench.figures import strict_failure, summarise
from ticketq_bench.records import Answer, ModeResult
from ticketq_bench.report import markdown_table
from worker.results import BatchReport

A = Answer("billing", {"billing": 0.7, "technical": 0.2, "account": 0.1})
B = Answer("technical", {"billing": 0.2, "technical": 0.7, "account": 0.1})
LOADS = [(0.5, 0.4, 0.3), (1.5, 0.6, 0.3), (2.5, 0.9, 0.4)]


def mode(name: str, seconds: list[float], answers: list[list[Answer]]) -> ModeResult:
    result = ModeResult(name, reports=[BatchReport(2, 10, 18, 0.1)])
    for round_seconds, round_answers, load in zip(seconds, answers, LOADS, strict=False):
        result.add_round(round_answers, round_seconds, load)
    return result


def test_items_per_s_is_the_median_and_speedup_the_ratio_of_medians():
    reference = mode("sequential", [2.0, 1.0, 4.0], [[A, B]] * 3)  # 1.0, 2.0, 0.5 items/s: median 1.0
    fast = mode("ticketq", [0.5, 0.25, 2.0], [[A, B]] * 3)  # 4.0, 8.0, 1.0 items/s: median 4.0
    rows = [summarise(r, [reference, fast], 0.01) for r in (reference, fast)]
    assert rows[0]["items_per_s"] == 1.0 and (rows[0]["items_per_s_min"], rows[0]["items_per_s_max"]) == (0.5, 2.0)
    assert rows[1]["items_per_s"] == 4.0 and rows[1]["speedup"] == pytest.approx(4.0)
    assert rows[1]["seconds"] == 0.5 and rows[1]["tokens_per_s"] == pytest.approx(20 / 0.5)
    assert [r["load_average"] for r in rows[1]["rounds"]] == [list(load) for load in LOADS]
    assert rows[1]["round_label_changes"] == 0 and rows[1]["round_max_abs_prob_diff"] == 0.0
    assert not strict_failure(rows)


def test_an_answer_that_changes_between_rounds_is_counted_and_fails_strict():
    reference = mode("sequential", [1.0, 1.0], [[A, B], [A, B]])
    shaky = mode("ticketq", [1.0, 1.0, 1.0], [[A, B], [B, B], [B, A]])  # ticket 0 in round 2, ticket 1 in round 3
    row = summarise(shaky, [reference, shaky], 0.01)
    assert row["round_label_changes"] == 2 and row["round_max_abs_prob_diff"] == pytest.approx(0.5)
    assert row["agreement"] == 1.0  # against the reference: the first round's answers
    assert strict_failure([row])


def test_rows_before_the_reference_and_crashed_rows():
    early = mode("generate", [1.0], [[A, B]])
    assert summarise(early, [early], 0.01)["speedup"] is None  # written before the reference ran
    crashed = ModeResult("llama-cpp", crashed="crashed: signal 11 (SIGSEGV)")
    row = summarise(crashed, [early, crashed], 0.01)
    assert row["status"] == "crashed" and row["reason"] == "crashed: signal 11 (SIGSEGV)"
    assert row["items_per_s"] is None and row["rounds"] == []


def test_markdown_shows_the_range_the_reason_and_the_load_per_round():
    reference = mode("sequential", [2.0, 1.0, 4.0], [[A, B]] * 3)
    crashed = ModeResult("openvino", crashed="crashed: signal 6 (SIGABRT)")
    rows = [summarise(r, [reference, crashed], 0.01) for r in (reference, crashed)]
    header = {
        "tickets": 2, "ticket_source": "test", "dtype": "float32", "device": "cpu", "torch_threads": 2,
        "machine": {"cpu": "test CPU", "cores": 2}, "torch": "x", "transformers": "y", "date": "2000-01-01",
        "autotune": {"description": "fixed"}, "command": "ticketq bench", "rounds": 3, "finished": False,
        "load_average": {"start": LOADS[0], "end": LOADS[2], "rounds": LOADS},
    }  # fmt: skip
    text = markdown_table(header, rows)
    assert "| `sequential` | 1.00 | 0.50–2.00 | 1.00× |" in text
    assert "| `openvino` (crashed) | — |" in text and "- `openvino`: crashed: signal 6 (SIGABRT)" in text
    assert "load average (1 min) at each round's start 0.50, 1.50, 2.50" in text and "UNFINISHED" in text


def test_rounds_default_to_three_where_more_than_the_reference_runs():
    assert parse_args([]).rounds == 3
    assert parse_args(["--modes", "sequential"]).rounds == 1
    assert parse_args(["--quick"]).rounds == 1
    assert parse_args(["--quick", "--rounds", "2"]).rounds == 2
    assert parse_args(["--rounds", "5", "--modes", "ticketq"]).rounds == 5
