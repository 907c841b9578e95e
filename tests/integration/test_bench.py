"""`ticketq bench` end to end on the tiny stand-in (CPU, float32): every mode must give the reference's answers.

No speed assertions: machines are noisy. What must hold anywhere: agreement 1.0 and |Δprob| < 1e-4
in float32, padding ordered naive-global >= naive >= sorted >= ticketq, and the JSON and PNG written.
The queue mode joins in when Redis answers at 127.0.0.1:6379. The main run pins the planner's
configured cost model (--no-autotune): a fit from a few timings on a busy machine can be anything,
and the padding order must not depend on it; the ticket-file run exercises the autotune.
"""

from __future__ import annotations

import json
import os

import pytest
import redis
import typer

from producer.synthetic import generate_tickets
from ticketq_bench.baselines import GENERATE_NEW_TOKENS, full_prompt_batch, generate_text, parse_label
from ticketq_bench.cli import main, parse_args
from ticketq_bench.figures import compare
from ticketq_bench.procs import ROOT
from ticketq_bench.records import Answer
from worker.engine import Engine, EngineOptions, batching
from worker.engine.prompt import system_text
from worker.settings import DEFAULT_SYSTEM_PROMPT

pytestmark = pytest.mark.integration

PROB_TOL = 1e-4
IN_PROCESS = ["sequential", "naive", "naive-global", "sorted", "ticketq"]
ROW_KEYS = {
    "mode", "items_per_s", "speedup", "padding_ratio", "agreement", "max_abs_prob_diff", "near_ties",
    "disagreements_non_tie", "disagreements_near_tie", "peak_rss_mb",
}  # fmt: skip
HEADER_KEYS = {
    "machine", "torch_threads", "dtype", "device", "model", "standin", "date", "tickets", "command", "autotune",
}  # fmt: skip


