"""Process-wide helpers shared by producers and workers (plain Python: no torch, no Celery)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["bar_disabled", "paused_gc"]


@contextmanager
def paused_gc(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees what is dropped); with
    `freeze`, what exists then is never scanned again.

    A bulk producer's wait holds tens of thousands of decoded results (acyclic JSON) that every
    automatic collection would walk again; loading torch, transformers and the tokenizer makes
    hundreds of thousands of long-lived containers whose bursts set off collections that scan them
    again (figures: docs/performance.md, "The cyclic collector"). `freeze` (`gc.freeze`) suits a
    process that has just started: what it has made then lives as long as it does, and later
    collections skip it. An inner call leaves the collector to the outer one.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()


def bar_disabled(wanted: bool) -> bool | None:
    """tqdm's `disable` for a progress bar: off unless `wanted`, and then drawn only where stderr is a
    terminal (tqdm's None): no frames of carriage returns in a pipe or a log."""
    return None if wanted else True
