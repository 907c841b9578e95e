"""The two command-line programs run as a user runs them: one call in a fresh process.

`ticketq` and `ticketq-produce` are run as `python -m MODULE`, so the tree under test is the one
that runs (PYTHONPATH), with TICKETQ_* taken only from the caller's `env`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from workers import ROOT


def run(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 300):
    """One CLI call in a fresh process; TICKETQ_* comes only from `env`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    clean.update({"PYTHONUNBUFFERED": "1", "COLUMNS": "80", **(env or {})})
    program, *rest = args
    module = {"ticketq": "ticketq_cli.cli", "ticketq-produce": "producer.cli"}[program]
    return subprocess.run([sys.executable, "-m", module, *rest], env=clean, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def sigint_as_in_a_terminal() -> None:
    """`preexec_fn` of a command a test stops with SIGINT as Ctrl-C stops it in a terminal.

    A process started with SIGINT ignored keeps it ignored, and Python then installs no
    KeyboardInterrupt handler: a runner started in the background by a non-interactive shell
    (`make test &`, nohup, some CI agents) hands that on to every command, which then runs to its
    end through the test's SIGINT. The command starts with the default, as it would from a shell
    prompt, whatever the runner's.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def engine_env(model_dir: Path) -> dict[str, str]:
    """The settings that run the engine on `model_dir` as the tests' fixtures do: CPU, float32, one thread."""
    return {"TICKETQ_MODEL": str(model_dir), "TICKETQ_DEVICE": "cpu", "TICKETQ_DTYPE": "float32",
            "TICKETQ_THREADS": "1"}  # fmt: skip
