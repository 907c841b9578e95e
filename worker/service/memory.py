"""An outbox in memory, for running the service without Redis (its unit tests), as dramatiq's
stub broker stands in for Redis: the same methods as `worker.redis.outbox.Outbox`, and the same
effects on what a reader sees — each (task, slot) streamed once, a task id that answered one
payload refusing another (`conflicts`), backend results written once, never overwritten.

Not modelled: Redis being away (every call succeeds at once, so nothing is ever unconfirmed),
expiry, stream trimming, and failures kept by `ticketq dead requeue`. The backend argument of
each call is ignored: this outbox is its own result backend (`stored`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ticketq.publishing import Published, Unconfirmed


class MemoryOutbox:
    def __init__(self) -> None:
        self.results: list[dict] = []  # the results stream, decoded
        self.review: list[dict] = []  # the review stream
        self.dead_letters: list[dict[str, str]] = []
        self.stored: dict[str, tuple[str, Any]] = {}  # task id -> ("SUCCESS", value) or ("FAILURE", exception)
        self.deliveries: dict[str, int] = {}  # the attempts counters
        self.done: dict[str, set[int]] = {}  # task id -> slots published
        self.digests: dict[str, str] = {}

    def attempts(self, task_ids: Sequence[str]) -> list[int | None]:
        return [self.deliveries.get(task_id) for task_id in task_ids]

    def count_deliveries(self, task_ids: Sequence[str]) -> int:
        for task_id in task_ids:
            self.deliveries[task_id] = self.deliveries.get(task_id, 0) + 1
        return self.deliveries[task_ids[0]]

    def publish(self, slots: Sequence[tuple], finished: Sequence[str],
                review: Mapping[tuple[str, int], str] | None = None) -> Published:  # fmt: skip
        repeats, conflicts = [], []
        for task_id, slot, encoded, *digest in slots:
            given = digest[0] if digest else ""
            known = self.digests.setdefault(task_id, given) if given else ""
            if known and known != given:
                conflicts.append((task_id, slot))
            elif slot in self.done.setdefault(task_id, set()):
                repeats.append((task_id, slot))
            else:
                self.done[task_id].add(slot)
                self.results.append(json.loads(encoded))
                if review and (task_id, slot) in review:
                    self.review.append({**json.loads(encoded), "text": review[task_id, slot]})
        for task_id in finished:
            self.deliveries.pop(task_id, None)
        return Published(repeats, conflicts)

    def landed(self, unconfirmed: Unconfirmed) -> Published | None:
        return None  # nothing here is ever unconfirmed

    def stream_results(self, encoded: Sequence[bytes]) -> None:
        self.results.extend(json.loads(data) for data in encoded)

    def answered(self, backend: Any, requests: Sequence[tuple[str, int]]) -> set[str]:
        return {task_id for task_id, count in requests
                if task_id in self.stored or len(self.done.get(task_id, ())) >= max(count, 1)}  # fmt: skip

    def store_successes(self, backend: Any, successes: Sequence[tuple[Any, bytes]]) -> None:
        for request, value in successes:
            self.stored.setdefault(request.id, ("SUCCESS", json.loads(value)))

    def mark_failed(self, backend: Any, request: Any, exc: BaseException, state: str = "FAILURE") -> None:
        self.stored.setdefault(request.id, (state, exc))

    def dead_letter(self, entry: dict[str, str]) -> None:
        self.dead_letters.append(entry)

    def retrying(self, action: Callable[[], Any], write: bool = True) -> Any:
        return action()
