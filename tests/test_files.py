"""Ticket files in, result files out (pure unit tests: no torch, no Redis).

Every input row must end as exactly one ticket or one error, a broken CSV quote must never merge
rows, and a results file must never destroy a user's file.
"""

from __future__ import annotations

import json
import os

import pytest

from producer.tickets import OutputError, check_output, read_tickets, write_results


def csv_rows(n: int) -> list[str]:
    return ["id,text"] + [f"T-{i},ticket number {i} about my invoice" for i in range(1, n + 1)]


def write_csv(path, rows: list[str]) -> None:
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def test_unterminated_quote_from_the_issue_is_one_error_not_a_merged_ticket(tmp_path):
    path = tmp_path / "q.csv"
    path.write_bytes(b'id,text\nE-1,"unterminated quote\nE-2,fine\n')
    parsed = read_tickets(path)
    assert parsed.tickets == [{"id": "E-2", "text": "fine"}]
    assert [(error.line, error.reason) for error in parsed.errors] == [(2, "malformed_csv")]
    assert "unterminated quote" in parsed.errors[0].message


@pytest.mark.parametrize("later_quote", [False, True], ids=["quote-never-closed", "closed-by-a-later-row"])
def test_unterminated_quote_in_the_middle_of_100_rows(tmp_path, later_quote):
    rows = csv_rows(100)
    rows[50] = 'T-50,"unterminated quote here'
    if later_quote:  # a later quoted field "closes" the broken one: still no merge
        rows[70] = 'T-70,"quoted, with a comma"'
    path = tmp_path / "tickets.csv"
    write_csv(path, rows)
    parsed = read_tickets(path)
    assert parsed.rows == 100
    assert len(parsed.tickets) == 99
    assert [error.line for error in parsed.errors] == [51]
    assert {ticket["id"] for ticket in parsed.tickets} == {f"T-{i}" for i in range(1, 101)} - {"T-50"}
    assert all("\n" not in ticket["text"] for ticket in parsed.tickets)
    assert parsed.lines["T-51"] == 52


def test_a_legitimate_multiline_field_is_still_one_ticket(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('id,text\n1,"first line\nsecond, line"\n2,next\n', encoding="utf-8")
    parsed = read_tickets(path)
    assert parsed.tickets == [{"id": "1", "text": "first line\nsecond, line"}, {"id": "2", "text": "next"}]
    assert parsed.lines == {"1": 2, "2": 4}
    assert not parsed.errors


def test_results_in_order_has_one_row_per_input_row_with_its_source(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "text": "hello"}\n{broken\n\n{"id": "b", "text": "  "}\n{"id": "c", "text": "x"}\n')
    parsed = read_tickets(path)
    rows = parsed.results_in_order([{"id": "c", "status": "ok", "label": "billing"},
                                    {"id": "a", "status": "failed", "error": "empty_text: too short"}])  # fmt: skip
    assert [(row["id"], row["status"], row["reason"] if row["status"] != "ok" else "") for row in rows] == [
        ("a", "failed", "empty_text"),
        ("line-2", "failed", "invalid_json"),
        ("b", "failed", "empty_text"),
        ("c", "ok", ""),
    ]
    assert [row["source"] for row in rows] == [f"{path}:{line}" for line in (1, 2, 4, 5)]


def test_a_ticket_without_a_result_still_gets_a_row(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "a", "text": "hello"}\n')
    assert read_tickets(path).results_in_order([]) == [
        {"id": "a", "status": "failed", "reason": "no_result", "error": "no result for this ticket",
         "source": f"{path}:1"}
    ]  # fmt: skip


def test_check_output_refuses_the_input_an_existing_file_and_a_missing_directory(tmp_path, monkeypatch):
    tickets = tmp_path / "t.jsonl"
    tickets.write_text("{}\n")
    monkeypatch.chdir(tmp_path)  # the same file by a relative path must be caught too
    with pytest.raises(OutputError, match="is the input file"):
        check_output("t.jsonl", [tickets], force=True)
    os.link(tickets, tmp_path / "hard.jsonl")
    with pytest.raises(OutputError, match="is the input file"):
        check_output(tmp_path / "hard.jsonl", [tickets], force=True)
    existing = tmp_path / "results.jsonl"
    existing.write_text("keep me\n")
    with pytest.raises(OutputError, match="already exists; pass --force"):
        check_output(existing, [tickets])
    assert check_output(existing, [tickets], force=True) == existing
    with pytest.raises(OutputError, match="does not exist"):
        check_output(tmp_path / "no" / "r.jsonl", [tickets])
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path, [tickets])


def test_write_results_never_clobbers_without_overwrite_and_leaves_no_temp_file(tmp_path):
    out = tmp_path / "r.jsonl"
    assert write_results(out, [{"id": "a"}], overwrite=False) == 1
    with pytest.raises(OutputError, match="already exists"):
        write_results(out, [{"id": "b"}], overwrite=False)
    assert json.loads(out.read_text()) == {"id": "a"}
    write_results(out, [{"id": "b"}, {"id": "c"}])
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["b", "c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
    assert out.stat().st_mode & 0o044, "results must be readable like any file the user creates"


def test_a_crash_while_writing_keeps_the_old_file_whole(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"id": "old"}\n')

    def rows():
        yield {"id": "new"}
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        write_results(out, rows())
    assert out.read_text() == '{"id": "old"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl"]
