"""docs/architecture.md's room table against the tree: every module it names exists, and every
module of the packages is named (a file, or a folder the table names whole, as `hooks/`).

A row's first path is from the repository root; the names after it, and the rows after it that
give bare names, are in that path's folder, until a row names another root path.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ticketq", "producer", "gateway", "worker", "ticketq_bench", "ticketq_cli")


def room_table(text: str) -> list[str]:
    """The module cells of the table whose header is `| room | module | owns |`."""
    lines = text[text.index("| room | module | owns |"):].splitlines()[2:]
    return [line.strip("|").split("|")[1] for line in lines if line.startswith("|")]


def named_paths(cells: list[str]) -> set[str]:
    named, folder = set(), ""
    for cell in cells:
        for token in re.findall(r"`([^`\s]+)`", cell):
            if not (token.endswith((".py", "/")) or "/" in token):
                continue  # a name in the cell, not a module
            if (ROOT / token.split("/")[0]).is_dir() and "/" in token:
                path = token
                folder = token if token.endswith("/") else token.rsplit("/", 1)[0] + "/"
            elif folder:
                path = folder + token
            else:
                continue
            named.add(path)
    return named


def modules() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if path.name not in ("__init__.py", "__main__.py")}  # fmt: skip


def test_every_named_module_exists():
    named = named_paths(room_table((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")))
    assert not sorted(path for path in named if not (ROOT / path).exists()), "named in the room table, not in the tree"


def test_every_module_is_in_the_room_table():
    named = named_paths(room_table((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")))
    folders = tuple(path for path in named if path.endswith("/"))
    missing = sorted(path for path in modules() if path not in named and not path.startswith(folders))
    assert not missing, f"modules the room table of docs/architecture.md does not name: {missing}"


def test_the_parser_reads_rows_and_folders():
    cells = ["`worker/service/core.py`", "`loop.py`, `hooks/`", "`worker/app/__init__.py` → `runtime.py`"]
    assert named_paths(cells) == {"worker/service/core.py", "worker/service/loop.py", "worker/service/hooks/",
                                  "worker/app/__init__.py", "worker/app/runtime.py"}  # fmt: skip
