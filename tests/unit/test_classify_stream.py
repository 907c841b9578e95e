"""`ticketq classify` streams: real subprocesses on the tiny stand-in, as a user runs the command.

The results equal the whole-file path's (every ticket classified in one plan, rows put back in
order) for a file of good, bad and duplicate rows in both formats; the first result row is on disk
while the file is still being read; Ctrl-C keeps whole rows only and `--resume` finishes without
classifying a row twice; memory does not grow with the file. Every wait polls a condition under a
deadline.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from commands import engine_env, run, sigint_as_in_a_terminal

from producer.synthetic import generate_tickets
from producer.ticketfile import TicketReader, read_tickets
from ticketq.cli import summary_line
from ticketq.exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE

EXIT_INTERRUPTED = 130
PROB_TOL = 1e-4  # a ticket's probabilities in another batch (other padding, other rows), float32


def stream_env(model_dir: Path, **extra: str) -> dict[str, str]:
    """The engine settings of `tiny_settings`, so an in-process engine computes what the command does."""
    return {**engine_env(model_dir), "TICKETQ_MATMUL": "torch", **extra}


def start(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`ticketq classify ARGS` in the background, with the environment `run` gives it; SIGINT is Ctrl-C."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    clean.update({"PYTHONUNBUFFERED": "1", "COLUMNS": "80", **env})
    return subprocess.Popen([sys.executable, "-m", "ticketq_cli.cli", "classify", *args], env=clean, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_in_a_terminal)  # fmt: skip


def wait_for(condition, process: subprocess.Popen, timeout: float = 120.0, every: float = 0.02):
    """Poll `condition()` until it is truthy (its value is returned); fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        if process.poll() is not None:
            pytest.fail(f"the command ended (status {process.returncode}) first:\n{process.stderr.read()}")
        time.sleep(every)
    process.kill()
    pytest.fail(f"not within {timeout} s")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- the same rows as the whole-file path ---


def mixed_tickets() -> list[dict]:
    """300 synthetic tickets (long tail, multi-line texts), then rows every rule refuses."""
    tickets = [{"id": t["id"], "text": t["text"]} for t in generate_tickets(300, seed=11)]
    tickets[40] = {"id": tickets[3]["id"], "text": "a duplicate id"}
    tickets[80] = {"id": "blank", "text": "   "}
    tickets[120] = {"id": "huge", "text": "refund " * 10_000}  # 70 KB: oversize
    tickets[160] = {"id": None, "text": "no id: named line-N"}
    return tickets


def write_jsonl(path: Path, tickets: list[dict]) -> Path:
    lines = [json.dumps({k: v for k, v in t.items() if v is not None}) for t in tickets]
    lines[30:30] = ["{broken json", "", '["not", "an", "object"]']
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_csv(path: Path, tickets: list[dict]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["id", "text"])
        for number, ticket in enumerate(tickets):
            if number == 200:
                out.write('T-broken,"a quote that is never closed\n')
                out.write("T-short\n")  # one field of two
            writer.writerow([ticket["id"] or "", ticket["text"]])
    return path


def whole_file_results(engine, path: Path) -> list[dict]:
    """The path `ticketq classify` took before it streamed: the whole file read, one plan over all of it."""
    source = read_tickets(path)
    predictions, _ = engine.classify([ticket["text"] for ticket in source.tickets])
    results = [{"id": ticket["id"], "status": "ok", "label": p.label, "probs": p.probs, "margin": p.margin,
                "truncated": p.truncated, "model": engine.info.name, "standin": engine.info.standin,
                "precision": p.precision, "rechecked": p.rechecked, "scorer": p.scorer}
               for ticket, p in zip(source.tickets, predictions, strict=True)]  # fmt: skip
    return source.results_in_order(results)


