"""Both command-line programs as a user runs them: real subprocesses, real Redis, the tiny stand-in.

Checks the command-line promises: every input row ends in one result row, nothing of the user's is
overwritten, every bad setting is one line naming the variable (exit 2, before the model loads),
`--version`/`-h` everywhere, `ticketq config` readable at 80 columns, and the README's settings
table and Python examples true.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import click.testing
import pytest
import redis
from commands import engine_env, run
from typer.testing import CliRunner
from workers import ROOT, null_classifier_service

from producer.cli import app as produce_app
from ticketq.cli import command
from ticketq.exits import EXIT_FAILED, EXIT_NOTHING, EXIT_USAGE
from ticketq_bench.cli import command as bench_command
from ticketq_cli.cli import cli as ticketq_app
from worker.settings import Settings

pytestmark = pytest.mark.integration

README = (ROOT / "README.md").read_text(encoding="utf-8")


def csv_with_broken_quote(path: Path, n: int = 100, broken: int = 50) -> Path:
    rows = ["id,text"] + [f"T-{i},ticket {i}: my invoice shows a charge I do not recognise" for i in range(1, n + 1)]
    rows[broken] = f'T-{broken},"unterminated quote in this ticket'
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


# --- -h and --version on every command (in-process: the same click commands main() runs) ---


def all_commands(app) -> list[list[str]]:
    built = command(app, "x")
    return [[]] + [[name] for name in built.commands]


@pytest.mark.parametrize("app", [ticketq_app, produce_app], ids=["ticketq", "ticketq-produce"])
def test_version_and_short_help_on_every_command(app):
    runner = CliRunner()
    for path in all_commands(app):
        version = runner.invoke(app, [*path, "--version"])
        assert version.exit_code == 0, (path, version.output)
        assert re.search(r"\d+\.\d+\.\d+ \(Python", version.output), (path, version.output)
        # these hand -h to their own argparse (SystemExit(0)); the gateway programs' own test is below
        if path not in (["bench"], ["loadtest"], ["gateway"], ["deliver"]):
            short = runner.invoke(app, [*path, "-h"])
            assert short.exit_code == 0 and "Usage" in short.output, (path, short.output)


@pytest.mark.parametrize("prog", ["gateway", "deliver"])
def test_version_on_the_gateway_programs(prog, capsys):
    """`ticketq-gateway --version` and `ticketq-deliver --version`: the README says every command takes it."""
    from gateway.cli import deliver_main, gateway_main

    with pytest.raises(SystemExit) as exited:
        (gateway_main if prog == "gateway" else deliver_main)(["--version"])
    assert exited.value.code in (0, None)
    assert re.search(rf"^ticketq-{prog} \d+\.\d+\.\d+ \(Python", capsys.readouterr().out), prog


@pytest.mark.parametrize("app", [ticketq_app, produce_app], ids=["ticketq", "ticketq-produce"])
def test_help_names_values_as_click_does(app):
    """No `<bool>` beside a flag, no `<path>` type column, no `{path}` in a usage line: a flag shows no
    value, an option `PATH` or `TEXT`, an argument its name."""

    def paths(group, path):
        yield path
        for name, sub in getattr(group, "commands", {}).items():
            yield from paths(sub, [*path, name])

    built, runner = command(app, "x"), CliRunner()

    def help_of(path: list[str]) -> str:  # of the command main() runs, not one typer builds again
        with runner.isolation(env={"COLUMNS": "100"}) as (stdout, _, _):
            assert built.main([*path, "--help"], prog_name="x", standalone_mode=False) in (0, None), path
            return stdout.getvalue().decode()

    for path in paths(built, []):
        if path in (["bench"], ["loadtest"], ["gateway"], ["deliver"]):  # own programs (argparse); bench's below
            continue
        shown = help_of(path)
        usage = next(line for line in shown.splitlines() if "Usage:" in line)
        assert "{" not in usage, (path, usage)
        assert not re.search(r"<(bool|str|int|float|path|list\[\w+\])>", shown, re.I), (path, shown)
    classify = help_of(["classify"] if app is ticketq_app else ["file"])
    assert re.search(r"Usage: .* \[OPTIONS\] PATH\b", classify), classify


def test_bench_help_names_values_as_click_does():
    with CliRunner().isolation(env={"COLUMNS": "100"}) as (stdout, _, _):
        assert bench_command().main(["--help"], prog_name="ticketq bench", standalone_mode=False) in (0, None)
        shown = stdout.getvalue().decode()
    assert not re.search(r"<(bool|str|int|float|path)>", shown, re.I), shown
    assert re.search(r"--quick +a short run", shown) and "[auto|float32|bfloat16|float16|int8]" in shown, shown


@pytest.mark.parametrize("app", [ticketq_app, produce_app], ids=["ticketq", "ticketq-produce"])
def test_help_texts_read_whole(app):
    """Command lists show each summary as one sentence (typer kept the docstring's line breaks),
    and help text shows its brackets (rich took `[labels]` for markup)."""

    def groups(group):
        yield group
        for sub in getattr(group, "commands", {}).values():
            yield from groups(sub)

    for group in groups(command(app, "x")):
        for paragraph in (group.help or "").split("\n\n"):
            assert all(line.startswith(("-", "*", " ")) for line in paragraph.splitlines()[1:]), group.name
    built = command(app, "x")
    for path in all_commands(app):
        if path in (["bench"], ["loadtest"], ["gateway"], ["deliver"]):  # own programs (argparse); bench's below
            continue
        sub = built.commands[path[0]] if path else built
        shown = " ".join(click.testing.CliRunner().invoke(built, [*path, "-h"]).output.replace("│", " ").split())
        for param in sub.params:
            for bracketed in re.findall(r"\[[^\]]+\]", getattr(param, "help", None) or ""):
                assert bracketed.replace("\\", "") in shown, (path, param.name, bracketed)  # not eaten as markup
    if app is ticketq_app:
        raw = click.testing.CliRunner().invoke(command(app, "ticketq"), ["eval", "-h"]).output  # as main() builds it
        assert not re.search(r"without one, and *\n", raw), raw  # the docstring's own line break
        shown = " ".join(raw.replace("│", " ").split())
        assert "{field: label} or {field: [labels]}" in shown, shown


# --- every invalid setting: one line, the variable, the value, what is allowed; exit 2; no model load ---

BAD_SETTINGS = [
    ({"TICKETQ_MAX_BATCH_TOKENS": "-1"}, "TICKETQ_MAX_BATCH_TOKENS=-1: must be >= 16"),
    ({"TICKETQ_BROKER_URL": "http://x"}, "TICKETQ_BROKER_URL=http://x: must be a Redis URL"),
    ({"TICKETQ_LABELS": "a,a"}, "TICKETQ_LABELS=a,a: label 'a' appears more than once"),
    ({"TICKETQ_DTYPE": "bogus"}, "TICKETQ_DTYPE=bogus: must be one of 'auto'"),
    ({"TICKETQ_AUTOTUNE": "maybe"}, "TICKETQ_AUTOTUNE=maybe: must be true or false"),
    ({"TICKETQ_RESULT_BACKEND": "nosuch://x"}, "TICKETQ_RESULT_BACKEND=nosuch://x: must be a Celery result backend"),
]


def assert_one_line_error(result, expected: str, status: int = EXIT_USAGE) -> None:
    assert result.returncode == status, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Loading weights" not in result.stderr  # refused before the model was touched


@pytest.mark.parametrize(("env", "expected"), BAD_SETTINGS, ids=[next(iter(e)) for e, _ in BAD_SETTINGS])
def test_worker_refuses_each_bad_setting_in_one_line(env, expected):
    assert_one_line_error(run(["ticketq", "worker"], env), expected)


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["ticketq", "config"], {"TICKETQ_MAX_BATCH_TOKENS": "-1"}, "TICKETQ_MAX_BATCH_TOKENS=-1: must be >= 16"),
        (["ticketq", "classify", "t.jsonl"], {"TICKETQ_MAX_BATCH_TOKENS": "-1"}, "TICKETQ_MAX_BATCH_TOKENS=-1: must"),
        # a producer reads (and checks) only the client settings: a worker-only one is the worker's
        (["ticketq-produce", "synthetic", "3"], {"TICKETQ_MAX_TICKET_BYTES": "1"}, "TICKETQ_MAX_TICKET_BYTES=1: must"),
    ],
    ids=["config", "classify", "produce"],
)
def test_every_command_refuses_a_bad_setting_in_one_line(args, env, expected):
    assert_one_line_error(run(args, env), expected)


def test_bad_options_and_missing_files_are_one_line_before_the_model_loads(tmp_path, tiny_model_dir):
    env = engine_env(tiny_model_dir)
    assert_one_line_error(run(["ticketq", "classify", "t.csv", "--dtype", "bogus"], env), "--dtype bogus: must be")
    missing = run(["ticketq", "classify", str(tmp_path / "missing.jsonl")], env, cwd=tmp_path)
    assert_one_line_error(missing, "missing.jsonl: cannot read ticket file")
    assert_one_line_error(run(["ticketq-produce", "synthetic", "3", "--broker-url", "http://y"]),
                          "--broker-url http://y: must be a Redis URL")  # fmt: skip


def test_missing_model_path_names_ticketq_standin(tmp_path):
    result = run(["ticketq", "worker"], {"TICKETQ_MODEL": "/nonexistent"})
    assert_one_line_error(result, "TICKETQ_MODEL=/nonexistent: no such directory")
    assert "ticketq standin" in result.stderr


def test_metrics_port_taken_is_refused_before_the_model_loads(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**engine_env(tiny_model_dir), "TICKETQ_METRICS_PORT": str(port)}
        assert_one_line_error(run(["ticketq", "worker"], env), f"TICKETQ_METRICS_PORT={port}: cannot listen")


# --- ticketq classify: every row accounted for, nothing overwritten ---


def test_classify_writes_a_row_for_every_input_line(tmp_path, tiny_model_dir):
    tickets = csv_with_broken_quote(tmp_path / "tickets.csv")
    result = run(["ticketq", "classify", str(tickets), "--out", "r.jsonl", "--no-progress"],
                 engine_env(tiny_model_dir), cwd=tmp_path)  # fmt: skip
    assert result.returncode == EXIT_FAILED, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(rows) == 100
    assert [row["source"] for row in rows] == [f"{tickets}:{line}" for line in range(2, 102)]
    failed = [row for row in rows if row["status"] != "ok"]
    assert [(row["source"], row["reason"]) for row in failed] == [(f"{tickets}:51", "malformed_csv")]
    assert "read 100 rows: 99 ok, 1 failed (1 malformed_csv)" in result.stdout
    assert f"{tickets}:51: malformed_csv: malformed CSV: unterminated quote" in result.stderr


def test_classify_answers_a_schema_in_the_workers_result_shape(tmp_path, tiny_model_dir, tiny_engine):
    """`classify --schema`: every field of every row, the `Triaged` shape, each field's label the
    schema's own reference path's."""
    from ticketq.contract import Triaged
    from ticketq.schema import load_schema

    schema_file = ROOT / "examples" / "schema.toml"
    tickets = tmp_path / "t.jsonl"
    texts = ["refund the double charge on my invoice", "the app crashes when I log in", "change my email address"]
    tickets.write_text("".join(json.dumps({"id": f"T-{i}", "text": text}) + "\n" for i, text in enumerate(texts)))
    env = {**engine_env(tiny_model_dir), "TICKETQ_MATMUL": "torch"}  # the kernels of `tiny_engine`
    result = run(["ticketq", "classify", str(tickets), "--schema", str(schema_file), "--out", "r.jsonl",
                  "--no-progress"], env, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    worker_only = {"task_id", "worker", "queue_wait_s", "processing_s"}
    schema = load_schema(schema_file)
    reference = tiny_engine.fields(schema)
    for row, text in zip(rows, texts, strict=True):
        assert set(Triaged.__annotations__) - worker_only <= set(row), row
        assert row["schema"] == schema.name and set(row["fields"]) == {spec.name for spec in schema.fields}
        want = reference.reference(text)
        assert {name: answer.get("label", answer.get("labels")) for name, answer in row["fields"].items()} == {
            name: (list(r.labels) if r.multi else r.label) for name, r in want.fields.items()}
    assert "read 3 rows: 3 ok, 0 failed" in result.stdout
    bad = run(["ticketq", "classify", str(tickets), "--schema", str(tmp_path / "none.toml")], env, cwd=tmp_path)
    assert bad.returncode == EXIT_USAGE and not (tmp_path / "results.jsonl").exists()


def test_schema_check_says_what_a_file_holds_or_each_problem(tmp_path):
    good = run(["ticketq", "schema", "check", str(ROOT / "examples" / "schema.toml")])
    assert good.returncode == 0 and "schema 'support', 3 field(s): category (3 labels)" in good.stdout, good.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "default"\n[fields.a]\nlabels = 3\n')
    refused = run(["ticketq", "schema", "check", str(bad)])
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == EXIT_USAGE and "Traceback" not in refused.stderr
    assert len(lines) == 3 and all(line.startswith(f"error: {bad}: ") for line in lines), refused.stderr


def test_standin_says_once_what_it_built(tmp_path):
    result = run(["ticketq", "standin", "--size", "tiny", "--out", str(tmp_path / "m")])
    assert result.returncode == 0, result.stderr
    said = (result.stdout + result.stderr).count("labels are meaningless")
    assert said == 1, result.stdout + result.stderr


def test_standin_refuses_to_overwrite_a_real_model_unless_forced(tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}\n')
    refused = run(["ticketq", "standin", "--size", "tiny", "--out", str(model)])
    assert refused.returncode == EXIT_USAGE and "Traceback" not in refused.stderr
    assert refused.stderr.strip().count("\n") == 0 and "--force" in refused.stderr, refused.stderr
    assert (model / "config.json").read_text() == '{"model_type": "llama"}\n'  # untouched
    module = subprocess.run([sys.executable, "-m", "ticketq_cli.standin", "--size", "tiny", "--out", str(model)],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert module.returncode == EXIT_USAGE and "--force" in module.stderr, module.stderr
    forced = run(["ticketq", "standin", "--size", "tiny", "--out", str(model), "--force"])
    assert forced.returncode == 0, forced.stderr
    again = run(["ticketq", "standin", "--size", "tiny", "--out", str(model), "--seed", "1"])  # a stand-in: rebuilt
    assert again.returncode == 0, again.stderr


def test_classify_never_overwrites(tmp_path, tiny_model_dir):
    env = engine_env(tiny_model_dir)
    tickets = tmp_path / "t.jsonl"
    tickets.write_text('{"id": "a", "text": "refund please"}\n')
    previous = tmp_path / "results.jsonl"
    previous.write_text("yesterday's results\n")
    refused = run(["ticketq", "classify", "t.jsonl"], env, cwd=tmp_path)  # no --out: the default exists
    assert_one_line_error(refused, "results.jsonl already exists; pass --force")
    assert previous.read_text() == "yesterday's results\n"
    same = run(["ticketq", "classify", "t.jsonl", "--out", str(tickets), "--force"], env, cwd=tmp_path)
    assert_one_line_error(same, "is the input file")
    assert tickets.read_text() == '{"id": "a", "text": "refund please"}\n'
    forced = run(["ticketq", "classify", "t.jsonl", "--force", "--no-progress"], env, cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert json.loads(previous.read_text())["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("program", ["classify", "eval"])
def test_classify_refuses_the_null_classifier_in_one_line(tmp_path, tiny_model_dir, program):
    """TICKETQ_NULL_CLASSIFIER (the worker's queue-overhead meter) is not silently ignored in-process."""
    (tmp_path / "t.jsonl").write_text('{"id": "a", "text": "refund please", "expected": "billing"}\n')
    env = {**engine_env(tiny_model_dir), "TICKETQ_NULL_CLASSIFIER": "1"}
    refused = run(["ticketq", program, "t.jsonl", "--no-progress"], env, cwd=tmp_path)
    assert_one_line_error(refused, "TICKETQ_NULL_CLASSIFIER")
    assert not (tmp_path / "results.jsonl").exists()


def test_classify_with_nothing_classifiable_exits_3_and_still_writes_every_row(tmp_path, tiny_model_dir):
    tickets = tmp_path / "t.jsonl"
    tickets.write_text('[{"id": "a", "text": "a JSON array is not JSONL"}]\n{"id": "b", "text": "   "}\n')
    result = run(["ticketq", "classify", "t.jsonl", "-o", "r.jsonl"], engine_env(tiny_model_dir), cwd=tmp_path)
    assert result.returncode == EXIT_NOTHING, result.stderr
    assert "stand-in model" not in result.stderr  # nothing to classify: the model is not loaded (its load says so)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(row["status"], row["reason"]) for row in rows] == [("failed", "invalid_json"), ("failed", "empty_text")]
    assert "read 2 rows: 0 ok, 2 failed" in result.stdout


@pytest.mark.parametrize(
    ("name", "content", "status"),
    [
        ("t.jsonl", b"", EXIT_NOTHING),
        ("t.csv", b"", EXIT_NOTHING),
        ("t.csv", b"\n\n", EXIT_NOTHING),
        ("t.csv", b"id,text\n", EXIT_NOTHING),
        ("t.csv", b"1,my card was charged twice\n", EXIT_USAGE),  # no header at all: not a ticket file
    ],
    ids=["jsonl-empty", "csv-zero-bytes", "csv-blank-lines", "csv-header-only", "csv-without-header"],
)
def test_classify_of_an_empty_file_exits_3_in_either_format(tmp_path, name, content, status):
    """An empty file was read and had nothing to classify (3); a CSV without a header is bad input (2)."""
    (tmp_path / name).write_bytes(content)
    result = run(["ticketq", "classify", name, "-o", "r.jsonl", "--no-progress"], cwd=tmp_path)
    assert result.returncode == status, result.stderr
    if status == EXIT_USAGE:
        assert_one_line_error(result, "CSV header must name a 'text' column", status)
        assert not (tmp_path / "r.jsonl").exists()
    else:
        assert "read 0 rows: 0 ok, 0 failed" in result.stdout and "Loading weights" not in result.stderr
        assert (tmp_path / "r.jsonl").read_bytes() == b""
    assert not (tmp_path / "r.jsonl.partial").exists()


def test_a_model_that_is_not_a_causal_lm_is_refused_and_leaves_nothing_behind(tmp_path, tiny_model_dir):
    """A BERT directory: one line naming what is supported, exit 2, before any weight is read; no
    `.partial` left, so the rerun with a good model needs neither --resume nor --force."""
    from transformers import BertConfig, BertForMaskedLM

    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(bert)  # fmt: skip
    tickets = tmp_path / "t.jsonl"
    tickets.write_text('{"id": "a", "text": "refund please"}\n')
    args = ["ticketq", "classify", str(tickets), "--out", "r.jsonl", "--no-progress"]
    refused = run(args, {**engine_env(tiny_model_dir), "TICKETQ_MODEL": str(bert)}, cwd=tmp_path)
    assert_one_line_error(refused, "BertForMaskedLM (model_type bert) is not a decoder-only language model")
    assert not list(tmp_path.glob("r.jsonl*"))
    again = run(args, engine_env(tiny_model_dir), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "r.jsonl").is_file() and not (tmp_path / "r.jsonl.partial").exists()


def test_error_lists_are_never_cut_silently(tmp_path):
    tickets = tmp_path / "t.jsonl"
    tickets.write_text("".join("{broken\n" for _ in range(25)))
    result = run(["ticketq", "classify", "t.jsonl", "-o", "r.jsonl"], cwd=tmp_path)
    assert "... and 5 more (every row is in r.jsonl)" in result.stderr
    assert len((tmp_path / "r.jsonl").read_text().splitlines()) == 25


# --- ticketq-produce file, through a private Redis and a real (null-classifier) worker ---


@pytest.fixture(scope="module")
def queue_service(tmp_path_factory):
    """A private redis-server and one null-classifier worker on it: (broker url, queue)."""
    with null_classifier_service(tmp_path_factory.mktemp("cli-redis"), "cli") as service:
        yield service


def test_produce_file_writes_a_row_for_every_input_line(tmp_path, queue_service):
    url, queue = queue_service
    tickets = csv_with_broken_quote(tmp_path / "tickets.csv")
    with tickets.open("a") as extra:
        extra.write("T-101," + "x" * 70000 + "\n")  # over TICKETQ_MAX_TICKET_BYTES: refused before sending
    env = {"TICKETQ_BROKER_URL": url, "TICKETQ_QUEUE": queue}
    args = ["ticketq-produce", "file", str(tickets), "--out", "r.jsonl", "--timeout", "60"]
    result = run(args, env, cwd=tmp_path)
    assert result.returncode == EXIT_FAILED, result.stdout + result.stderr
    # progress asked for (the default), stderr a pipe: no bar frames
    assert "enqueue" not in result.stderr and "ticket/s" not in result.stderr, result.stderr
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [row["source"] for row in rows] == [f"{tickets}:{line}" for line in range(2, 103)]
    assert {row["id"]: row["reason"] for row in rows if row["status"] != "ok"} == {
        "line-51": "malformed_csv", "T-101": "oversize"
    }  # fmt: skip
    assert "read 101 rows: 99 ok, 2 failed" in result.stdout
    again = run(args, env, cwd=tmp_path)
    assert_one_line_error(again, "r.jsonl already exists; pass --force")


# --- ticketq config and the README ---


def test_config_piped_is_one_grep_able_line_per_setting():
    env = {"TICKETQ_NULL_CLASSIFIER": "1", "TICKETQ_BROKER_URL": "redis://:s3cret@h:6379/0"}
    result = run(["ticketq", "config"], env)  # stdout is a pipe here
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "TICKETQ_NULL_CLASSIFIER=True" in lines
    assert "TICKETQ_BROKER_URL='redis://:**@h:6379/0'" in lines and "s3cret" not in result.stdout
    assert all(line.startswith(("TICKETQ_", "# TICKETQ_")) and "=" in line for line in lines)
    assert len(lines) == len(Settings.model_fields)
    as_json = json.loads(run(["ticketq", "config", "--format", "json"], env).stdout)
    assert as_json["TICKETQ_NULL_CLASSIFIER"]["value"] == "True" and len(as_json) == len(Settings.model_fields)
    bad = run(["ticketq", "config"], {"TICKETQ_MAX_BATCH_TOKENS": "-1"})
    assert bad.returncode == EXIT_USAGE and "# TICKETQ_MAX_BATCH_TOKENS: INVALID" in bad.stdout


def test_config_piped_round_trips_through_a_shell(tmp_path):
    """`ticketq config > env; set -a; . ./env` sets every value as it was: quoted for sh (spaces,
    apostrophes, `$`), unset settings as comments rather than `None` (which would then be invalid)."""
    prompt = "You're a router; it's \"$HOME\" `date` and a \\ backslash"
    env = {"TICKETQ_SYSTEM_PROMPT": prompt, "TICKETQ_LABELS": "billing,can't log in,other"}
    first = run(["ticketq", "config"], env)
    assert first.returncode == 0, first.stderr
    assert "# TICKETQ_THREADS= (unset)" in first.stdout.splitlines() and "=None" not in first.stdout
    (tmp_path / "env").write_text(first.stdout, encoding="utf-8")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    script = f"set -a; . ./env; set +a; exec {sys.executable} -m ticketq_cli.cli config"
    again = subprocess.run(["sh", "-c", script], env={**clean, "PYTHONPATH": str(ROOT), "COLUMNS": "80"},
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    assert f"TICKETQ_SYSTEM_PROMPT={shlex.quote(prompt)}" in again.stdout.splitlines()


def test_config_is_not_cut_at_80_columns():
    result = run(["ticketq", "config", "--format", "table"])
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    flat = re.sub(r"[\s│┃|]+", " ", result.stdout)
    assert "(default: 2 x batch_window so the window can fill)" in flat.replace(" x ", " x ")


def test_generated_docs_are_current():
    """docs/settings.md and docs/metrics.md are generated from the code: a new setting or metric
    without `python -m ticketq_cli.docgen` fails here."""
    from ticketq_cli import docgen

    for path, text in docgen.documents().items():
        assert path.read_text(encoding="utf-8") == text, f"{path.name} is stale: run `python -m ticketq_cli.docgen`"
    assert all(f"`TICKETQ_{name.upper()}`" in docgen.settings_table() for name in Settings.model_fields)


def readme_python_blocks() -> list[str]:
    """Every ```python block of the README that is a whole program; `…` marks a fragment."""
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    return [block for block in blocks if "…" not in block]


def test_readme_python_examples_run_as_written(queue_service, tmp_path):
    url, queue = queue_service
    blocks = readme_python_blocks()
    assert blocks, "the README has no runnable Python example"
    env = {**os.environ, "TICKETQ_BROKER_URL": url, "TICKETQ_QUEUE": queue, "PYTHONPATH": str(ROOT)}
    for block in blocks:
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-c", block], env=env, cwd=tmp_path, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert result.returncode == 0, f"README example failed:\n{block}\n{result.stderr}"
        assert time.monotonic() - started < 60, "the example waited for its timeout: no results came"
        if "results_stream" in block:
            streamed = redis.Redis.from_url(url).xlen("ticketq:results")
            assert streamed >= 3 and "T-1 ok" in result.stdout, result.stdout


def test_demo_report_names_the_dtype_and_the_time_to_first_result():
    """`TICKETQ_DTYPE=auto` chooses at start-up: the demo's table says what it chose, and how long the
    first result took against the mean forward pass."""
    from prometheus_client import CollectorRegistry, generate_latest
    from rich.console import Console

    from ticketq_bench.procs import parse_metrics
    from ticketq_cli.demo import report
    from worker.metrics import Metrics

    registry = CollectorRegistry()  # the worker's exposition, parsed as the demo parses /metrics
    worker_metrics = Metrics(registry)
    worker_metrics.model.info({"model": "m", "standin": "true", "dtype": "bfloat16", "device": "cpu"})
    for seconds in (0.5, 1.5):  # two forward batches, mean 1 s
        worker_metrics.batch_size.observe(3)
        worker_metrics.forward.observe(seconds)
    metrics = parse_metrics(generate_latest(registry).decode())
    console = Console(record=True, width=250)
    results = [{"status": "ok", "label": "billing", "standin": True}] * 6
    report(console, results, 1.5, metrics, "http://127.0.0.1:1/metrics", "m", first_result_s=1.25)
    text = console.export_text()
    assert "ticketq demo — m on cpu/bfloat16" in text
    assert "2 (mean 3.0 tickets, 1.00 s)" in text, text
    assert "1.25 s after the first send (a forward pass: 1.00 s on average)" in text, text
    assert "bfloat16 (unchecked: labels may differ from float32's)" in text, text
    # re-checked: the share computed again in float32, from the results
    worker_metrics.model.info({"model": "m", "standin": "true", "dtype": "int8", "device": "cpu", "recheck": "true"})
    metrics = parse_metrics(generate_latest(registry).decode())
    results = [{"status": "ok", "label": "billing", "rechecked": i < 2} for i in range(8)]
    console = Console(record=True, width=250)
    report(console, results, 1.5, metrics, "http://127.0.0.1:1/metrics", "m", first_result_s=1.25)
    assert "int8, re-checked in float32: 2 of 8 tickets computed again (25.0%); labels are float32's" in (
        console.export_text())
