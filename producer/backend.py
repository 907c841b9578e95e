"""The producer's Celery app and its bulk result backend: results read by MGET, not pub/sub.

`make_app` builds a Celery app that can only publish JSON and read JSON results, and gives up
quickly. On a Redis result backend it uses `BulkRedisBackend`, and `iter_ready` reads the result
keys of the pending messages in windows (`poll_ready`); other backends go through Celery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

from celery import Celery, states
from celery.backends.redis import RedisBackend, SentinelBackend
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, ResultSet

from producer.errors import CONNECTION_ERRORS
from ticketq import codec, connections
from ticketq.config import ClientSettings, is_redis_url, is_sentinel_url

log = logging.getLogger(__name__)

POLL_WINDOW = 200  # result keys read per MGET while waiting: the oldest pending, and a window rotating over the rest
POLL_PAUSE_S = (0.005, 0.1)  # pause between reads: the shortest after a read that found results, the longest
READ_WINDOW = 10 * POLL_WINDOW  # result keys read per MGET where nothing is waited for


class BulkRedisBackend(RedisBackend):
    """Celery's Redis result backend, without a pub/sub subscription for every message sent.

    Celery subscribes to each task's result channel as it sends the task (`on_task_call`), and the
    subscriber must then read every PUBLISH and unsubscribe task by task: for a bulk send, most of
    the producer's time (docs/performance.md). `Producer.wait` reads result keys with MGET instead
    (`poll_ready`). `AsyncResult.get()` still works: Celery subscribes when it is called, then
    reads the key once.
    """

    stopped = False

    def on_task_call(self, producer: object, task_id: str) -> None:
        return None

    def stop_consumer(self) -> None:
        """Close the result pub/sub for good. Every AsyncResult unsubscribes in `__del__` (through
        `on_result_fulfilled`), reconnecting if needed; after close, and at interpreter exit, that
        would fail noisily: once stopped it does nothing."""
        self.stopped = True
        self.result_consumer.stop()

    def on_result_fulfilled(self, result: object) -> None:
        if not self.stopped:
            super().on_result_fulfilled(result)


class BulkSentinelBackend(BulkRedisBackend, SentinelBackend):
    """`BulkRedisBackend` on the master Redis Sentinel names (a sentinel:// result backend)."""


def make_app(settings: ClientSettings, connect_timeout_s: float) -> Celery:
    """A Celery app that can only publish JSON and read JSON results, and gives up quickly."""
    backend = settings.backend_url
    if is_redis_url(backend):  # Celery's `class+url` form: see BulkRedisBackend
        bulk = "BulkSentinelBackend" if is_sentinel_url(backend) else "BulkRedisBackend"
        backend = f"{__name__}:{bulk}+{backend}"
    codec.install()  # results (packed: a hundred objects each) decoded in C
    app = Celery("ticketq-producer", broker=settings.broker_url, backend=backend, set_as_current=False)
    few_retries = {"max_retries": 1, "interval_start": 0, "interval_step": 0.5, "interval_max": 0.5}
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_default_queue=settings.queue,
        result_expires=settings.result_expires_s,
        # A producer is not a worker: a dead broker is an error to report, not a reason to wait.
        broker_connection_retry_on_startup=False,
        broker_connection_retry=False,
        broker_connection_max_retries=1,
        broker_connection_timeout=connect_timeout_s,
        # No retry inside kombu: its `Connection.ensure` recovers by closing the connection's channel
        # (`collect()`) and revives only the object it wraps, so a retried queue declare leaves the
        # Producer publishing on a closed channel whose `connection` is None: AttributeError
        # "'NoneType' object has no attribute 'client'" (kombu 5.7), or "Producer channel changed"
        # in a batch. `producer.outage` is the one retry: it acquires a fresh producer each try.
        task_publish_retry=False,
        task_publish_retry_policy=few_retries,
        broker_transport_options={
            "socket_connect_timeout": connect_timeout_s,
            # Must match the worker's: Redis redelivers unacked messages after this.
            "visibility_timeout": settings.visibility_timeout_s,
            **connections.transport_options(settings.broker_url, **settings.sentinel),  # the master's name
        },
        redis_socket_connect_timeout=connect_timeout_s,
        result_backend_transport_options={
            "retry_policy": few_retries, **connections.transport_options(settings.backend_url, **settings.sentinel)
        },
    )
    return app


