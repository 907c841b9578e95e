"""The answer cache as a stage (TICKETQ_ANSWER_CACHE_S): a ticket answered before is answered again
from Redis, not computed.

A ticket's digest is a hash of what its answer depends on: its canonical text
(`ticketq.contract.canonical_text`), the schema it is answered with (the whole schema, so a
changed label or instruction is another entry) and the model as this worker runs it (name,
precision and whether it is re-checked, ticket budget and truncation). Two workers that agree on
all of that share entries; any difference is a miss, never a wrong answer. Looked up once per
admitted slot (one MGET per job and per arrival), written once per computed forward (one script
call); the store is `worker.redis.answer_cache`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ticketq.contract import canonical_text
from ticketq.schema import FieldResult, TicketFields
from worker.redis.answer_cache import AnswerCache
from worker.results import Prediction
from worker.service.ports import Classifier
from worker.service.records import Slot
from worker.service.routing import Routing
from worker.settings import Settings


class CachedAnswers:
    def __init__(self, cache: AnswerCache, routing: Routing, classifier: Classifier, settings: Settings) -> None:
        self.cache, self.routing = cache, routing
        info = classifier.info
        # the schemas' field heads by digest (a refitted head in the same file: new keys)
        model = ([info.name, info.dtype, info.recheck, info.scorer, *([info.heads] if info.heads else [])]
                 if info is not None else [type(classifier).__name__, "-", False])  # fmt: skip
        self._model = [*model, settings.max_ticket_tokens, settings.truncation,
                       settings.label_names, settings.system_prompt, settings.label_descriptions]  # fmt: skip
        self._schemas: dict[str | None, str] = {}  # schema name (None: the classifier's own) -> its fingerprint

    def lookup(self, slots: Sequence[Slot]) -> list[Any | None]:
        """Each slot's cached answer, or None (not cached, or the cache unreachable)."""
        found = self.cache.get_many([self.digest(slot) for slot in slots])
        return [None if data is None else decode(data) for data in found]

    def remember(self, slots: Sequence[Slot], answers: Sequence[Any]) -> None:
        """Cache computed answers under their slots' digests."""
        self.cache.put_many({self.digest(slot): encode(answer) for slot, answer in zip(slots, answers, strict=True)})

    def digest(self, slot: Slot) -> str:
        key = [self._model, self._schema(slot.schema), canonical_text(slot.ticket.text)]
        return hashlib.sha256(json.dumps(key, ensure_ascii=False).encode()).hexdigest()

    def _schema(self, name: str | None) -> str:
        fingerprint = self._schemas.get(name)
        if fingerprint is None:
            schema = self.routing.schemas.schema(name) if self.routing.schemas is not None and name else None
            schema = schema or self.routing.classifier.schema
            text = repr(schema) if schema is not None else repr(self.routing.classifier.labels)
            fingerprint = self._schemas[name] = hashlib.sha256(text.encode()).hexdigest()
        return fingerprint


def encode(answer: Prediction | TicketFields) -> bytes:
    kind = "fields" if isinstance(answer, TicketFields) else "label"
    return json.dumps({"kind": kind, **dataclasses.asdict(answer)}, ensure_ascii=False).encode()


def decode(data: bytes) -> Prediction | TicketFields:
    entry = json.loads(data)
    if entry.pop("kind") == "label":
        return Prediction(**entry)
    fields = entry.pop("fields")
    results = {name: FieldResult(**{**field, "labels": tuple(field["labels"])}) for name, field in fields.items()}
    return TicketFields(fields=results, **entry)
