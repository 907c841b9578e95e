"""The peers in their own processes: a crash is a row, a killed bench keeps its outputs, OpenVINO matches the reference.

Real subprocesses and the tiny stand-in throughout. `TICKETQ_TEST_PEER_CRASH=MODE[@ROUND]` makes
a peer's process kill itself with SIGSEGV (at its start, or at the start of round ROUND), as a
native crash would; every other mode's row must still be there, and the run must end normally.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from producer.synthetic import generate_tickets
from ticketq_bench.cli import main
from ticketq_bench.peer_process import CRASH_ENV, describe_exit
from ticketq_bench.procs import ROOT
from worker.engine import Engine, EngineOptions
from worker.engine.prompt import system_text
from worker.settings import DEFAULT_SYSTEM_PROMPT

OPENVINO = importlib.util.find_spec("openvino") is not None
needs_openvino = pytest.mark.skipif(not OPENVINO, reason="openvino not installed (pip install 'ticketq[openvino]')")


@pytest.fixture
def clean_env(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TICKETQ_") and not k.startswith("TICKETQ_TEST_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def bench_argv(model, out, modes: str, tickets: int = 8, rounds: int = 2) -> list[str]:
    return [
        "--model", str(model), "--dtype", "float32", "--device", "cpu", "--threads", "2", "--tickets", str(tickets),
        "--seed", "2", "--modes", modes, "--warmup", "1", "--no-autotune", "--rounds", str(rounds),
        "--json", str(out / "bench.json"), "--markdown", str(out / "bench.md"),
    ]  # fmt: skip


def test_a_crashing_peer_leaves_every_other_row(tiny_model_dir, tmp_path, clean_env):
    # llama-cpp dies at its start (installed or not); openvino, where installed, in its second round
    clean_env.setenv(CRASH_ENV, "llama-cpp,openvino@2")
    modes = "sorted,ticketq,llama-cpp" + (",openvino" if OPENVINO else "")
    assert main(bench_argv(tiny_model_dir, tmp_path, modes)) == 0
    header, *rows = json.loads((tmp_path / "bench.json").read_text())
    by_mode = {row["mode"]: row for row in rows}
    assert list(by_mode) == ["sequential", "sorted", "ticketq", "llama-cpp", *(["openvino"] if OPENVINO else [])]
    assert header["finished"] and header["rounds"] == 2 and len(header["load_average"]["rounds"]) == 2
    for mode in ("sequential", "sorted", "ticketq"):
        row = by_mode[mode]
        assert row["status"] == "ok" and len(row["rounds"]) == 2 and row["agreement"] == 1.0, row
    crashed = by_mode["llama-cpp"]
    assert crashed["status"] == "crashed" and crashed["reason"] == "crashed: signal 11 (SIGSEGV)"
    assert crashed["items_per_s"] is None and crashed["rss_of"] == "peer process"
    markdown = (tmp_path / "bench.md").read_text()
    assert "| `llama-cpp` (crashed) | — |" in markdown and "- `llama-cpp`: crashed: signal 11 (SIGSEGV)" in markdown
    if OPENVINO:  # it finished round 1: its figures stay, with why round 2 is missing
        late = by_mode["openvino"]
        assert late["status"] == "crashed" and late["reason"] == "crashed: signal 11 (SIGSEGV)"
        assert len(late["rounds"]) == 1 and late["agreement"] == 1.0
        assert any("in round 2 (figures from the 1 round before)" in note for note in late["notes"])


def test_a_killed_bench_keeps_the_modes_that_finished(tiny_model_dir, tmp_path, clean_env):
    out = tmp_path
    command = [sys.executable, "-m", "ticketq_bench.cli", *bench_argv(tiny_model_dir, out, "ticketq", 6, 50)]
    bench = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        # the Markdown is written just after the JSON: both are there once it is
        while not (out / "bench.md").exists() and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(bench.pid, signal.SIGKILL)  # mid-run: 50 rounds of two modes take far longer than one mode
    finally:
        bench.wait(timeout=30)
    assert bench.returncode == -signal.SIGKILL
    header, *rows = json.loads((out / "bench.json").read_text())  # whole, never half-written
    assert header["finished"] is False and rows[0]["mode"] == "sequential" and rows[0]["status"] == "ok"
    assert "UNFINISHED" in (out / "bench.md").read_text()


def test_describe_exit():
    assert describe_exit(-signal.SIGSEGV) == "crashed: signal 11 (SIGSEGV)"
    assert describe_exit(-signal.SIGABRT) == "crashed: signal 6 (SIGABRT)"
    assert describe_exit(3) == "crashed: exit status 3"


def test_openvino_says_why_where_it_is_missing(monkeypatch):
    from ticketq_bench import peers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openvino" else real(name, *a))
    with pytest.raises(peers.PeerUnavailable, match=r"openvino is not installed \(pip install 'ticketq\[openvino\]'\)"):
        peers.openvino_version()


@needs_openvino
def test_openvino_modes_match_the_reference(tiny_model_dir, tmp_path, clean_env):
    modes = "ticketq,openvino,openvino-bf16" + (",openvino-int8" if importlib.util.find_spec("nncf") else "")
    assert main(bench_argv(tiny_model_dir, tmp_path, modes, tickets=12, rounds=1)) == 0
    header, *rows = json.loads((tmp_path / "bench.json").read_text())
    by_mode = {row["mode"]: row for row in rows}
    f32 = by_mode["openvino"]
    assert f32["status"] == "ok", f32["notes"]
    assert f32["agreement"] == 1.0 and f32["max_abs_prob_diff"] < 1e-4  # float32: another summation order only
    for inexact in [by_mode[m] for m in ("openvino-bf16", "openvino-int8") if m in by_mode]:
        assert inexact["status"] == "ok", inexact["notes"]
        assert inexact["agreement"] is not None and inexact["max_abs_prob_diff"] is not None  # shown, not hidden
    # the prefix cached: OpenVINO computes the tickets' tokens (ticket + suffix) and their padding, no prompt
    real = by_mode["ticketq"]["computed_tokens"] - by_mode["ticketq"]["pad_tokens"]
    assert f32["computed_tokens"] - f32["pad_tokens"] == real
    assert any("INFERENCE_PRECISION_HINT f32" in note for note in header["notes"])
    # asked for bf16; a CPU without fast bf16 runs f32, and the note says so ("bf16 asked, f32 run")
    assert any(note.startswith("openvino-bf16:") and "INFERENCE_PRECISION_HINT bf16" in note
               for note in header["notes"])  # fmt: skip


@needs_openvino
def test_openvino_scores_shared_label_prefixes_like_the_reference(tiny_engine, tiny_model_dir):
    """Labels sharing a first token: the continuation branch runs on each ticket followed by the shared tokens."""
    from ticketq_bench.peers import OpenVinoScorer, PeerPrompt, openvino_model

    labels = ("account", "account security", "billing")
    engine = Engine(tiny_engine.model, tiny_engine.tokenizer,
        EngineOptions(labels=labels, system=system_text(DEFAULT_SYSTEM_PROMPT, labels, {})))
    assert any(engine.prompt.trie.branches.keys() - {()})
    scorer = OpenVinoScorer(openvino_model(tiny_model_dir, ROOT / "out"), PeerPrompt.of(engine.prompt), 1, "f32", 4)
    texts = [t["text"] for t in generate_tickets(6, seed=6)] + ["x"]
    got, reports = scorer.score_many(engine.encode(texts))
    assert len(reports) == 2 * len(engine.prompt.trie.branches)  # two batches of at most 4, a forward per branch
    for text, prediction in zip(texts, got, strict=True):
        want = engine.reference(text)
        assert prediction.label == want.label
        assert max(abs(prediction.probs[k] - want.probs[k]) for k in want.probs) < 1e-4