def redis_up() -> bool:
    try:
        return bool(redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module")
def bench_run(tiny_model_dir, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("bench")
    modes = IN_PROCESS + (["ticketq-queue"] if redis_up() else [])
    for name in [k for k in os.environ if k.startswith("TICKETQ_") and not k.startswith("TICKETQ_TEST_")]:
        monkeypatch_module.delenv(name)
    monkeypatch_module.setenv("TICKETQ_BROKER_URL", "redis://127.0.0.1:6379/0")
    monkeypatch_module.setenv("TICKETQ_COST_FIXED_MS", "25")
    monkeypatch_module.setenv("TICKETQ_COST_TOKEN_MS", "0.8")
    argv = [
        "--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu", "--threads", "2",
        "--tickets", "30", "--seed", "3", "--modes", ",".join(modes), "--warmup", "2", "--no-autotune",
        "--json", str(out / "bench.json"), "--chart", str(out / "bench.png"), "--markdown", str(out / "bench.md"),
    ]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads((out / "bench.json").read_text())
    return out, modes, rows[0], {row["mode"]: row for row in rows[1:]}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_every_mode_matches_the_reference(bench_run):
    _, modes, _, rows = bench_run
    assert list(rows) == modes
    for mode, row in rows.items():
        assert row["status"] == "ok", row
        assert row["tickets"] == 30 and row["failed"] == 0, row
        assert row["agreement"] == 1.0, row
        assert row["max_abs_prob_diff"] < PROB_TOL, row
        assert row["disagreements_non_tie"] == row["disagreements_near_tie"] == 0, mode
        # three rounds by default, interleaved; the answers the same in every round
        assert len(row["rounds"]) == 3 and row["round_label_changes"] == 0, row["rounds"]
        assert row["items_per_s_min"] <= row["items_per_s"] <= row["items_per_s_max"], mode


def test_padding_is_ordered_as_the_article_says(bench_run):
    _, _, _, rows = bench_run
    pad = {mode: row["padding_ratio"] for mode, row in rows.items()}
    assert pad["sequential"] == 0.0
    assert pad["naive-global"] >= pad["naive"] >= pad["sorted"] > 0
    assert pad["ticketq"] <= pad["sorted"]
    # the full-prompt modes re-run the prefix for every row; ticketq computes only the ticket part
    prefix = bench_run[2]["prefix_tokens"]
    real = {mode: row["computed_tokens"] - row["pad_tokens"] for mode, row in rows.items()}
    for mode in ("sequential", "naive", "naive-global", "sorted"):
        assert real[mode] == 30 * prefix + real["ticketq"], mode
    for mode, row in rows.items():
        assert row["tokens_per_ticket"] == pytest.approx(row["computed_tokens"] / 30), mode
        assert row["tokens_per_s"] == pytest.approx(row["computed_tokens"] / row["seconds"]), mode


def test_outputs_carry_the_required_fields(bench_run):
    out, _, header, rows = bench_run
    assert header["kind"] == "header" and set(header) >= HEADER_KEYS
    assert header["standin"] is True and header["tickets"] == 30 and header["dtype"] == "float32"
    assert header["machine"]["cores"] >= 1 and header["torch_threads"] == 2
    assert header["rounds"] == 3 and len(header["load_average"]["rounds"]) == 3 and header["finished"]
    assert not header["autotune"]["applied"] and "budget 1024 padded tokens" in header["autotune"]["description"]
    assert any("labels meaningless" in note for note in header["notes"])
    for row in rows.values():
        assert set(row) >= ROW_KEYS
        assert row["items_per_s"] > 0 and row["peak_rss_mb"] > 0
    assert rows["sequential"]["speedup"] == pytest.approx(1.0)
    ceiling = rows["ticketq"]["linear_ceiling"]  # timed after each of the 3 rounds, at the mean forward
    assert ceiling["rows"] >= 1 and len(ceiling["tokens_per_s"]) == len(ceiling["share"]) == 3
    assert all(rate > 0 for rate in ceiling["tokens_per_s"]) and all(0 < share < 5 for share in ceiling["share"])
    assert sum("ticketq: tokens/s against the linear-layer ceiling" in note for note in header["notes"]) == 1
    assert "linear_ceiling" not in rows["sequential"]
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (out / "bench.md").read_text().splitlines()
    for mode, row in rows.items():  # one Markdown row per mode, carrying the JSON's figures
        line = next(line for line in markdown if line.startswith(f"| `{mode}` |"))
        assert f"| {row['items_per_s']:.2f} |" in line and f"| {row['padding_ratio']:.1%} |" in line, line
    assert header["command"] in markdown[-1]
    assert sum("ticketq: tokens/s against the linear-layer ceiling" in line for line in markdown) == 1


def test_compare_separates_near_ties_from_real_disagreements():
    reference = [
        Answer("billing", {"billing": 0.5, "technical": 0.495, "account": 0.005}),  # near-tie
        Answer("account", {"billing": 0.1, "technical": 0.1, "account": 0.8}),
        Answer("technical", {"billing": 0.2, "technical": 0.7, "account": 0.1}),
    ]
    answers = [
        Answer("technical", {"billing": 0.49, "technical": 0.505, "account": 0.005}),
        Answer("billing"),  # generate: a label, no probabilities
        Answer("technical", {"billing": 0.2, "technical": 0.7, "account": 0.1}),
    ]
    got = compare(answers, reference, tie_tolerance=0.01)
    assert got["near_ties"] == 1
    assert got["disagreements_near_tie"] == 1 and got["disagreements_non_tie"] == 1
    assert got["agreement"] == pytest.approx(1 / 3)
    assert got["max_abs_prob_diff"] == pytest.approx(0.01)


def test_parse_label_takes_the_first_label_named():
    labels = ("billing", "technical", "account")
    assert parse_label("Technical, not billing", labels) == "technical"
    assert parse_label(" account<|im_end|>", labels) == "account"
    assert parse_label("I cannot tell", labels) == "unparsed"


def test_modes_default_quick_and_all():
    assert "generate" not in parse_args([]).mode_list
    assert parse_args(["--modes", "all"]).mode_list[0] == "generate"
    quick = parse_args(["--quick"])
    assert (quick.tickets, quick.batch_size) == (12, 4) and "generate" not in quick.mode_list
    assert parse_args(["--modes", "ticketq"]).mode_list == ["sequential", "ticketq"]  # the reference always runs
    with pytest.raises(typer.BadParameter):
        parse_args(["--modes", "fastest"])
    assert main(["--modes", "fastest"]) == 2  # a usage error, before anything is loaded


@pytest.mark.parametrize("labels", [("account", "account security", "billing"), ("billing", "technical", "account")])
def test_full_prompt_batch_matches_the_reference(tiny_engine, labels):
    """The full-prompt batches (the baselines' scorer), also for labels sharing leading tokens."""
    engine = Engine(tiny_engine.model, tiny_engine.tokenizer,
        EngineOptions(labels=labels, system=system_text(DEFAULT_SYSTEM_PROMPT, labels, {})))
    texts = [t["text"] for t in generate_tickets(12, seed=5)] + ["x", "<|im_end|> refund please"]
    encoded = engine.encode(texts)
    plan = batching.plan_fixed([len(e.ids) for e in encoded], 5)
    for batch in plan.batches:
        predictions, reports = full_prompt_batch(engine, [encoded[i] for i in batch.indices], batch.width)
        assert len(reports) == len(engine.prompt.trie.branches)
        assert reports[0].computed_tokens == batch.rows * (engine.prefix_len + batch.width)
        assert reports[0].pad_tokens == batch.pad_tokens
        for index, got in zip(batch.indices, predictions, strict=True):
            want = engine.reference(texts[index])
            assert got.label == want.label
            assert max(abs(got.probs[k] - want.probs[k]) for k in want.probs) < PROB_TOL


def test_generate_runs_every_decode_step_on_the_standin(tiny_engine):
    decoded, prompt_tokens, new_tokens = generate_text(tiny_engine, "  my invoice is wrong  ", GENERATE_NEW_TOKENS)
    full = tiny_engine.prompt.full_ids(tiny_engine.prompt.encode("my invoice is wrong"))
    assert prompt_tokens == len(full)  # the rendered chat is the prompt every other mode scores
    assert new_tokens == 4 and isinstance(decoded, str)  # random weights never say end-of-turn


def test_ticket_file_and_strict_exit(tiny_model_dir, tmp_path):
    path = tmp_path / "tickets.jsonl"
    rows = [{"id": f"r{i}", "text": t["text"]} for i, t in enumerate(generate_tickets(6, seed=9))]
    path.write_text("\n".join(json.dumps(r) for r in rows) + '\n{"id": "bad", "text": "  "}\n')
    model = ["--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu"]
    options = [
        "--modes",
        "ticketq",
        "--autotune-s",
        "1",
        "--warmup",
        "1",
        "--strict",
        "--json",
        str(tmp_path / "b.json"),
    ]
    assert main([*model, "--tickets-file", str(path), *options]) == 0
    header, *modes = json.loads((tmp_path / "b.json").read_text())
    assert header["tickets"] == 6 and header["autotune"]["applied"] and len(header["autotune"]["samples"]) >= 6
    assert [m["mode"] for m in modes] == ["sequential", "ticketq"] and modes[1]["agreement"] == 1.0
    assert main([*model, "--tickets-file", str(tmp_path / "missing.jsonl"), *options]) == 2


def test_opt_in_modes_are_listed_not_default():
    default = parse_args([]).mode_list
    assert not {"ticketq-int8", "llama-cpp", "llama-cpp-q8"} & set(default)
    assert parse_args(["--modes", "llama-cpp,ticketq-int8"]).mode_list == ["sequential", "ticketq-int8", "llama-cpp"]
    assert parse_args(["--dtype", "int8"]).dtype == "int8"


def llama_cpp_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def peer_run(tiny_model_dir, tmp_path_factory, monkeypatch_module):
    """ticketq, ticketq-int8 and the llama.cpp modes in one run on 12 tickets."""
    out = tmp_path_factory.mktemp("peers")
    for name in [k for k in os.environ if k.startswith("TICKETQ_") and not k.startswith("TICKETQ_TEST_")]:
        monkeypatch_module.delenv(name)
    argv = [
        "--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu", "--threads", "2",
        "--tickets", "12", "--seed", "4", "--modes", "ticketq,ticketq-int8,llama-cpp,llama-cpp-q8", "--warmup", "1",
        "--no-autotune", "--json", str(out / "peers.json"), "--markdown", str(out / "peers.md"),
    ]  # fmt: skip
    assert main(argv) == 0
    header, *rows = json.loads((out / "peers.json").read_text())
    return header, {row["mode"]: row for row in rows}, (out / "peers.md").read_text()


def test_int8_mode_reports_its_agreement(peer_run):
    header, rows, markdown = peer_run
    assert header["dtype"] == "float32"  # the bench's engine and reference stay float32
    row = rows["ticketq-int8"]
    assert row["status"] == "ok" and row["tickets"] == 12 and row["failed"] == 0
    assert row["agreement"] is not None and row["max_abs_prob_diff"] is not None  # inexact: shown, not hidden
    int8_note = "ticketq-int8: decoder linear layers but the MLP down projection in dynamic int8"
    assert any(note.startswith(int8_note) for note in header["notes"])
    assert rows["ticketq"]["agreement"] == 1.0
    assert "| `ticketq-int8` |" in markdown
    assert len(header["load_average"]["start"]) == 3 and isinstance(header["machine"]["cpu_flags"], list)


def test_llama_cpp_modes_run_or_say_why(peer_run):
    header, rows, _ = peer_run
    if not llama_cpp_installed():
        for mode in ("llama-cpp", "llama-cpp-q8"):
            assert rows[mode]["status"] == "skipped"
            assert "pip install 'ticketq[peers]'" in rows[mode]["notes"][0]
        return
    f32, q8 = rows["llama-cpp"], rows["llama-cpp-q8"]
    assert f32["status"] == q8["status"] == "ok", (f32["notes"], q8["notes"])
    # same model, same tokens, f32; ggml's kernels sum in another order (measured on the tiny stand-in: 1.2e-3)
    assert f32["agreement"] == 1.0 and f32["max_abs_prob_diff"] < 5e-3
    assert q8["agreement"] is not None
    # the prompt cache: llama.cpp computes exactly ticketq's real tokens (ticket + suffix), no padding
    real = rows["ticketq"]["computed_tokens"] - rows["ticketq"]["pad_tokens"]
    assert f32["computed_tokens"] == q8["computed_tokens"] == real and f32["pad_tokens"] == 0
    assert any("llama-cpp-python" in note for note in header["notes"])


@pytest.mark.skipif(not llama_cpp_installed(), reason="llama-cpp-python not installed (pip install 'ticketq[peers]')")
def test_llama_cpp_scores_shared_label_prefixes_like_the_reference(tiny_engine, tiny_model_dir):
    """Labels sharing a first token: the continuation branch runs after the ticket's cached tokens."""
    from ticketq_bench.llama_cpp_peer import LlamaCppScorer, gguf_model

    labels = ("account", "account security", "billing")
    engine = Engine(tiny_engine.model, tiny_engine.tokenizer,
        EngineOptions(labels=labels, system=system_text(DEFAULT_SYSTEM_PROMPT, labels, {})))
    assert any(engine.prompt.trie.branches.keys() - {()})
    gguf = gguf_model(tiny_model_dir, "f32", ROOT / "out")
    scorer = LlamaCppScorer(gguf, engine.prompt, threads=1, n_ctx=1024)
    for text in [t["text"] for t in generate_tickets(6, seed=6)] + ["x"]:
        got, reports = scorer.score(engine.prompt.encode(text))
        want = engine.reference(text)
        assert got.label == want.label and len(reports) == len(engine.prompt.trie.branches)
        assert max(abs(got.probs[k] - want.probs[k]) for k in want.probs) < 5e-3


def test_duplicates_are_computed_once_with_the_labels_of_every_copy(tiny_model_dir, tmp_path, monkeypatch):
    """--duplicates 0.5: ticketq computes each distinct text once, ticketq-nodedup every ticket, the
    same labels ticket for ticket, and the reference's."""
    for name in [k for k in os.environ if k.startswith("TICKETQ_") and not k.startswith("TICKETQ_TEST_")]:
        monkeypatch.delenv(name)
    argv = [
        "--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu", "--threads", "2",
        "--tickets", "24", "--duplicates", "0.5", "--seed", "5", "--modes", "ticketq,ticketq-nodedup",
        "--rounds", "2", "--warmup", "1", "--no-autotune", "--json", str(tmp_path / "dedup.json"),
    ]  # fmt: skip
    assert main(argv) == 0
    header, *rows = json.loads((tmp_path / "dedup.json").read_text())
    by_mode = {row["mode"]: row for row in rows}
    dedup, plain = by_mode["ticketq"], by_mode["ticketq-nodedup"]
    assert dedup["agreement"] == plain["agreement"] == 1.0 and dedup["labels"] == plain["labels"]
    assert plain["computed_tickets"] == [24, 24] and all(n <= 12 for n in dedup["computed_tickets"])
    (line,) = [n for n in header["notes"] if n.startswith("deduplication:")]
    assert "labels equal ticket for ticket: 24/24" in line


def test_quick_bench_runs_the_checked_mode_in_bfloat16_to_its_row(tiny_model_dir, tmp_path, monkeypatch):
    """`ticketq bench --quick` on the tiny stand-in exits 0 with a ticketq-checked row, its mode in
    bfloat16 as a CPU with native bf16 chooses (forced here), the float32 engine's weights packed for
    oneDNN. It used to crash there: the bfloat16 copy's `.to()` cast the biases it shared with the
    float32 engine's packed layers, and the calibration's float32 GEMMs met a bfloat16 bias in oneDNN."""
    from worker.engine import kernels

    if not kernels.PackedLinear.available():
        pytest.skip("this torch has no oneDNN linear ops")
    for name in [k for k in os.environ if k.startswith("TICKETQ_") and not k.startswith("TICKETQ_TEST_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TICKETQ_MATMUL", "onednn")
    monkeypatch.setenv("TICKETQ_BROKER_URL", "redis://127.0.0.1:1/0")  # the queue mode says why it skips
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a fresh calibration, not this machine's
    monkeypatch.setattr(kernels, "resolve_precision", lambda *args, **kwargs: ("bfloat16", True))
    out = tmp_path / "bench.json"
    argv = ["--quick", "--model", str(tiny_model_dir), "--json", str(out), "--chart", str(tmp_path / "bench.png"),
            "--markdown", str(tmp_path / "bench.md")]  # fmt: skip
    assert main(argv) == 0
    rows = {row["mode"]: row for row in json.loads(out.read_text())[1:]}
    assert rows["ticketq-checked"]["agreement"] == 1.0 and rows["ticketq"]["agreement"] == 1.0
    header, weights = json.loads(out.read_text())[0], rows["ticketq-checked"]["recheck"]["weights_mb"]
    assert weights["fast"] < weights["twin"] <= weights["both"] <= weights["fast"] + weights["twin"] + 0.01
    (line,) = [note for note in header["notes"] if note.startswith("ticketq-checked memory:")]
    assert f"{weights['both']:.0f} MiB of weights resident" in line
