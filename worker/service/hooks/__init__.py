"""Observers of the service's pipeline, as dramatiq's middleware: the core calls each hook at its
point, and metrics, the progress record, the live cost model, the shadow check and dead-letter
accounting each attach as one small `Hook` (a module each beside this one).

Hooks run on the classifying thread, in the order given, and must be quick: whatever is slow (the
shadow check, a cost refit) is handed to a thread of its own. A hook that raises is logged and
counted (`Hooks.errors`), as dramatiq's `emit_before`/`emit_after` log a failing middleware, and
the job carries on: an observer never fails the work it observes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ticketq.contract import TicketRejected
from worker.results import BatchReport

log = logging.getLogger(__name__)


class Hook:
    """Every point the service reports; each does nothing here, a hook overrides the ones it needs."""

    def on_job_start(self) -> None:
        """A job (one drained buffer and its arrivals) begins: work is in hand."""

    def on_job_end(self) -> None:
        """The job is over, answered or failed: nothing in hand."""

    def on_compute(self, slots: Sequence[Any]) -> None:
        """These slots (`records.Slot`) go to the engine: their queue wait ends."""

    def on_forward(self, report: BatchReport) -> None:
        """A forward batch was computed."""

    def on_answer(self, slot: Any, answer: Any) -> None:
        """The engine answered `slot`'s ticket (a `Prediction`, or `TicketFields` for a schema)."""

    def on_cache_lookup(self, hits: int, misses: int) -> None:
        """The answer cache was asked for tickets: `hits` answered from it, `misses` to compute."""

    def on_publish(self, seconds: float) -> None:
        """One publish (stream, backend, acks) is done, in `seconds`."""

    def on_first_result(self, seconds: float) -> None:
        """The job's first result is out, `seconds` after the job began."""

    def on_results(self, slots: Sequence[Any]) -> None:
        """These slots' results were streamed by this worker: tickets done (each counted once)."""

    def on_repeats(self, count: int) -> None:
        """`count` results were already published by an earlier run of their message: not again."""

    def on_dead_letter(self, entry: dict[str, str], rejection: TicketRejected) -> None:
        """An entry went to the dead-letter stream."""


class Hooks(Hook):
    """Several hooks as one: each call goes to every hook, in order (None entries are skipped); a
    hook that raises is logged and counted in `errors`, and the others are still called."""

    def __init__(self, hooks: Iterable[Hook | None] = ()) -> None:
        self.hooks = [hook for hook in hooks if hook is not None]
        self.errors: Counter[tuple[str, str]] = Counter()  # (hook class, point) -> calls that raised

    def _emit(self, point: str, call: Callable[[Hook], None]) -> None:
        for hook in self.hooks:
            try:
                call(hook)
            except Exception:
                self.errors[type(hook).__name__, point] += 1
                log.exception("hook %s failed in %s; the job carries on", type(hook).__name__, point)

    @property
    def error_count(self) -> int:
        """Hook calls that raised since this worker started (what a metric exports)."""
        return sum(self.errors.values())

    def on_job_start(self) -> None:
        self._emit("on_job_start", lambda hook: hook.on_job_start())

    def on_job_end(self) -> None:
        self._emit("on_job_end", lambda hook: hook.on_job_end())

    def on_compute(self, slots: Sequence[Any]) -> None:
        self._emit("on_compute", lambda hook: hook.on_compute(slots))

    def on_forward(self, report: BatchReport) -> None:
        self._emit("on_forward", lambda hook: hook.on_forward(report))

    def on_answer(self, slot: Any, answer: Any) -> None:
        self._emit("on_answer", lambda hook: hook.on_answer(slot, answer))

    def on_cache_lookup(self, hits: int, misses: int) -> None:
        self._emit("on_cache_lookup", lambda hook: hook.on_cache_lookup(hits, misses))

    def on_publish(self, seconds: float) -> None:
        self._emit("on_publish", lambda hook: hook.on_publish(seconds))

    def on_first_result(self, seconds: float) -> None:
        self._emit("on_first_result", lambda hook: hook.on_first_result(seconds))

    def on_results(self, slots: Sequence[Any]) -> None:
        self._emit("on_results", lambda hook: hook.on_results(slots))

    def on_repeats(self, count: int) -> None:
        self._emit("on_repeats", lambda hook: hook.on_repeats(count))

    def on_dead_letter(self, entry: dict[str, str], rejection: TicketRejected) -> None:
        self._emit("on_dead_letter", lambda hook: hook.on_dead_letter(entry, rejection))
