"""`ticketq bench`'s schema modes: several fields per ticket, several schemas per worker (tiny stand-in, float32).

No speed assertions: machines are noisy. What must hold anywhere: every schema mode equals its own
per-field reference (|Δp| < 1e-4), each baseline runs with the modes that need it, the report has
every row, ratio and agreement, and a worker serving three schemas computes three prefixes, not
one per batch.
"""

from __future__ import annotations

import json
import os

import pytest
import typer

from ticketq.schema import Field, FieldResult, TicketFields
from ticketq_bench import multifield
from ticketq_bench.cli import DEFAULT_SCHEMA, main, parse_args
from ticketq_bench.figures import strict_failure, summarise
from ticketq_bench.header import schema_lines
from ticketq_bench.procs import ROOT
from ticketq_bench.records import Answer, ModeResult
from worker.results import BatchReport

PROB_TOL = 1e-4
SCHEMA_MODES = ["one-field", "fields", "full-prompts", "one-schema", "schemas"]
A = Answer("category=billing priority=low", {"category=billing": 0.7, "category=account": 0.3})


@pytest.fixture
def clean_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TICKETQ_") and not k.startswith("TICKETQ_TEST_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def bench_argv(model, out, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--dtype", "float32", "--device", "cpu", "--threads", "1", "--tickets", "8",
        "--seed", "5", "--warmup", "1", "--no-autotune", "--rounds", "2", "--reference-tickets", "3",
        "--json", str(out / "bench.json"), "--markdown", str(out / "bench.md"), *extra,
    ]  # fmt: skip


def test_every_schema_mode_runs_with_its_baseline_and_matches_its_reference(tiny_model_dir, tmp_path, clean_env):
    modes = "fields,full-prompts,schemas"  # one-field and one-schema join as the baselines
    argv = bench_argv(tiny_model_dir, tmp_path, "--schema", str(DEFAULT_SCHEMA), "--modes", modes, "--strict")
    assert main(argv) == 0  # --strict: no real disagreement, no prefix computed twice
    header, *rows = json.loads((tmp_path / "bench.json").read_text())
    by_mode = {row["mode"]: row for row in rows}
    assert list(by_mode) == SCHEMA_MODES  # no sequential: no single-field mode was asked for
    assert header["schema"]["name"] == "support" and header["reference_tickets"] == 3
    assert [f["name"] for f in header["schema"]["fields"]] == ["category", "priority", "sentiment"]
    for mode, row in by_mode.items():
        assert row["status"] == "ok" and row["tickets"] == 8 and len(row["rounds"]) == 2, row
        assert row["round_label_changes"] == 0, mode
        check = row["reference_check"]
        fields = 1 if mode == "one-field" else 3
        assert (check["tickets"], check["answers"]) == (3, 3 * fields), mode
        assert check["labels_equal"] == check["answers"] and row["agreement"] == 1.0, mode
        assert row["max_abs_prob_diff"] < PROB_TOL, mode
    for mode, baseline in [("one-field", "one-field"), ("fields", "one-field"), ("full-prompts", "one-field"),
                           ("one-schema", "one-schema"), ("schemas", "one-schema")]:  # fmt: skip
        row = by_mode[mode]
        assert row["baseline"] == baseline and row["speedup"] > 0, mode
        assert row["cost_ratio"] == pytest.approx(1 / row["speedup"]) and len(row["cost_ratio_per_round"]) == 2
    assert by_mode["one-field"]["speedup"] == pytest.approx(1.0)
    assert by_mode["full-prompts"]["forwards"] >= 3 * by_mode["one-field"]["forwards"] / 2  # three passes
    assert by_mode["full-prompts"]["passes"] == ["support.category", "support.priority", "support.sentiment"]
    # every prefix computed once, before the rounds: as many as schemas, after every batch of both rounds
    assert (by_mode["one-schema"]["prefixes_computed"], by_mode["one-schema"]["schemas"]) == (1, 1)
    assert (by_mode["schemas"]["prefixes_computed"], by_mode["schemas"]["schemas"]) == (3, 3)
    assert by_mode["schemas"]["passes"] == ["support", "support-2", "support-3"]
    markdown = (tmp_path / "bench.md").read_text()
    for mode in SCHEMA_MODES:
        assert f"| `{mode}` |" in markdown
    for words in ("cost per ticket over one-field: fields ", "; full-prompts ", "3 schemas (support, support-2, "
                  "support-3) at once", "schemas: prefixes computed 3 for 3 schemas (once each)",
                  "fields against its per-field reference on 3 tickets: 9/9 answers equal"):  # fmt: skip
        assert words in markdown, words
    assert any("one-schema ran although not listed: it is the baseline of schemas" in n for n in header["notes"])


