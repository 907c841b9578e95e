"""Process-wide helpers shared by producers and workers (plain Python: no torch, no Celery)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]


@contextmanager
def paused_gc(freeze: bool = False) -> Iterator[None]:
    """No cyclic garbage collection inside (reference counting still frees what is dropped); with
    `freeze`, what exists then is never scanned again.

    A bulk producer's wait holds tens of thousands of decoded results (acyclic JSON), and every
    automatic collection walked them all again: a third of its CPU.

    Importing torch and transformers and building the tokenizer (transformers parses its 150k-token
    vocabulary and merges in Python) make about 900,000 container objects, nearly all of which live
    as long as the process; with the collector on, each burst of them sets off collections that scan
    them again: from a bare process to the loaded tiny stand-in, 2,100 collections and 1.8 s of
    collector time, 6.7 s of CPU in all against 4.4 s with it paused (2-core EPYC). `freeze`
    (`gc.freeze`) suits a process that has just started: what it has made then lives as long as
    it does, and later collections skip it, where the first one after the pause would scan all of
    it (0.3 s). An inner call leaves the collector to the outer one.
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
