"""Schema routing: which schema answers a ticket, what the engine takes for it, and where it is computed.

With TICKETQ_SCHEMAS on a classifier that can compile them (`worker.engine.schemas.SchemaSet`),
a ticket names its schema or gets the set's default; else only the classifier's own schema is
served, and a ticket naming another is refused `unknown_schema`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from ticketq.contract import Reason, Ticket, TicketRejected
from ticketq.schema import DEFAULT_SCHEMA_NAME
from worker.engine.scheduler import BatchEngine, Ticketed
from worker.service.ports import Classifier
from worker.settings import Settings

log = logging.getLogger(__name__)


class Routing:
    def __init__(self, classifier: Classifier, schemas: Any = None) -> None:
        """`schemas`: a `SchemaSet` on `classifier`'s model, or None (its own field only)."""
        self.classifier, self.schemas = classifier, schemas
        own = classifier.schema
        self.known = schemas.names if schemas else (own.name if own else DEFAULT_SCHEMA_NAME,)

    @classmethod
    def of(cls, classifier: Classifier, settings: Settings) -> Routing:
        return cls(classifier, _schema_set(classifier, settings))

    def route(self, ticket: Ticket) -> str | None:
        """The schema `ticket` is answered with (None: the classifier's own field); `unknown_schema`
        for a name this worker does not serve."""
        if self.schemas is not None:
            name = ticket.schema or self.schemas.default
            if name in self.schemas:
                return name
        elif ticket.schema is None or ticket.schema == self.known[0]:
            return None
        served = ", ".join(self.known)
        raise TicketRejected(Reason.UNKNOWN_SCHEMA, f"no schema named {ticket.schema!r} here; this worker serves: "
                                                    f"{served} (TICKETQ_SCHEMAS)")  # fmt: skip

    def runner(self, schema: str | None) -> BatchEngine[Any]:
        """What computes `schema`'s tickets: the classifier for its own field, else the schema's runner."""
        if self.schemas is None or schema is None:
            return self.classifier
        return self.schemas.runner(schema)

    def ticketed(self, slots: Sequence[Any]) -> list[Ticketed]:
        """Each slot's ticket encoded by the runner of its schema, keyed by the slot."""
        runners: dict[str | None, BatchEngine[Any]] = {}
        tickets = []
        for slot in slots:
            runner = runners.get(slot.schema) or runners.setdefault(slot.schema, self.runner(slot.schema))
            (encoded,) = runner.encode([slot.ticket.text])
            tickets.append(Ticketed(runner, encoded, slot))
        return tickets

    def reference(self, schema: str | None) -> Callable[[str], Any]:
        """The unbatched reference path `schema`'s answers are held to, float32's where its runner is a
        checked fast precision (not thread-safe: the classifying thread only)."""
        return self.runner(schema).policy.reference


def _schema_set(classifier: Classifier, settings: Settings) -> Any:
    """The `SchemaSet` of TICKETQ_SCHEMAS on the classifier's model, or None (no schemas, or a
    classifier without a model to compile them on, e.g. the null classifier)."""
    schemas = settings.load_schemas()
    if not schemas:
        return None
    if not classifier.compiles:
        log.warning("TICKETQ_SCHEMAS ignored: %s answers its own labels only", type(classifier).__name__)
        return None
    from worker.engine.schemas import SchemaSet

    schema_set = SchemaSet(classifier, schemas, settings.schema_cache)
    log.info("schemas served: %s (tickets naming none: %s)", ", ".join(schema_set.names), schema_set.default)
    if classifier.policy.checked:  # a fast precision: each schema's bound before any job
        for name in schema_set.names[: schema_set.capacity]:
            schema_set.runner(name)  # calibrated at the first start on a machine, read from the cache after
    return schema_set
