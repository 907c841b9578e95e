"""The README's exit-status table, command by command and error class by error class.

    0 every ticket or row classified         1 some failed (each reported)
    2 bad settings, options or input, or Redis unreachable or refusing us: nothing was done
    3 the input was read, but not one ticket was classified

Each case runs the real command in a fresh process and checks its status and that its message
names only options the command has (and the port actually used).
"""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from commands import run
from workers import RedisServer, free_port

pytestmark = pytest.mark.integration

DEAD = "redis://127.0.0.1:1/0"  # nothing listens on port 1
NULL = {"TICKETQ_NULL_CLASSIFIER": "1", "TICKETQ_METRICS_PORT": "0"}


def _files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "t.jsonl").write_text('{"id": "a", "text": "my invoice is wrong"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.csv").write_text("id,text\n")
    (tmp_path / "notamodel").mkdir()
    (tmp_path / "notamodel" / "config.json").write_text("{}")
    (tmp_path / "binary.jsonl").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "t.jsonl.gz").write_bytes(gzip.compress(b'{"id": "a", "text": "my invoice is wrong"}\n'))
    (tmp_path / "array.json").write_text('[\n  {"id": "a", "text": "my invoice is wrong"}\n]\n')
    names = ("t.jsonl", "empty.jsonl", "empty.csv", "notamodel", "binary.jsonl", "t.jsonl.gz", "array.json")
    return {name: tmp_path / name for name in names}


