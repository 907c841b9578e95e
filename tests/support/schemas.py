"""Schemas the integration tests serve besides examples/: written as a worker reads them (TOML)."""

from __future__ import annotations

from pathlib import Path

# every answer of this schema goes to review: no confidence reaches a threshold of 1
REVIEW_ALL = """
name = "review-all"
[fields.team]
instruction = "Which team should handle the ticket?"
labels = ["billing", "technical", "account"]
threshold = 1.0
"""


def write_review_all(workdir: Path) -> Path:
    """REVIEW_ALL as `workdir/review-all.toml` (for TICKETQ_SCHEMAS): the file's path."""
    path = workdir / "review-all.toml"
    path.write_text(REVIEW_ALL)
    return path
