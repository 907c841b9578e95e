"""Size habits, as a ratchet: a room that grows past a screen or two of reading holds two jobs.

Files ≤ 400 lines, classes ≤ 150, functions ≤ 50, constructors ≤ 7 parameters (else a record).
Read from the source (the AST), every package of the repository. What is over its limit today is
named in ALLOWED with the size it has now, as a ceiling, and why it is still whole: it may shrink,
never grow, and a new one fails. When an entry comes under its limit the test says to drop it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ticketq", "producer", "gateway", "worker", "ticketq_bench", "ticketq_cli")
LIMITS = {"file": 400, "class": 150, "function": 50, "constructor": 7}

# (kind, "path[:name]") -> (its size now, the ceiling; why it is still whole)
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("file", "worker/transport/fetch.py"): (523, "kombu's channel subclassed: fetch, record, delivery share its state"),
    ("class", "worker/transport/fetch.py:Channel"): (345, "one kombu class overridden; the split waits for kombu's"),
    ("class", "worker/engine/model.py:Engine"): (201, "the model's one replica: prefix cache, batched path with its "
                                                      "label-trie continuations, reference, schema compile"),
}


def sizes(root: Path = ROOT) -> Iterator[tuple[str, str, int]]:
    """(kind, where, size) of every file, class, function and constructor of the packages."""
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            where = path.relative_to(root).as_posix()
            yield "file", where, len(source.splitlines())
            yield from _defs(ast.parse(source), where, "")


def _defs(tree: ast.AST, where: str, prefix: str) -> Iterator[tuple[str, str, int]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            size = node.end_lineno - node.lineno + 1
            if isinstance(node, ast.ClassDef):
                yield "class", f"{where}:{name}", size
            else:
                yield "function", f"{where}:{name}", size
                if node.name == "__init__":
                    args = node.args
                    params = [a for a in (*args.posonlyargs, *args.args, *args.kwonlyargs) if a.arg != "self"]
                    yield "constructor", f"{where}:{name}", len(params)
            yield from _defs(node, where, f"{name}.")


def over(found: Iterator[tuple[str, str, int]]) -> dict[tuple[str, str], int]:
    return {(kind, where): size for kind, where, size in found if size > LIMITS[kind]}


def test_nothing_grows_past_its_limit_or_its_ceiling():
    found = over(sizes())
    new = {key: size for key, size in found.items() if key not in ALLOWED}
    grown = {key: (size, ALLOWED[key][0]) for key, size in found.items() if key in ALLOWED and size > ALLOWED[key][0]}
    assert not new, f"over the size limits {LIMITS}: split it, or name it in ALLOWED with why: {new}"
    assert not grown, f"grown past its ceiling (now, ceiling): {grown}"


def test_an_entry_that_came_under_its_limit_leaves_the_list():
    found = over(sizes())
    stale = sorted(key for key in ALLOWED if key not in found)
    assert not stale, f"under the limit now: drop from ALLOWED {stale}"


def test_the_ratchet_fails_on_a_new_or_grown_room(tmp_path):
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "big.py").write_text("x = 1\n" * 401 + "class A:\n" + "    y = 1\n" * 150)
    found = over(sizes(tmp_path))
    assert found == {("file", "worker/big.py"): 552, ("class", "worker/big.py:A"): 151}