# (command, env, expected status, text the one-line message must hold, text it must not)
CASES = {
    "worker, Redis unreachable": (["ticketq", "worker"], {"TICKETQ_BROKER_URL": "redis://127.0.0.1:6599/0", **NULL},
                                  2, "redis-server --port 6599", "--broker-url"),
    "worker, invalid setting": (["ticketq", "worker"], {"TICKETQ_BATCH_WINDOW": "many", **NULL}, 2,
                                "TICKETQ_BATCH_WINDOW=many", None),
    "status, Redis unreachable": (["ticketq", "status"], {"TICKETQ_BROKER_URL": DEAD}, 2, "TICKETQ_BROKER_URL",
                                  "--broker-url"),
    "exporter, Redis unreachable": (["ticketq", "exporter", "--port", "0"], {"TICKETQ_BROKER_URL": DEAD}, 2,
                                    "redis-server --port 1", "--broker-url"),
    "config, invalid setting": (["ticketq", "config"], {"TICKETQ_LEASE_S": "-1"}, 2, "INVALID", None),
    "produce, Redis unreachable": (["ticketq-produce", "synthetic", "3", "--retry-for", "0"],
                                   {"TICKETQ_BROKER_URL": DEAD}, 2, "--broker-url", None),
    "produce, empty JSONL": (["ticketq-produce", "file", "{empty_jsonl}"], {"TICKETQ_BROKER_URL": DEAD}, 3, "", None),
    "produce, missing file": (["ticketq-produce", "file", "{missing}"], {}, 2, "cannot read", None),
    "classify, missing file": (["ticketq", "classify", "{missing}", "-o", "{out}"], {}, 2, "cannot read", None),
    "classify, empty JSONL": (["ticketq", "classify", "{empty_jsonl}", "-o", "{out}"], {}, 3, "", None),
    "classify, empty CSV": (["ticketq", "classify", "{empty_csv}", "-o", "{out}"], {}, 3, "", None),
    "produce, binary JSONL": (["ticketq-produce", "file", "{binary_jsonl}"], {"TICKETQ_BROKER_URL": DEAD}, 2,
                              "not a text file", "rows refused"),
    "classify, binary JSONL": (["ticketq", "classify", "{binary_jsonl}", "-o", "{out}"], {}, 2, "not a text file",
                               "rows failed"),
    "classify, gzip JSONL": (["ticketq", "classify", "{t_jsonl_gz}", "-o", "{out}"], {}, 2, "gzip-compressed",
                             "UTF-8 (byte"),
    "produce, JSON array": (["ticketq-produce", "file", "{array_json}"], {"TICKETQ_BROKER_URL": DEAD}, 2,
                            "a JSON array; ticket files are JSONL", "rows refused"),
    "eval, empty JSONL": (["ticketq", "eval", "{empty_jsonl}"], {"TICKETQ_MODEL": "/nonexistent/model"}, 3,
                          "no rows to score", "TICKETQ_MODEL"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_exit_status_and_message(case, tmp_path):
    args, env, status, says, never = CASES[case]
    names = {**{key.replace(".", "_"): str(path) for key, path in _files(tmp_path).items()},
             "missing": str(tmp_path / "nope.jsonl"),
             "out": str(tmp_path / "r.jsonl")}  # fmt: skip
    result = run([arg.format(**names) for arg in args], env, cwd=tmp_path, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == status, f"{case}: exit {result.returncode}\n{output[-2000:]}"
    assert says in output, output[-2000:]
    if never:
        assert never not in output, output[-2000:]
    assert "Traceback" not in output, output[-3000:]


def test_worker_with_a_wrong_password_or_a_directory_that_is_no_model_exits_2(tmp_path):
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, password="right", aof=False).start()
    try:
        wrong = server.url.replace(":right@", ":wrong@")
        refused = run(["ticketq", "worker"], {"TICKETQ_BROKER_URL": wrong, **NULL}, cwd=tmp_path, timeout=120)
        assert refused.returncode == 2 and "refused the credentials" in refused.stderr, refused.stderr[-2000:]
        model = _files(tmp_path)["notamodel"]
        env = {"TICKETQ_BROKER_URL": server.url, "TICKETQ_MODEL": str(model), "TICKETQ_METRICS_PORT": str(free_port()),
               "TICKETQ_DEVICE": "cpu", "TICKETQ_DTYPE": "float32"}  # fmt: skip
        no_model = run(["ticketq", "worker"], env, cwd=tmp_path, timeout=180)
        output = no_model.stdout + no_model.stderr
        assert no_model.returncode == 2, output[-3000:]
        assert "holds no loadable model" in output and "ticketq standin" not in output, output[-3000:]
    finally:
        server.kill()


def test_rediss_to_a_plain_redis_port_says_to_use_redis(tmp_path):
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, aof=False).start()
    try:
        tls = server.url.replace("redis://", "rediss://")
        result = run(["ticketq", "status"], {"TICKETQ_BROKER_URL": tls}, cwd=tmp_path, timeout=60)
        output = result.stdout + result.stderr
        assert result.returncode == 2, output[-2000:]
        assert "does not speak TLS" in output and "use redis://" in output, output[-2000:]
        assert len(result.stderr.strip().splitlines()) == 1, output[-2000:]
    finally:
        server.kill()


def test_a_misspelt_setting_is_named_with_the_closest_one(tmp_path):
    result = run(["ticketq", "config"], {"TICKETQ_MODLE": "models/x"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "TICKETQ_MODLE is not a ticketq setting and is ignored; did you mean TICKETQ_MODEL?" in result.stderr


def test_a_producer_names_a_misspelt_setting_but_not_a_worker_setting(tmp_path):
    env = {"TICKETQ_QEUE": "billing", "TICKETQ_MODEL": "models/x", "TICKETQ_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0"}
    result = run(["ticketq-produce", "synthetic", "3"], env, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr  # nothing listens there
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: TICKETQ_QEUE is not a ticketq setting and is ignored; did you mean TICKETQ_QUEUE?"]


def test_the_contract_names_exactly_the_settings_a_worker_adds():
    from ticketq.config import WORKER_SETTINGS, ClientSettings
    from worker.settings import Settings

    assert set(Settings.model_fields) - set(ClientSettings.model_fields) == WORKER_SETTINGS


def test_the_gateways_settings_are_no_misspellings_for_a_producer():
    """Every setting the gateway adds carries one of GATEWAY_PREFIXES, so a producer or worker that
    sees the gateway's environment names none of them as unknown."""
    from gateway.settings import GatewaySettings
    from ticketq.config import GATEWAY_PREFIXES, ClientSettings

    added = set(GatewaySettings.model_fields) - set(ClientSettings.model_fields)
    assert added and all(name.startswith(GATEWAY_PREFIXES) for name in added)
    environ = {f"TICKETQ_{name.upper()}": "x" for name in added}
    assert ClientSettings.unknown_names({**environ, "TICKETQ_GATEWAY_PROT": "1"}) == []


def test_plain_celery_with_another_pool_is_refused_in_one_line(tmp_path):
    """`celery -A worker.app worker --pool prefork -c 2` would run the batch function in parallel
    copies over one model: refused before the model loads, exit 2, naming the fix."""
    import os
    import subprocess
    import sys

    from workers import ROOT, worker_env

    env = {**worker_env(None, "redis://127.0.0.1:6379/0", f"pool-{free_port()}"), **NULL, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "worker.app", "worker", "--pool", "prefork", "-c",
                           "2"], cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "concurrency 2" in output and "--pool threads --concurrency 1" in output, output[-3000:]


def test_a_worker_without_the_model_hub_says_so_first_and_alone(tmp_path):
    """No Hub and a Hub id not in the cache: the one line naming `ticketq standin`, before Celery's
    banner, the kernel probes or Redis are touched (the broker here is not even listening)."""
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "TICKETQ_BROKER_URL": DEAD,
               "TICKETQ_METRICS_PORT": "0"}  # fmt: skip
    result = run(["ticketq", "worker"], offline, cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "ticketq standin" in lines[0] and "not reachable" in lines[0], lines


def test_a_setting_in_the_wrong_case_and_a_celery_variable_are_named_once(tmp_path):
    """`ticketq_model` is used (the environment is read case-insensitively) and CELERY_BROKER_URL is
    not: each says so once on stderr, and the latter names the setting to use."""
    env = {"ticketq_model": "models/x", "CELERY_BROKER_URL": "redis://elsewhere:6379/0"}
    result = run(["ticketq", "config"], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "TICKETQ_MODEL=models/x" in result.stdout.splitlines()
    lines = result.stderr.splitlines()
    assert [line for line in lines if "ticketq_model" in line] == [
        "ticketq_model is read as TICKETQ_MODEL (setting names are upper case); write it TICKETQ_MODEL"]
    assert [line for line in lines if "CELERY_BROKER_URL" in line] == [
        "CELERY_BROKER_URL is a Celery variable that ticketq does not read; set TICKETQ_BROKER_URL"]


def test_a_lookup_of_an_unknown_id_exits_3_whichever_command(tmp_path):
    """`result`, `dead show` and `dead requeue` of an id nothing has: 3 (read, nothing found), each
    with one line saying so; 1 is for some of several tickets failing."""
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, aof=False).start()
    try:
        env = {"TICKETQ_BROKER_URL": server.url}
        for args in (["result", "nope"], ["dead", "show", "nope"], ["dead", "requeue", "nope"]):
            result = run(["ticketq", *args], env, cwd=tmp_path, timeout=60)
            assert result.returncode == 3, (args, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1 and "nope" in result.stderr, (args, result.stderr)
    finally:
        server.kill()
