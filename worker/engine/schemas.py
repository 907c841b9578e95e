"""The schemas one worker serves: tickets naming different schemas in one run, no prefix recomputed.

A `SchemaSet` holds the worker's schemas by name and, for the ones in use, their compiled
`FieldsEngine`s (each with its own cached prefix, computed once), bounded: past `capacity` the
least recently used one is dropped, and built again (its prefix computed again) when a ticket
names it next. The engine's own single field (`Engine.schema`, `TICKETQ_LABELS`) is served by the
`Engine` itself, so its answers stay the `Prediction`s ticketq has always published.

`classify` takes (schema name, text) pairs and runs them as one `PlannedRun` (offline; a worker
runs `runner(name)`'s tickets in its own loop, `worker.service.loop`): each schema's
tickets are planned and batched together (a forward holds one schema's tickets, after that
schema's cached prefix), the schemas take turns oldest ticket first, and arrivals of any schema
join between forwards.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ticketq.errors import TicketqError
from ticketq.schema import Schema
from worker.engine.fields import FieldsEngine
from worker.engine.model import Engine
from worker.engine.scheduler import PlannedRun, Ticketed, drain
from worker.results import BatchReport

log = logging.getLogger(__name__)

Item = tuple[str, object]  # (schema name, ticket text)


class UnknownSchema(TicketqError, KeyError):
    """A ticket named a schema this worker does not serve; the message names the ones it does."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name, self.known = name, tuple(known)
        super().__init__(name)

    def __str__(self) -> str:
        return f"no schema named {self.name!r} here; this worker serves: {', '.join(self.known)}"


class SchemaSet:
    """`schemas` on `engine`'s model (the first one is what a ticket naming none gets)."""

    def __init__(self, engine: Engine, schemas: Sequence[Schema], capacity: int = 8) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        own = engine.schema
        self.engine = engine
        self._schemas: dict[str, Schema] = {}
        for schema in (*schemas, *([own] if own is not None else [])):
            if self._schemas.setdefault(schema.name, schema) is not schema and schema is not own:
                raise ValueError(f"two schemas are named {schema.name!r}: every schema needs its own name")
        if not self._schemas:
            raise ValueError("a SchemaSet needs at least one schema")
        self.names = tuple(self._schemas)
        self.default = self.names[0]
        self.capacity = capacity
        self._runners: OrderedDict[str, FieldsEngine] = OrderedDict()
        self.prefixes_computed = 0  # FieldsEngines built (each computes its prefix once)

    def schema(self, name: str) -> Schema:
        try:
            return self._schemas[name]
        except KeyError:
            raise UnknownSchema(name, self.names) from None

    def __contains__(self, name: object) -> bool:
        return name in self._schemas

    def runner(self, name: str) -> Engine | FieldsEngine:
        """What computes `name`'s tickets: the engine for its own field, else the schema's FieldsEngine."""
        schema = self.schema(name)
        if schema is self.engine.schema:
            return self.engine
        runner = self._runners.get(name)
        if runner is not None:
            self._runners.move_to_end(name)
            return runner
        runner = self._runners[name] = self.engine.compile(schema)
        self.prefixes_computed += 1
        if len(self._runners) > self.capacity:
            dropped, _ = self._runners.popitem(last=False)
            log.info("schema %s: cached prefix dropped (TICKETQ_SCHEMA_CACHE=%d schemas in use at most)",
                     dropped, self.capacity)  # fmt: skip
        return runner

    def classify(
        self,
        items: Sequence[Item],
        on_batch: Callable[[BatchReport], None] | None = None,
        on_answers: Callable | None = None,
        more: Callable[[], Sequence[Item]] | None = None,
    ) -> tuple[list, list[BatchReport]]:
        """The answer for each (schema name, text) of `items` then of what `more()` returns between
        forwards (`TicketFields`, or `Prediction` for the engine's own field), in that order; as
        `Engine.classify` (`on_answers(indices, answers)` once per forward). `UnknownSchema` for a
        name not served (the caller checks names first: `name in schema_set`)."""
        run = PlannedRun(dedup=self.engine.dedup)
        run.add(self._encode(items))
        arrivals = (lambda: self._encode(more())) if more is not None else None
        return drain(run, on_batch, on_answers, arrivals)

    def _encode(self, items: Sequence[Item]) -> list[Ticketed]:
        """(runner, encoded ticket) per item, each schema's texts encoded by its own prompt."""
        runners: dict[str, Engine | FieldsEngine] = {}
        pairs = []
        for name, text in items:
            runner = runners.get(name) or runners.setdefault(name, self.runner(name))
            pairs.append(Ticketed(runner, runner.prompt.encode(text)))
        return pairs
