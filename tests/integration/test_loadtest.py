"""The open-loop load test runs end to end (null classifier, a real worker, the real Redis) and reports every field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest
from workers import ROOT, redis_or_skip

from ticketq_bench.loadtest import RateResult, Report, main, percentile

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/3"


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (50.0, 95.0, 99.0)
    assert percentile([0.7], 99) == 0.7


def test_loadtest_reports_every_field(tmp_path):
    redis_or_skip(REDIS_URL).close()
    out, png = tmp_path / "loadtest.json", tmp_path / "loadtest.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    command = [sys.executable, "-m", "ticketq_bench.loadtest", "--null", "--duration", "2", "--rates", "0.5,1.0",
               "--capacity", "20", "--pool", "50", "--broker-url", REDIS_URL,
               "--json", str(out), "--chart", str(png)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {f.name for f in fields(Report)}
    assert report["model"] == "null-classifier" and report["capacity_per_s"] == 20 and not report["capacity_measured"]
    assert [rate["fraction"] for rate in report["rates"]] == [0.5, 1.0]
    for rate in report["rates"]:
        assert set(rate) == {f.name for f in fields(RateResult)}
        assert rate["sent"] > 0 and rate["completed"] == rate["sent"] and rate["failed"] == 0
        assert 0 <= rate["p50_s"] <= rate["p95_s"] <= rate["p99_s"]
        assert rate["time_to_first_result_s"] > 0 and rate["items_per_s"] > 0 and rate["forwards"] > 0
    assert png.stat().st_size > 0
    assert "| 0.50× |" in done.stdout
    assert report["machine"]["worker"] == {"dtype": "-", "device": "-", "matmul": "-"}, "what the worker ran"


def test_model_info_reads_what_a_worker_runs():
    from prometheus_client import CollectorRegistry, generate_latest

    from ticketq_bench.procs import model_info, parse_metrics
    from worker.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    metrics.model.info({"model": "m", "standin": "true", "dtype": "float32", "device": "cpu", "matmul": "onednn"})
    parsed = parse_metrics(generate_latest(metrics.registry).decode())
    assert model_info(parsed) == {"model": "m", "standin": "true", "dtype": "float32", "device": "cpu",
                                  "matmul": "onednn"}  # fmt: skip
    assert model_info({}) == {}


def test_bad_options_exit_2_before_anything_starts():
    """`ticketq loadtest` and `python -m ticketq_bench.loadtest` share one typer command: the same checks."""
    for argv in (["--rates", "0,1"], ["--rates", "x"], ["--duration", "0"], ["--capacity", "-1"],
                 ["--capacity-tickets", "0"]):  # fmt: skip
        assert main(argv) == 2, argv
