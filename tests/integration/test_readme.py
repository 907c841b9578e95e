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
import shlex
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
DOCUMENTED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Programs the docs run that this environment need not have (a container host's, a cluster's).
ELSEWHERE = {"docker", "kubectl", "helm", "sudo", "prometheus", "promtool", "alertmanager", "amtool"}
OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", "|&"}

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



def documented_command_lines() -> list[tuple[str, str]]:
    """(file, line) for each command line of every ```bash block of the README and docs/: comments,
    blank lines and here-document bodies dropped, continued lines joined."""
    found = []
    for path in DOCUMENTED:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S):
            heredoc_end = None
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if heredoc_end is not None:
                    heredoc_end = None if line.strip() == heredoc_end else heredoc_end
                    continue
                code = line.split("  #", 1)[0].strip()
                if code and not code.startswith("#"):
                    found.append((path.name, code))
                    if match := re.search(r"<<-?'?(\w+)'?", code):
                        heredoc_end = match.group(1)
    return found


def program_words(code: str) -> list[str]:
    """The word that names the program of each command of a shell line (after VAR=value words)."""
    lexer = shlex.shlex(code, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words, starts = [], True
    for token in lexer:
        if token in OPERATORS:
            starts = True
        elif starts and not re.match(r"^[A-Za-z_]\w*=", token):
            words.append(token)
            starts = False
    return words


def test_every_documented_command_line_runs_as_pasted():
    """No synopsis in a command block: `ticketq dead list | show ID | ...` pasted is a pipe into
    programs named `show` and `requeue` (exit 127), and `[--prefill]` is an argument no program takes."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    bad = []
    for name, code in documented_command_lines():
        for word in program_words(code):
            known = word in ELSEWHERE or shutil.which(word, path=path) or subprocess.run(
                ["bash", "-c", f"type -t {shlex.quote(word)}"], capture_output=True).returncode == 0  # fmt: skip
            if not known:
                bad.append(f"{name}: {code!r}: {word!r} is no program")
        bad += [f"{name}: {code!r}: {word!r} is a synopsis" for word in shlex.split(code, comments=True)
                if re.fullmatch(r"\[-.*\]", word)]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_documented_redis_servers_keep_their_files_out_of_the_repository():
    """A `redis-server` that persists (AOF or RDB snapshots) is given a `--dir`: its files would
    otherwise land in whatever folder the reader pasted it in, the repository's most likely."""
    persisting = [(name, code) for name, code in documented_command_lines() if code.startswith("redis-server")
                  and ("--appendonly yes" in code or '--save ""' not in code)]  # fmt: skip
    assert persisting, "the docs start no redis-server of their own any more: drop this test"
    assert [(name, code) for name, code in persisting if "--dir " not in code] == []
