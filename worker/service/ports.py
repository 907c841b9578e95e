"""What the service needs of the things around it: the classifier, Celery's result backend, the
running job's feed of arrivals, and the outbox its results go out through (`worker.redis.outbox.Outbox`
on Redis; `worker.service.memory.MemoryOutbox` in the unit tests). The records an outbox answers
with (`Published`, `Unconfirmed`) are the contract's (`ticketq.publishing`), not an adapter's."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ticketq.publishing import Published, Unconfirmed
from ticketq.schema import Schema
from worker.engine.scheduler import BatchEngine, Policy

if TYPE_CHECKING:
    from worker.engine.configure import ModelInfo
    from worker.engine.cost import CostModel


class Classifier(BatchEngine[Any], Protocol):
    """What the service needs of a classifier (`worker.engine.Engine`, `NullClassifier`, or a
    `classifier_factory`'s own): its own field computed a forward at a time (`BatchEngine`: the
    service's loop plans and runs it, `worker.service.loop`), the unbatched reference, and what
    the result records, the answer cache, the schemas and the hooks read of it."""

    labels: tuple[str, ...]
    info: ModelInfo | None  # the model as loaded (None: no model, the null classifier)
    schema: Schema | None  # its own field as a schema (None: built from a ready system text)
    compiles: bool  # `compile(schema)` answers other schemas on its model (TICKETQ_SCHEMAS)
    dedup: bool  # a run computes duplicate tickets once (TICKETQ_DEDUP)
    cost: CostModel | None  # the planner's cost model, refitted live (None: plans without one)
    policy: Policy  # how its answers are held to float32's (`worker.engine.policy`): routes, screens, reference

    def compile(self, schema: Schema) -> BatchEngine[Any]: ...

    def reference(self, text: str) -> Any: ...


class Backend(Protocol):
    def mark_as_done(self, task_id: str, result: Any, request: Any = None) -> Any: ...

    def mark_as_failure(
        self, task_id: str, exc: BaseException, request: Any = None, call_errbacks: bool = True
    ) -> Any: ...


class Feed(Protocol):
    """Where the running job finds more work, and tells that a message is finished."""

    def more(self) -> list[Any]:
        """Requests that arrived since the job started; from now on they are part of it."""
        ...

    def done(self, task_ids: Sequence[str], failures: Mapping[str, str] | None = None,
             answers: Mapping[str, str] | None = None, revoked: Collection[str] = ()) -> None:  # fmt: skip
        """These messages' results are out: acknowledge them (never raises). `failures`: the error
        of each that ended in state FAILURE or REVOKED; `answers`: a short text of each one's
        answer; `revoked`: those that ended REVOKED (past their `expires`, as Celery ends them)."""
        ...

    def taken_over(self, task_ids: Sequence[str]) -> set[str]:
        """Those of these messages that another worker took over (this worker's lease lapsed):
        theirs to answer, not this worker's to fail. May raise Redis' errors."""
        ...


class Outbox(Protocol):
    """The writes the service makes (`worker.redis.outbox.Outbox` documents each one's effect)."""

    def attempts(self, task_ids: Sequence[str]) -> list[int | None]: ...

    def count_deliveries(self, task_ids: Sequence[str]) -> int: ...

    def publish(self, slots: Sequence[tuple], finished: Sequence[str],
                review: Collection[tuple[str, int]] = ()) -> Published: ...  # fmt: skip

    def landed(self, unconfirmed: Unconfirmed) -> Published | None: ...

    def stream_results(self, encoded: Sequence[bytes]) -> None: ...

    def answered(self, backend: Any, requests: Sequence[tuple[str, int]]) -> set[str]: ...

    def store_successes(self, backend: Any, successes: Sequence[tuple[Any, bytes]]) -> None: ...

    def mark_failed(self, backend: Any, request: Any, exc: BaseException, state: str = "FAILURE") -> None: ...

    def dead_letter(self, entry: dict[str, str]) -> None: ...

    def retrying(self, action: Callable[[], Any], write: bool = True) -> Any: ...
