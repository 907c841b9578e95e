"""Ticket files in, result files out (pure unit tests: no torch, no Redis).

Every input row must end as exactly one ticket or one error, a broken CSV quote must never merge
rows, a file is read as it is iterated (never held whole), and a results file must never destroy
a user's file; a partial results file keeps whole rows only and resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from producer import csvrows
from producer.resultfile import OutputError, PartialResults, check_output, write_results
from producer.ticketfile import TicketReader, read_tickets
from producer.ticketrows import RowError, TicketFileError, TicketRow


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


# --- reading as the file is iterated ---


def mixed_jsonl(path, n: int = 40):
    lines = [json.dumps({"id": f"T-{i}", "text": f"ticket {i}"}) for i in range(1, n + 1)]
    lines[5] = "{broken"
    lines[9] = json.dumps({"id": "T-1", "text": "a duplicate"})
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_the_reader_yields_every_row_in_file_order_as_it_reads(tmp_path):
    path = mixed_jsonl(tmp_path / "t.jsonl")
    with TicketReader(path) as reader:
        rows = iter(reader)
        first = next(rows)
        assert isinstance(first, TicketRow) and first.source == f"{path}:1"
        assert reader.bytes_read < reader.size == path.stat().st_size  # not read whole for the first row
        rest = [first, *rows]
        assert reader.bytes_read == reader.size
    assert [row.line for row in rest] == list(range(1, 41))
    assert [(row.line, row.reason) for row in rest if isinstance(row, RowError)] == [
        (6, "invalid_json"), (10, "duplicate_id")
    ]  # fmt: skip
    whole = read_tickets(path)  # built on the reader: the same rows
    assert whole.tickets == [row.ticket for row in rest if isinstance(row, TicketRow)]
    assert whole.errors == [row for row in rest if isinstance(row, RowError)]


def test_a_csv_is_refused_whole_when_opened_before_any_row(tmp_path):
    path = tmp_path / "t.csv"
    path.write_bytes(b"id,text\n" + b"".join(b"T-%d,fine\n" % i for i in range(1, 5000)) + b"T-5000,caf\xe9\n")
    with pytest.raises(TicketFileError, match=r"t\.csv:5001: CSV file is not valid UTF-8"):
        TicketReader(path)



def _gzip(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


NOT_TEXT = {  # (file name, its bytes, what the one line must say)
    "gzip": ("t.jsonl.gz", _gzip(b'{"text": "hi"}\n' * 50), r"t\.jsonl\.gz: a gzip-compressed file; .*gunzip -k "),
    "gzip-named-jsonl": ("t.jsonl", _gzip(b'{"text": "hi"}\n'), r"gzip-compressed.*gunzip -k "),
    "binary": ("t.jsonl", bytes(range(256)) * 40, r"t\.jsonl: not a text file \(a NUL byte at byte 0\)"),
    "binary-csv": ("t.csv", b"id,text\n1,a\x00b\n", r"not a text file \(a NUL byte at byte 11\)"),
    "utf-16": ("t.csv", "id,text\n1,hi\n".encode("utf-16"), r"UTF-16 text.*iconv -f UTF-16 -t UTF-8"),
    "json-array": ("t.json", b'[\n  {"id": "a", "text": "hi"},\n  {"id": "b", "text": "yo"}\n]\n',
                   r"t\.json: a JSON array; ticket files are JSONL, one object a line: .*jq -c '\.\[\]'"),
    "json-array-forced": ("t.txt", b' [{"text": "hi"},\n {"text": "yo"}]', r"a JSON array"),
    "json-array-pretty": ("t.jsonl", b'[\n  {"text": "hi"}\n]\n', r"t\.jsonl: a JSON array"),
}


@pytest.mark.parametrize("case", NOT_TEXT.values(), ids=NOT_TEXT.keys())
def test_a_file_that_is_no_ticket_text_is_refused_in_one_line_naming_the_fix(tmp_path, case):
    name, content, message = case
    path = tmp_path / name
    path.write_bytes(content)
    fmt = "jsonl" if name == "t.txt" else "auto"
    with pytest.raises(TicketFileError, match=message) as refused:
        TicketReader(path, fmt)
    assert "\n" not in str(refused.value)


def test_a_latin1_jsonl_row_is_still_one_failed_row_not_a_refused_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    parsed = read_tickets(path)
    assert [(error.line, error.reason) for error in parsed.errors] == [(2, "invalid_utf8")]
    assert len(parsed.tickets) == 1


@pytest.mark.parametrize(
    ("name", "content"),
    [("e.jsonl", b""), ("e.csv", b""), ("e.csv", b"\n\r\n  \n"), ("e.csv", b"\xef\xbb\xbfid,text\n"), ("e", b"")],
    ids=["jsonl", "csv-zero-bytes", "csv-blank-lines", "csv-header-only", "sniffed"],
)
def test_an_empty_file_has_no_rows_in_either_format(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    assert read_tickets(path).rows == 0


def test_a_pipe_is_read_too(tmp_path):
    fifo = tmp_path / "tickets"
    os.mkfifo(fifo)
    writer = threading.Thread(target=fifo.write_bytes, args=(b"text\nsniffed as CSV from a pipe\n",))
    writer.start()
    try:
        assert read_tickets(fifo).tickets == [{"id": "line-2", "text": "sniffed as CSV from a pipe"}]
    finally:
        writer.join()


def test_a_broken_quote_holds_at_most_the_look_back_limit(tmp_path, monkeypatch):
    """The lines a broken record swallowed are read again from a bounded buffer, not the whole file."""
    monkeypatch.setattr(csvrows, "look_back", lambda max_bytes: 1000)
    rows = csv_rows(200)
    rows[1] = 'T-1,"a quote that is never closed, and ""escaped"" quotes after'
    path = tmp_path / "t.csv"
    write_csv(path, rows)
    parsed = read_tickets(path)
    assert [(error.line, error.reason) for error in parsed.errors] == [(2, "malformed_csv")]
    assert "a record longer than 1,000 characters" in parsed.errors[0].message
    assert [ticket["id"] for ticket in parsed.tickets] == [f"T-{i}" for i in range(2, 201)]
    assert parsed.lines["T-2"] == 3


# --- partial results: whole rows only, resumed where they stopped ---


def result(source, line: int) -> dict:
    return {"id": f"T-{line}", "status": "ok", "label": "billing", "source": f"{source}:{line}"}


def test_partial_results_are_published_whole_and_never_over_an_existing_file(tmp_path):
    source = mixed_jsonl(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    partial = PartialResults(out, source)
    partial.append([result(source, 1), result(source, 2)])
    assert partial.path == tmp_path / "r.jsonl.partial"
    assert len(partial.path.read_text().splitlines()) == 2  # on disk as soon as appended
    out.write_text("appeared meanwhile\n")
    with pytest.raises(OutputError, match="already exists"):
        partial.publish(overwrite=False)
    assert out.read_text() == "appeared meanwhile\n" and partial.path.exists()
    resumed = PartialResults(out, source, resume=True)
    resumed.publish(overwrite=True)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["T-1", "T-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.jsonl", "t.jsonl"]


def test_a_stopped_run_keeps_whole_rows_and_resumes_after_them(tmp_path):
    source = mixed_jsonl(tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    partial = PartialResults(out, source)
    partial.append([result(source, line) for line in (1, 2, 3)])
    os.write(partial._fd, b'{"id": "T-4", "sta')  # stopped in the middle of a write
    partial.close()
    assert partial.path.read_bytes().endswith(b'3"}\n')
    with partial.path.open("ab") as killed:  # a kill -9 in the middle of a write: nobody cut it
        killed.write(b'{"id": "T-4", "sta')
    with pytest.raises(OutputError, match="--resume to continue it, or --force"):
        PartialResults(out, source)
    seen = []
    resumed = PartialResults(out, source, resume=True, on_row=seen.append)
    assert resumed.rows == 3 and [row["id"] for row in seen] == ["T-1", "T-2", "T-3"]
    with TicketReader(source) as reader:
        assert [row.line for row in resumed.remaining(reader)] == list(range(4, 41))
    resumed.close()
    assert len(partial.path.read_text().splitlines()) == 3  # the cut row is gone
    PartialResults(out, source, force=True).close()  # --force starts again
    assert partial.path.read_bytes() == b""


def test_resume_refuses_a_partial_file_of_another_input_or_a_changed_one(tmp_path):
    source = mixed_jsonl(tmp_path / "t.jsonl")
    other = mixed_jsonl(tmp_path / "other.jsonl")
    out = tmp_path / "r.jsonl"
    partial = PartialResults(out, source)
    partial.append([result(source, 1), result(source, 2)])
    partial.close()
    with pytest.raises(OutputError, match=r"holds the results of .*/t\.jsonl, not of .*/other\.jsonl"):
        PartialResults(out, other, resume=True)
    source.write_text(json.dumps({"id": "T-9", "text": "changed"}) + "\n" + source.read_text())
    resumed = PartialResults(out, source, resume=True)
    with TicketReader(source) as reader, pytest.raises(OutputError, match="does not match"):
        list(resumed.remaining(reader))
    with pytest.raises(OutputError, match="is the input file"):
        PartialResults(tmp_path / "t", tmp_path / "t.partial")
