"""Shared fixtures: the tiny stand-in model (built once per test run) and an engine on it.

Both tiers use them: tests/unit (no Redis, no worker process) and tests/integration (marked
`integration`); tests/support holds the helpers, imported by name (pyproject's pytest `pythonpath`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny stand-in: real Qwen2 tokenizer and chat template, two small random layers."""
    from ticketq_cli.standin import build

    cached = os.environ.get("TICKETQ_TEST_TINY_MODEL")
    if cached and Path(cached, "config.json").is_file():
        return Path(cached)
    return build("tiny", tmp_path_factory.mktemp("tiny-standin"), seed=0)


@pytest.fixture(scope="session")
def tiny_settings(tiny_model_dir):
    from worker.settings import Settings

    # One torch thread: on a busy 2-core machine it is far faster than two for one-at-a-time calls.
    # torch's own GEMM, not `auto`: two engines built from these settings must run the same kernels
    # (auto measures at each start-up); the oneDNN path has its own tests (test_engine.py).
    # TICKETQ_TEST_DEVICE=cuda runs the engine tests on a GPU (docs/bench/gpu.sh); CPU otherwise.
    device = os.environ.get("TICKETQ_TEST_DEVICE", "cpu")
    # A precision a test names runs as named (TICKETQ_RECHECK=never); tests/unit/test_recheck.py re-checks.
    return Settings(model=str(tiny_model_dir), dtype="float32", device=device, threads=1, matmul="torch",
                    recheck="never")


@pytest.fixture(scope="session")
def tiny_engine(tiny_settings):

    from worker.engine.replicas import load_engine

    return load_engine(tiny_settings)


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server with AOF (fsync always): what a client saw acknowledged survives a
    kill, and the test may kill and restart it."""
    from workers import RedisServer

    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, aof=True).start()
    yield server
    server.kill()


@pytest.fixture
def volatile_redis_server(tmp_path):
    """A private redis-server without persistence: killed and started again, it comes back empty
    (Redis losing its data, as a restart without AOF does)."""
    from servers import require_redis_server
    from workers import RedisServer

    require_redis_server()
    server = RedisServer(tmp_path, aof=False).start()
    yield server
    server.kill()
