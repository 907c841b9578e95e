"""The README's shell blocks run as written, in order, as a newcomer types them.

Every ```bash block but the quick start's (`make demo`, `make test`: what CI itself runs, and a
test cannot run the suite it is part of) is run line by line in a copy of the repository's
`examples/`, with the programs of this environment on PATH and a private Redis: `ticketq worker`
in the background (its line must be exactly that), every other line in the foreground, each of
them exiting 0. The worker runs on the tiny stand-in, so the labels mean nothing; the commands'
promises are what is checked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from contextlib import nullcontext
from pathlib import Path

import pytest
from workers import ROOT, RedisServer, running_worker, worker_env

README = (ROOT / "README.md").read_text(encoding="utf-8")
QUICK_START = ("make demo", "make test")

pytestmark = pytest.mark.integration


def shell_blocks() -> list[list[str]]:
    """Each ```bash block of the README as its command lines (comments and blank lines dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [[line.split("  #", 1)[0].strip() for line in block.splitlines()] for block in blocks]
    return [[line for line in block if line and not line.startswith("#")] for block in lines]


def test_the_readme_has_the_two_commands_and_a_block_to_run():
    blocks = shell_blocks()
    assert [line.split()[:2] for line in blocks[0]] == [command.split() for command in QUICK_START]
    assert len(blocks) > 1 and "ticketq worker" in blocks[1]


def test_the_readme_shell_blocks_run_in_order(tmp_path, tiny_model_dir):
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis", aof=False).start()
    try:
        work = tmp_path / "work"
        shutil.copytree(ROOT / "examples", work / "examples")
        env = worker_env(tiny_model_dir, server.url, f"readme-{uuid.uuid4().hex[:8]}", TICKETQ_MATMUL="torch")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        for block in shell_blocks()[1:]:
            background = [line for line in block if line == "ticketq worker"]
            with running_worker(env, tmp_path / "worker.log") if background else nullcontext():
                for line in block:
                    if line == "ticketq worker":
                        continue
                    result = subprocess.run(["bash", "-c", line], cwd=work, env=env, capture_output=True, text=True,
                                            timeout=300)  # fmt: skip
                    assert result.returncode == 0, f"README line failed: {line}\n{result.stdout}\n{result.stderr}"
        assert (work / "produced.jsonl").is_file() and (work / "classified.jsonl").is_file()
    finally:
        server.kill()