def assert_same_rows(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for row, expected in zip(got, want, strict=True):
        exact = {k: v for k, v in row.items() if k not in ("probs", "margin")}
        assert exact == {k: v for k, v in expected.items() if k not in ("probs", "margin")}
        if row["status"] == "ok":
            assert row["probs"] == pytest.approx(expected["probs"], abs=PROB_TOL)
            assert row["margin"] == pytest.approx(expected["margin"], abs=PROB_TOL)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_streamed_results_equal_the_whole_file_path(tmp_path, tiny_model_dir, tiny_engine, fmt):
    writer = write_jsonl if fmt == "jsonl" else write_csv
    tickets = writer(tmp_path / f"tickets.{fmt}", mixed_tickets())
    done = run(["ticketq", "classify", str(tickets), "-o", "r.jsonl", "--no-progress"], stream_env(tiny_model_dir),
               cwd=tmp_path)  # fmt: skip
    assert done.returncode == EXIT_FAILED, done.stderr
    want = whole_file_results(tiny_engine, tickets)
    assert_same_rows(rows_of(tmp_path / "r.jsonl"), want)
    reasons = {row["reason"] for row in want if row["status"] != "ok"}
    assert {"duplicate_id", "empty_text", "oversize"} <= reasons
    assert ("invalid_json" if fmt == "jsonl" else "malformed_csv") in reasons
    assert f"{summary_line(want)[0]}; results in r.jsonl" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([tickets.name, "r.jsonl"])  # no partial left


def three_tickets() -> list[dict]:
    return [{"id": f"T-{i}", "text": f"my invoice number {i} is wrong"} for i in range(3)]


def test_progress_is_off_in_a_pipe_and_the_summary_is_on_stdout(tmp_path, tiny_model_dir):
    tickets = write_csv(tmp_path / "t.csv", three_tickets())
    done = run(["ticketq", "classify", str(tickets), "-o", "r.jsonl"], stream_env(tiny_model_dir), cwd=tmp_path)
    assert done.returncode == EXIT_OK, done.stderr
    # stderr is a pipe here: no frames, neither ours nor transformers' (text mode turns their \r into \n)
    assert "classifying" not in done.stderr and "Loading weights" not in done.stderr, done.stderr
    assert "stand-in model: labels are meaningless" in done.stderr  # the model did load
    assert "read 3 rows" in done.stdout and "read 3 rows" not in done.stderr
    assert "rows" in done.stdout and "items/s" in done.stdout  # the summary table


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_counts_rows_of_the_file(tmp_path, monkeypatch):
    from ticketq_cli.offline import _Progress

    tickets = write_csv(tmp_path / "t.csv", three_tickets())
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with TicketReader(tickets) as reader:
        rows = iter(reader)
        next(rows)  # a small CSV is read whole by now: a bar over bytes would be at 100%
        bar = _Progress(reader, True, 0)
        bar.chunk_done(1)
        assert (bar.bar.n, bar.bar.total) == (1, 3)
        bar.chunk_done(3)
        bar.close()
    assert "3/3" in terminal.getvalue() and "row/s" in terminal.getvalue() and "B/s" not in terminal.getvalue()


def test_no_progress_bar_where_stderr_is_no_terminal(tmp_path, monkeypatch):
    from ticketq_cli.offline import _Progress

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with TicketReader(write_jsonl(tmp_path / "t.jsonl", three_tickets())) as reader:
        bar = _Progress(reader, True, 0)
        bar.chunk_done(3)
        bar.close()
    assert sys.stderr.getvalue() == ""


# --- the first row early; Ctrl-C; --resume ---


def short_tickets(path: Path, n: int) -> Path:
    with path.open("w", encoding="utf-8") as out:
        for i in range(1, n + 1):
            out.write(json.dumps({"id": f"T-{i}", "text": f"ticket {i}: my invoice shows a charge I do not know"}))
            out.write("\n")
    return path


def whole_rows(path: Path) -> bytes:
    """The partial file's content once it holds at least one whole row, else b""."""
    data = path.read_bytes() if path.exists() else b""
    return data if b"\n" in data else b""


def test_first_row_comes_early_ctrl_c_keeps_whole_rows_and_resume_finishes(tmp_path, tiny_model_dir):
    n = 20_000
    tickets = short_tickets(tmp_path / "t.jsonl", n)
    partial = tmp_path / "r.jsonl.partial"
    env = stream_env(tiny_model_dir)
    process = start(["t.jsonl", "-o", "r.jsonl", "--no-progress"], env, tmp_path)
    early = wait_for(lambda: whole_rows(partial), process)
    assert process.poll() is None, "the first row must be on disk while the file is still being classified"
    assert early.count(b"\n") < n // 10
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == EXIT_INTERRUPTED, stderr
    lines = stderr.strip().splitlines()
    assert [line for line in lines if "--resume" in line] == [lines[-1]], stderr
    kept = int(re.fullmatch(r"interrupted: (\d+) rows are in (.+); run the same command with --resume to "
                            r"classify the rest", lines[-1])[1])  # fmt: skip
    data = partial.read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == kept > 0  # whole rows only
    assert [row["source"] for row in rows_of(partial)] == [f"{tickets.name}:{i}" for i in range(1, kept + 1)]
    assert not (tmp_path / "r.jsonl").exists()

    resumed = run(["ticketq", "classify", "t.jsonl", "-o", "r.jsonl", "--no-progress", "--resume"], env, cwd=tmp_path)
    assert resumed.returncode == EXIT_OK, resumed.stderr
    assert f"resuming: {kept} rows of {partial.name} kept" in resumed.stderr
    final = (tmp_path / "r.jsonl").read_bytes()
    assert final.startswith(data), "the rows done before Ctrl-C are kept as they were, not classified again"
    rows = rows_of(tmp_path / "r.jsonl")
    assert [row["source"] for row in rows] == [f"{tickets.name}:{i}" for i in range(1, n + 1)]
    assert len({row["id"] for row in rows}) == n and all(row["status"] == "ok" for row in rows)
    assert f"read {n} rows: {n} ok, 0 failed" in resumed.stdout
    assert not partial.exists()


def test_a_stopped_run_is_not_overwritten_by_a_new_one(tmp_path, tiny_model_dir):
    short_tickets(tmp_path / "t.jsonl", 3)
    (tmp_path / "r.jsonl.partial").write_text("")
    refused = run(["ticketq", "classify", "t.jsonl", "-o", "r.jsonl"], stream_env(tiny_model_dir), cwd=tmp_path)
    assert refused.returncode == EXIT_USAGE, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        "error: r.jsonl.partial holds the rows of a run that was stopped; pass --resume to continue it, or "
        "--force to start again"
    ]