def iter_ready(app: Celery, results: Sequence[AsyncResult], timeout: float | None) -> Iterator[tuple[str, str, object]]:
    """`(task_id, state, result_or_exception)` for each task as it finishes."""
    if not results:
        return
    if isinstance(app.backend, BulkRedisBackend):
        yield from poll_ready(app.backend, results, timeout)
        return
    if app.backend.supports_native_join:
        # Redis: results arrive over pub/sub as they are stored, in completion order.
        for task_id, meta in ResultSet(list(results), app=app).iter_native(timeout=timeout):
            yield task_id, meta["status"], meta["result"]
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    for result in results:  # other backends: Celery polls each result in turn
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        value = result.get(timeout=remaining, propagate=False)
        yield result.id, result.state, value


def poll_ready(backend: BulkRedisBackend, results: Sequence[AsyncResult], timeout: float | None
               ) -> Iterator[tuple[str, str, object]]:  # fmt: skip
    """`iter_ready` on a Redis backend: MGET the oldest POLL_WINDOW pending result keys, again at
    once while results come, pausing (POLL_PAUSE_S, doubling) while none does. Results mostly
    finish in send order, so the oldest window finds most of them in one read. When it finds
    none (its messages are slow, or lost), the same read also takes the next window of one that
    rotates over the other pending keys: every result behind a head that never comes is found,
    in one pass over the pending per POLL_WINDOW of them."""
    keys = {result.id: backend.get_key_for_task(result.id) for result in results}
    pending = list(keys)
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = POLL_PAUSE_S[0]
    cursor = POLL_WINDOW  # where the rotating window starts, in `pending`
    rotate = False  # the last read of the oldest window found nothing
    while pending:
        if not POLL_WINDOW <= cursor < len(pending):  # past the end, or into the oldest window: start again
            cursor = POLL_WINDOW
        window = pending[:POLL_WINDOW]
        if rotate:
            window += pending[cursor : cursor + POLL_WINDOW]
            cursor += POLL_WINDOW
        ready = read_ready(backend, window, keys)
        yield from ready
        done = {task_id for task_id, _, _ in ready}
        rotate = not any(task_id in done for task_id in window[:POLL_WINDOW])
        if done:
            head = sum(task_id in done for task_id in pending[:cursor])
            pending = [task_id for task_id in pending if task_id not in done]
            cursor -= head  # the rotating window keeps its place among the pending that remain
            pause = POLL_PAUSE_S[0]
        else:
            pause = min(2 * pause, POLL_PAUSE_S[1])
        if not pending:
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise CeleryTimeoutError(f"{len(pending)} results not ready within {timeout:g} s")
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - time.monotonic())))


def read_ready(backend: BulkRedisBackend, window: list[str], keys: Mapping[str, str]) -> list[tuple[str, str, object]]:
    """`(task_id, state, result)` of the finished tasks among `window`: one MGET."""
    ready = []
    for task_id, raw in zip(window, backend.mget([keys[task_id] for task_id in window]), strict=True):
        if raw is not None:
            meta = backend.decode_result(raw)
            if meta["status"] in states.READY_STATES:
                ready.append((task_id, meta["status"], meta["result"]))
    return ready


def finished(backend: BulkRedisBackend, task_ids: Sequence[str]) -> Iterator[tuple[str, str, object]]:
    """`read_ready` over all of `task_ids`, READ_WINDOW keys per MGET: what is finished now."""
    keys = {task_id: backend.get_key_for_task(task_id) for task_id in task_ids}
    for first in range(0, len(task_ids), READ_WINDOW):
        yield from read_ready(backend, list(task_ids[first : first + READ_WINDOW]), keys)


def unsubscribe(app: Celery, results: Iterable[AsyncResult]) -> None:
    """Stop listening for results we gave up on (a later `wait` subscribes again).

    Otherwise `AsyncResult.__del__` unsubscribes at interpreter exit, over a dead connection.
    """
    if not app.backend.supports_native_join or isinstance(app.backend, BulkRedisBackend):
        return
    try:
        for result in results:
            app.backend.remove_pending_result(result)
    except (*CONNECTION_ERRORS, RuntimeError) as exc:  # best effort: the connection is gone anyway
        log.debug("could not unsubscribe from pending results: %s", exc)
