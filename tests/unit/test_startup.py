"""What `ticketq classify` does before its first result row: it imports no queue machinery (Celery,
kombu, Redis, Prometheus, the benchmark), pauses the garbage collector while torch and the model
load, measures the kernel probes on the first start only (real subprocesses, the tiny stand-in),
and classifies a first chunk of one row.

No timings are asserted: the test machines are shared.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from commands import engine_env

from ticketq.process import paused_gc
from worker.engine.kernels import PackedLinear

# `ticketq classify ARGS`, then the modules the process imported, as a JSON list on the last line.
CLASSIFY_THEN_LIST_MODULES = """
import json, sys
from ticketq_cli import cli
sys.argv = ["ticketq", "classify", *sys.argv[1:]]
try:
    cli.main()
finally:
    print(json.dumps(sorted(sys.modules)))
"""
QUEUE_MACHINERY = ("celery", "kombu", "redis", "billiard", "prometheus_client", "worker.service", "worker.app",
                   "worker.transport", "worker.metrics", "ticketq_bench")  # fmt: skip


def tickets(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"id": f"T-{i}", "text": f"my invoice {i} is wrong"}) + "\n"
                            for i in range(1, n + 1)), encoding="utf-8")  # fmt: skip
    return path


def classify(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, set[str]]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    clean.update({"PYTHONUNBUFFERED": "1", "COLUMNS": "80", **env})
    args = [str(tickets(tmp_path / "t.jsonl")), "-o", "r.jsonl", "--force", "--no-progress"]
    done = subprocess.run([sys.executable, "-c", CLASSIFY_THEN_LIST_MODULES, *args], cwd=tmp_path, env=clean,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done, set(json.loads(done.stdout.strip().splitlines()[-1]))


def imported(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


def test_classify_imports_no_queue_machinery(tmp_path, tiny_model_dir):
    done, modules = classify(tmp_path, engine_env(tiny_model_dir))
    assert "read 3 rows: 3 ok, 0 failed" in done.stdout  # the summary goes to stdout, as ticketq-produce's
    assert "torch" in modules and "worker.engine.model" in modules  # it did load the model
    assert imported(modules, QUEUE_MACHINERY) == []


def test_the_cli_and_the_file_reader_import_no_torch():
    """A bad option, a missing file or a file with nothing to classify is answered before torch loads."""
    code = ("import sys, ticketq_cli.cli, ticketq_cli.offline, worker.engine.loading; "
            "print(sorted(m for m in ('torch', 'transformers', 'celery', 'kombu') if m in sys.modules))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_the_second_start_on_a_machine_skips_the_kernel_probes(tmp_path, tiny_model_dir):
    """TICKETQ_DTYPE=auto and TICKETQ_MATMUL=auto: the first start measures (where this CPU has
    something to measure: native bf16, oneDNN), the second reads the verdicts it cached."""
    env = {**engine_env(tiny_model_dir), "TICKETQ_DTYPE": "auto", "TICKETQ_MATMUL": "auto",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}  # fmt: skip
    first, _ = classify(tmp_path, env)
    verdicts = sorted((tmp_path / "cache" / "ticketq" / "kernels").glob("*.json"))
    assert verdicts or not PackedLinear.available(), first.stderr  # a CPU torch has oneDNN: one probe at least
    probed = [line for line in first.stderr.splitlines() if " probe: " in line]
    assert len(probed) == len(verdicts), first.stderr
    assert all("probe: measured" in line or "straddled" in line for line in probed), first.stderr
    second, _ = classify(tmp_path, env)
    cached = [line for line in second.stderr.splitlines() if " probe: " in line]
    assert len(cached) == len(verdicts) and all(", cached " in line for line in cached), second.stderr
    assert _chosen(first.stderr) == _chosen(second.stderr)


def _chosen(stderr: str) -> list[str]:
    """The `dtype auto: ... -> X` and `matmul auto: ... -> Y` choices a start logged."""
    return [line.rsplit("-> ", 1)[1] for line in stderr.splitlines() if " auto: " in line and "-> " in line]


def test_the_first_chunk_is_one_row_so_the_first_result_needs_one_forward_pass():
    from ticketq_cli.offline import chunked

    assert [len(chunk) for chunk in chunked(iter(range(40)))] == [1, 2, 4, 8, 16, 9]


def test_the_collector_is_paused_inside_and_left_to_the_outermost_pause():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause does not switch it back on
    assert gc.isenabled()
    try:
        with paused_gc():
            raise KeyError("a load that fails")
    except KeyError:
        pass
    assert gc.isenabled()


def test_a_freezing_pause_leaves_what_exists_out_of_later_collections():
    frozen = gc.get_freeze_count()
    try:
        with paused_gc(freeze=True):
            kept = [[index] for index in range(1000)]  # noqa: F841 -- tracked objects to freeze
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + 1000
    finally:
        gc.unfreeze()  # this test process is not a command that has just started


def test_the_stand_in_names_its_added_tokens_in_the_tokenizer_config(tiny_model_dir):
    """Without `added_tokens_decoder` transformers parses the 18 MB tokenizer.json twice per load."""
    from transformers import AutoTokenizer

    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = {int(token_id): entry["content"] for token_id, entry in config["added_tokens_decoder"].items()}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert named == {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
    assert named[151645] == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645
