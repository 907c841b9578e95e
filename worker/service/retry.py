"""The engine-error retry policy: the tickets of a forward that failed are retried in halves, down
to single tickets, each single ticket up to max_retries more times, then given up.

Cost: a healthy forward pays nothing. One bad ticket among a forward's n costs about 2·log2(n) extra engine calls
(the halves that hold it) plus max_retries alone; the good halves are answered on the way. Worst
case, every ticket failing: 2n - 1 calls to reach single tickets, then n·max_retries more, each
ticket computed log2(n) + 1 + max_retries times, before each is answered `engine_error`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


def retry_in_halves(
    open_: list[T],
    attempt: int,
    max_retries: int,
    error: Exception,
    run: Callable[[list[T], int], None],
    give_up: Callable[[T, int, Exception], None],
) -> None:
    """After `error` on attempt `attempt`: `run(part, attempt)` each half of `open_`, or a single
    ticket again as attempt + 1 while attempt <= max_retries, else `give_up(ticket, attempt, error)`."""
    if len(open_) > 1:
        log.warning("engine failed on %d tickets (%r); retrying in halves", len(open_), error)
        middle = len(open_) // 2
        run(open_[:middle], attempt)
        run(open_[middle:], attempt)
    elif len(open_) == 1 and attempt <= max_retries:
        run(open_, attempt + 1)
    elif open_:
        give_up(open_[0], attempt, error)
