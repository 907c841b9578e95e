"""Memory over many batch shapes, for real: the oneDNN engine's RSS stays put.

oneDNN and ideep (torch's wrapper) cache a primitive per (M, K, N), M the rows x width of a
forward batch, 1,024 of each by default at 0.3-0.6 MB an entry: a worker grew by 0.5-0.7 GB.
`worker.engine.kernels` caps both when it is imported. Both read their capacity once per process,
at the first primitive, so the check runs in a fresh interpreter with neither variable set.
Long runs: docs/bench/soak.py; findings: docs/bench/soak.md.

Rounds through a real worker with every default on (the live cost model refitting in the
background among them): docs/bench/worker_rounds.py, checked here over 3 short rounds; its 20 x 600
figures are in docs/performance.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workers import redis_or_skip

from worker.engine.kernels import ONEDNN_CACHE_VARIABLES, PackedLinear
from worker.settings import Settings

pytestmark = pytest.mark.integration

ROOT = str(Path(__file__).resolve().parents[2])
WARM_SHAPES = 30  # batch shapes run before the first reading: the capped caches are full by then
MEASURED_SHAPES = 100  # new batch shapes between the two readings: +0.2 GB without the caps, +0-10 MB with
MAX_GROWTH_MB = 60

CHILD = """
import json, sys
from pathlib import Path
from worker.engine import Engine
from worker.settings import Settings
from worker.engine.replicas import load_engine

def rss_mb():
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024

model, warm, measured = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = load_engine(Settings(model=model, dtype="float32", device="cpu", threads=1, matmul="onednn"))
row = engine.encode(["Please reset my password"])[0]
shapes = [(rows, width) for width in range(len(row.ids), 400) for rows in (1, 2, 3)]
shapes = list({rows * width: (rows, width) for rows, width in shapes}.values())  # one per M = rows x width
readings = []
for index, (rows, width) in enumerate(shapes[: warm + measured]):
    if index == warm:
        readings.append(rss_mb())
    engine.forward_batch([row] * rows, width=width)
readings.append(rss_mb())
print(json.dumps({"matmul": engine.info.matmul, "rss_mb": readings}))
"""


@pytest.mark.skipif(not PackedLinear.available(), reason="this torch has no oneDNN linear ops")
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc (Linux)")
def test_rss_stays_flat_across_many_batch_shapes_on_onednn(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_model_dir), str(WARM_SHAPES), str(MEASURED_SHAPES)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = result["rss_mb"]
    print(f"RSS {before:.0f} -> {after:.0f} MB over {MEASURED_SHAPES} new batch shapes ({result['matmul']})")
    assert result["matmul"] == "onednn"
    assert after - before < MAX_GROWTH_MB, f"RSS grew {after - before:.0f} MB over {MEASURED_SHAPES} batch shapes"


def test_rounds_through_a_worker_with_every_default_on_are_answered_and_refit_its_cost_model(tiny_model_dir):
    """docs/bench/worker_rounds.py, 3 rounds of 600: every ticket answered (exit 2 otherwise), the
    live cost model refitted in the background and kept (50 forwards a refit, >= 40 forwards a
    round at the default token budget), no refit failed. Its timing targets are for a quiet machine:
    not asserted here (exit 1 where missed)."""
    broker_url = Settings().broker_url
    redis_or_skip(broker_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    env.update(TICKETQ_BROKER_URL=broker_url, PYTHONPATH=ROOT)
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "docs", "bench", "worker_rounds.py"), "--model", str(tiny_model_dir),
         "--rounds", "3", "--tickets", "600", "--timeout", "240"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    print(done.stdout)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 2, 3]
    assert int(rows[-1][5]) >= 1, "no live refit kept in 1,800 tickets"
    log_path = done.stdout.splitlines()[0].rpartition("; log ")[2]
    assert "live cost refit failed" not in Path(log_path).read_text(errors="replace")