# --- memory: one chunk, not the file ---


def test_memory_does_not_grow_with_the_file(tmp_path, tiny_model_dir):
    """Peak RSS once the chunks are full size, then while 35 MB more of the file go through.

    The rows are 2 KB (ticket text padded with spaces, cheap to tokenise) and the model reads 8
    tokens of each, so 24,000 rows take seconds: the whole-file path held every text (49 MB in
    all; its peak rose 121 MB from a 5 MB file to a 41 MB one of this shape). Streaming holds one
    chunk (at most 2,048 rows, 4 MB here) and the ids seen (about 4 MB for 18,000 more). The bound,
    a quarter of the bytes streamed after the first reading, leaves room for the allocator's
    noise on a busy 2-core machine (about 10 MB between runs of one file) and still fails for
    anything that keeps rows or texts.
    """
    n, settled_rows = 24_000, 6_144  # 1 + 2 + ... + 2,048 rows, then one more full chunk: 6,143
    tickets = tmp_path / "t.jsonl"
    with tickets.open("w", encoding="utf-8") as out:
        for i in range(1, n + 1):
            out.write(json.dumps({"id": f"T-{i}", "text": f"ticket {i} about my invoice" + " " * 2000}) + "\n")
    partial = tmp_path / "r.jsonl.partial"
    process = start(["t.jsonl", "-o", "r.jsonl", "--no-progress"], stream_env(tiny_model_dir,
                    TICKETQ_MAX_TICKET_TOKENS="8"), tmp_path)  # fmt: skip
    child = psutil.Process(process.pid)
    peak = 0

    def sample() -> None:
        nonlocal peak
        with contextlib.suppress(psutil.NoSuchProcess):  # it has just ended
            peak = max(peak, child.memory_info().rss)

    def settled() -> bool:
        sample()
        first = whole_rows(partial).split(b"\n", 1)[0]
        return bool(first) and partial.stat().st_size >= settled_rows * (len(first) + 1)

    wait_for(settled, process)
    before = peak
    while process.poll() is None:
        sample()
        time.sleep(0.02)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == EXIT_OK, stderr
    assert len(rows_of(tmp_path / "r.jsonl")) == n
    streamed = tickets.stat().st_size * (n - settled_rows) / n
    assert peak - before < streamed / 4, f"RSS grew {(peak - before) >> 20} MB while {streamed / 2**20:.0f} MB streamed"