def test_the_three_field_modes_run_on_a_multi_label_schema(tiny_model_dir, tmp_path, clean_env):
    topics = ROOT / "examples" / "schema-topics.toml"
    modes = ["--modes", "one-field,fields,full-prompts"]
    assert main([*modes, *bench_argv(tiny_model_dir, tmp_path, "--schema", str(topics), "--rounds", "1")]) == 0
    header, *rows = json.loads((tmp_path / "bench.json").read_text())
    by_mode = {row["mode"]: row for row in rows}
    assert list(by_mode) == ["one-field", "fields", "full-prompts"] and header["schema"]["name"] == "support-topics"
    # a multi-label field alone: one yes/no question per label, in the fields layout
    assert by_mode["full-prompts"]["passes"] == ["support-topics.team", "support-topics.topics"]
    for mode, row in by_mode.items():
        assert row["status"] == "ok" and row["agreement"] == 1.0 and row["max_abs_prob_diff"] < PROB_TOL, mode


def test_a_tickets_answers_flatten_into_one_bench_answer():
    """Rounds compare any mode's `Answer`s: every field's labels and probabilities must be in it."""
    team, topics = Field("team", ("billing", "account")), Field("topics", ("refund", "outage"), multi=True)
    answers = [
        TicketFields("s.team", {"team": FieldResult.single(team, {"billing": 0.8, "account": 0.2})}, 5, 5, None),
        TicketFields("s.topics", {"topics": FieldResult.several(topics, {"refund": 0.9, "outage": 0.1})}, 5, 5, None),
    ]  # fmt: skip
    flat = multifield.flat_answer(answers)
    assert flat.label == "team=billing topics=refund"
    assert flat.probs == {"team=billing": 0.8, "team=account": 0.2, "topics=refund": 0.9, "topics=outage": 0.1}
    none = FieldResult.several(topics, {"refund": 0.2, "outage": 0.1})
    assert multifield.flat_answer([TicketFields("s", {"topics": none}, 5, 5, None)]).label == "topics=-"


def test_schema_options_pick_the_modes_and_baselines():
    assert parse_args(["--schema", "s.toml"]).mode_list == ["one-field", "fields", "full-prompts"]
    assert parse_args(["--modes", "fields"]).mode_list == ["one-field", "fields"]
    assert parse_args(["--modes", "fields"]).schema == DEFAULT_SCHEMA  # the example schema unless told
    assert parse_args(["--modes", "schemas,ticketq"]).mode_list == ["sequential", "ticketq", "one-schema", "schemas"]
    assert parse_args(["--modes", "fields"]).rounds == 3 and parse_args(["--modes", "one-field"]).rounds == 1
    assert parse_args([]).schema is None and not set(SCHEMA_MODES) & set(parse_args([]).mode_list)
    with pytest.raises(typer.BadParameter, match="--schema is for the modes"):
        parse_args(["--schema", "s.toml", "--modes", "ticketq"])
    assert main(["--schema", "s.toml", "--modes", "ticketq"]) == 2


def test_a_bad_schema_is_one_message_and_exit_2(tmp_path, clean_env, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n', encoding="utf-8")
    assert main(["--schema", str(bad), "--tickets", "2", "--model", str(tmp_path)]) == 2
    assert "needs at least one field" in capsys.readouterr().out


def mode(name: str, seconds: list[float], **figures) -> ModeResult:
    result = ModeResult(name, reports=[BatchReport(2, 10, 18, 0.1)], figures=figures)
    for round_seconds in seconds:
        result.add_round([A, A], round_seconds, None)
    return result


def test_cost_ratios_and_prefixes_in_the_rows_and_lines():
    one = mode("one-field", [1.0, 2.0, 1.0], schema="s", fields=["category", "priority"])
    fields = mode("fields", [1.5, 2.5, 1.5], schema="s", fields=["category", "priority"])
    single = mode("one-schema", [1.0, 1.0, 1.0], schemas=1, prefixes_computed=1, passes=["s"])
    several = mode("schemas", [1.25, 1.0, 1.25], schemas=3, prefixes_computed=3, passes=["s", "s-2", "s-3"])
    results = [one, fields, single, several]
    rows = [summarise(r, results, 0.01) for r in results]
    assert rows[1]["speedup"] == pytest.approx(2 / 3) and rows[1]["cost_ratio"] == pytest.approx(1.5)
    assert rows[1]["cost_ratio_per_round"] == pytest.approx([1.5, 1.25, 1.5])
    assert rows[3]["baseline"] == "one-schema" and rows[3]["cost_ratio"] == pytest.approx(1.25)
    assert rows[1]["agreement"] is None  # no reference check ran: nothing claimed
    lines = schema_lines(rows)
    assert "schema s (category, priority), cost per ticket over one-field: fields 1.50x (per round 1.50, 1.25, " \
           "1.50)" in lines
    assert any(line.startswith("3 schemas (s, s-2, s-3) at once, tickets round-robin: 1.60 items/s against 2.00 "
                               "serving one, 0.80x (cost 1.25x") for line in lines)  # fmt: skip
    assert not strict_failure(rows)
    recomputed = mode("schemas", [1.0], schemas=3, prefixes_computed=5, passes=["s", "s-2", "s-3"])
    row = summarise(recomputed, [single, recomputed], 0.01)
    assert strict_failure([row]) and "prefixes computed 5 for 3 schemas (RECOMPUTED)" in " ".join(schema_lines([row]))
