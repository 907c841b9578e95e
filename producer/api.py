"""The Python API for sending tickets to ticketq workers and collecting their results.

`Producer` owns a minimal Celery app (JSON only) and a Redis client on the broker. It imports
no torch and no worker module except `worker.settings` and `worker.constants` (pydantic only),
so a web app can embed it.

Message contract (the worker implements the other side), task `worker.constants.TASK_CLASSIFY`
on queue `settings.queue`:

- single ticket: `args=[{"id": str, "text": str, "submitted_at": unix_seconds}]`; its result is
  one per-ticket dict;
- packed: `args=[[ticket, ticket, ...]]`; its result is a list of per-ticket dicts.

A per-ticket result from the worker looks like `{"id", "task_id", "status": "ok", "label", "probs",
"margin", "truncated", "model", "standin", "worker", "queue_wait_s", "processing_s"}`. `wait()`
turns a failed task into `{"id", "task_id", "status": "failed", "error"}` for each of its tickets,
and a task with no result by the deadline into `status: "timeout"`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import kombu.exceptions
import redis
from celery import Celery, states
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult, ResultSet
from kombu.utils.url import maybe_sanitize_url
from tqdm import tqdm

from worker.constants import RESULTS_STREAM, TASK_CLASSIFY
from worker.settings import Settings

log = logging.getLogger(__name__)

Ticket = str | Mapping[str, object]
ResultCallback = Callable[[list[dict]], None]

# kombu's Redis transport keeps one list per priority step: `queue`, `queue\x06\x163`, ...
_KOMBU_PRIORITY_SEP = "\x06\x16"
_KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
_CONNECTION_ERRORS = (kombu.exceptions.OperationalError, redis.exceptions.RedisError, OSError)


class BrokerUnavailable(ConnectionError):
    """Redis (broker or result backend) cannot be reached; the message says where and what to do."""

    def __init__(self, url: str, reason: object) -> None:
        self.url = mask_url(url)
        self.reason = str(reason).rstrip(".")
        super().__init__(
            f"cannot reach Redis at {self.url}: {self.reason}. Check that Redis is running and the "
            "URL (host, port, db, password) is right; set TICKETQ_BROKER_URL (and TICKETQ_RESULT_BACKEND "
            "if results live elsewhere) or pass --broker-url."
        )

    def __repr__(self) -> str:
        return f"BrokerUnavailable(url={self.url!r}, reason={self.reason!r})"


def mask_url(url: str) -> str:
    """The URL with any password replaced by `**`, safe to print and log."""
    return maybe_sanitize_url(url)


class TicketResult(AsyncResult):
    """The `AsyncResult` of one message, remembering which tickets it carried."""

    ticket_ids: tuple[str, ...] = ()
    packed: bool = False
    message_args: tuple = ()  # what was sent, so `wait(resend_after=...)` can send it again


class Producer:
    """Sends tickets to the classify task and collects per-ticket results.

    Build it from a `Settings` (read from `TICKETQ_*` by default) or override the URLs:
    `Producer(broker_url="redis://:secret@redis:6379/0")`. The first send checks the broker once
    and raises `BrokerUnavailable` within about `connect_timeout_s` instead of retrying.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        broker_url: str | None = None,
        backend_url: str | None = None,
        connect_timeout_s: float = 3.0,
    ) -> None:
        settings = settings if settings is not None else Settings()
        overrides = {"broker_url": broker_url, "result_backend": backend_url}
        self.settings = settings.model_copy(update={k: v for k, v in overrides.items() if v})
        self.connect_timeout_s = connect_timeout_s
        self.app = _make_app(self.settings, connect_timeout_s)
        self._result_cls = self.app.subclass_with_self(TicketResult)
        self._redis: redis.Redis | None = None
        self._checked = False

    # --- lifecycle ---

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release this producer's connections (a later call opens new ones)."""
        if self._redis is not None:
            self._redis.close()
            self._redis = None
        consumer = getattr(self.app.backend, "result_consumer", None)
        if consumer is not None and getattr(consumer, "_pubsub", None) is not None:
            # Every AsyncResult unsubscribes in __del__ through this pub/sub, reconnecting if
            # needed; at interpreter exit that fails noisily. Without a pub/sub it is a no-op.
            consumer.stop()
            consumer._pubsub = None
        self.app.close()

    @property
    def redis(self) -> redis.Redis:
        """A redis-py client on the broker (queue depth, results stream)."""
        if self._redis is None:
            self._redis = _redis_client(self.settings.broker_url, self.connect_timeout_s)
        return self._redis

    def check_connection(self) -> None:
        """PING the broker and the Redis result backend once; raise `BrokerUnavailable` if down."""
        for url in dict.fromkeys((self.settings.broker_url, self.settings.backend_url)):
            if urlsplit(url).scheme not in ("redis", "rediss"):
                continue  # other transports (memory://, tests) have nothing to ping
            try:
                client = _redis_client(url, self.connect_timeout_s)
                try:
                    client.ping()
                finally:
                    client.close()
            except (redis.exceptions.RedisError, OSError) as exc:
                raise BrokerUnavailable(url, exc) from None
        self._checked = True

    # --- sending ---

    def validate(self, text: object, id: object = None) -> tuple[str, str]:
        """Check one ticket at the edge; return `(id, text)` or raise `ValueError`/`TypeError`."""
        ticket_id = uuid.uuid4().hex if id is None else id
        if not isinstance(ticket_id, str) or not ticket_id.strip():
            raise ValueError(f"ticket id must be a non-empty string, got {id!r}")
        if not isinstance(text, str):
            raise TypeError(f"ticket {ticket_id!r}: text must be a str, got {type(text).__name__}")
        if not text.strip():
            raise ValueError(f"ticket {ticket_id!r}: text is empty or only whitespace; nothing to classify")
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"ticket {ticket_id!r}: text is not valid Unicode ({exc.reason} at index {exc.start})"
            ) from None
        limit = self.settings.max_ticket_bytes
        if size > limit:
            raise ValueError(
                f"ticket {ticket_id!r}: text is {size} bytes of UTF-8, over the limit of {limit} "
                "(TICKETQ_MAX_TICKET_BYTES)"
            )
        return ticket_id, text

    def submit(self, text: str, id: str | None = None) -> TicketResult:
        """Send one ticket as its own message; returns its Celery `AsyncResult`."""
        ticket = self.validate(text, id)
        return self._send([ticket], packed=False)

    def submit_many(
        self, tickets: Iterable[Ticket], pack: int = 1, progress: bool = False
    ) -> list[TicketResult]:
        """Send tickets (strings or `{"id"?, "text"}` mappings), `pack` per message.

        Every ticket is validated before the first is sent, so one bad ticket sends nothing.
        """
        if not isinstance(pack, int) or pack < 1:
            raise ValueError(f"pack must be an integer >= 1, got {pack!r}")
        checked, problems = [], []
        for index, ticket in enumerate(tickets):
            try:
                text, ticket_id = (ticket, None) if isinstance(ticket, str) else _fields(ticket)
                checked.append(self.validate(text, ticket_id))
            except (ValueError, TypeError) as exc:
                problems.append(f"#{index}: {exc}")
        if problems:
            shown = "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else "")
            raise ValueError(f"{len(problems)} of {len(checked) + len(problems)} tickets are invalid, none sent: "
                             f"{shown}")

        if not self._checked:
            self.check_connection()
        results = []
        # One pooled producer (and its broker connection) for the whole run, not one acquire per message.
        with (
            tqdm(total=len(checked), unit="ticket", desc="enqueue", disable=not progress) as bar,
            self._acquire_producer() as kombu_producer,
        ):
            for start in range(0, len(checked), pack):
                chunk = checked[start : start + pack]
                results.append(self._send(chunk, packed=pack > 1, producer=kombu_producer))
                bar.update(len(chunk))
        return results

    def _acquire_producer(self):
        try:
            return self.app.producer_or_acquire()
        except _CONNECTION_ERRORS as exc:
            self._checked = False
            raise self._unreachable(exc) from None

    def _send(self, tickets: Sequence[tuple[str, str]], packed: bool, producer: object = None) -> TicketResult:
        if not self._checked:
            self.check_connection()
        now = time.time()
        payload = [{"id": ticket_id, "text": text, "submitted_at": now} for ticket_id, text in tickets]
        ticket_ids = tuple(ticket_id for ticket_id, _ in tickets)
        return self._publish(str(uuid.uuid4()), (payload if packed else payload[0],), ticket_ids, packed, producer)

    def _publish(
        self, task_id: str, args: tuple, ticket_ids: tuple[str, ...], packed: bool, producer: object = None
    ) -> TicketResult:
        try:
            result = self.app.send_task(
                TASK_CLASSIFY,
                args=list(args),
                queue=self.settings.queue,
                task_id=task_id,
                result_cls=self._result_cls,
                # Celery copies repr(args) into the message headers, where logs and Flower show it;
                # tickets carry customer text, so the headers name the ticket ids only.
                argsrepr=_argsrepr(list(ticket_ids), packed),
                producer=producer,  # None: Celery acquires one from its pool for this message
            )
        except (*_CONNECTION_ERRORS, RuntimeError) as exc:
            self._checked = False
            raise self._unreachable(exc) from None
        result.ticket_ids, result.packed, result.message_args = ticket_ids, packed, args
        return result

    def resend(self, result: TicketResult) -> TicketResult:
        """Send a message again with its original task id; the worker publishes each ticket once.

        For a message that may have been lost after it was sent (a worker or Redis that lost it);
        when both copies arrive, the second is classified and recognised as a duplicate.
        """
        if not result.message_args:
            raise ValueError(f"task {result.id} was not sent by this producer: nothing to resend")
        return self._publish(result.id, result.message_args, result.ticket_ids, result.packed)

    def _unreachable(self, exc: BaseException) -> BaseException:
        """Name the Redis that failed; give back any other error unchanged."""
        if isinstance(exc, RuntimeError):
            # The result backend's pub/sub gave up reconnecting; Celery wraps the connection error.
            if isinstance(exc.__cause__, _CONNECTION_ERRORS):
                return BrokerUnavailable(self.settings.backend_url, exc.__cause__)
            return exc
        return BrokerUnavailable(self.settings.broker_url, exc)

    # --- collecting ---

    def wait(
        self,
        results: Sequence[AsyncResult],
        timeout: float | None = None,
        progress: bool = False,
        on_result: ResultCallback | None = None,
        resend_after: float | None = None,
    ) -> list[dict]:
        """Per-ticket result dicts for `results`, in submission order.

        Blocks until every task is done or `timeout` seconds pass overall; unfinished tickets come
        back as `status: "timeout"`. `on_result` gets each task's ticket dicts as they arrive.
        With `resend_after`, a message still without a result after that many seconds (and again
        after each further period) is sent again with the same task id: covers a message lost
        on its way (a Redis that lost its last writes), at the cost of a duplicate computation.
        """
        if resend_after is not None and resend_after <= 0:
            raise ValueError(f"resend_after must be > 0 seconds, got {resend_after!r}")
        by_task: dict[str, list[dict]] = {}
        sent = {result.id: result for result in results}
        total = sum(len(_ticket_ids(result)) or 1 for result in results)
        deadline = None if timeout is None else time.monotonic() + timeout
        with tqdm(total=total, unit="ticket", desc="results", disable=not progress) as bar:
            try:
                while len(by_task) < len(sent):
                    pending = [result for result in results if result.id not in by_task]
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    periods = [p for p in (remaining, resend_after) if p is not None]
                    period = min(periods) if periods else None
                    try:
                        for task_id, state, value in self._iter_ready(pending, period):
                            tickets = ticket_results(sent[task_id], state, value)
                            by_task[task_id] = tickets
                            bar.update(len(tickets))
                            if on_result is not None:
                                on_result(tickets)
                            if len(by_task) == len(sent):
                                # ResultSet can miss that it is complete when some results arrived
                                # over pub/sub during an earlier wait; stop once every task is in.
                                break
                    except CeleryTimeoutError:
                        pass  # what is missing is re-sent below, or reported as a timeout
                    if resend_after is None or len(by_task) == len(sent):
                        break
                    self._resend_missing(results, by_task)
            except (*_CONNECTION_ERRORS, RuntimeError) as exc:
                raise self._unreachable(exc) from None
            finally:
                self._unsubscribe(result for result in results if result.id not in by_task)

        collected = []
        for result in results:
            if result.id in by_task:
                collected.extend(by_task[result.id])
            else:
                error = f"no result within {timeout:g} s" if timeout is not None else "no result"
                ids = _ticket_ids(result) or [None]
                collected.extend(_failed(result.id, ids, error, status="timeout"))
        return collected

    def _resend_missing(self, results: Sequence[AsyncResult], by_task: dict[str, list[dict]]) -> None:
        missing = [result for result in results if result.id not in by_task and getattr(result, "message_args", ())]
        for result in missing:
            self.resend(result)
        if missing:
            log.warning("re-sent %d message(s) without a result (same task ids)", len(missing))

    def _unsubscribe(self, results: Iterable[AsyncResult]) -> None:
        """Stop listening for results we gave up on (a later `wait` subscribes again).

        Otherwise `AsyncResult.__del__` unsubscribes at interpreter exit, over a dead connection.
        """
        if not self.app.backend.supports_native_join:
            return
        try:
            for result in results:
                self.app.backend.remove_pending_result(result)
        except (*_CONNECTION_ERRORS, RuntimeError) as exc:  # best effort: the connection is gone anyway
            log.debug("could not unsubscribe from pending results: %s", exc)

    def _iter_ready(
        self, results: Sequence[AsyncResult], timeout: float | None
    ) -> Iterator[tuple[str, str, object]]:
        """`(task_id, state, result_or_exception)` for each task as it finishes."""
        if not results:
            return
        if self.app.backend.supports_native_join:
            # Redis: results arrive over pub/sub as they are stored, in completion order.
            for task_id, meta in ResultSet(list(results), app=self.app).iter_native(timeout=timeout):
                yield task_id, meta["status"], meta["result"]
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for result in results:  # other backends: Celery polls each result in turn
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            value = result.get(timeout=remaining, propagate=False)
            yield result.id, result.state, value

    # --- observing ---

    def results_stream(self, since_id: str = "0", follow: bool = False) -> Iterator[tuple[str, dict]]:
        """`(entry_id, result)` from the results stream on the broker's Redis, after `since_id`.

        Stops at the end of the stream, or with `follow=True` waits for new entries forever (the
        caller breaks out). Resume later by passing the last `entry_id` as `since_id`.
        """
        last = since_id
        while True:
            try:
                # Block in short reads: each must finish well inside the client's socket timeout.
                reply = self.redis.xread({RESULTS_STREAM: last}, count=500, block=1000 if follow else None)
            except (redis.exceptions.RedisError, OSError) as exc:
                raise BrokerUnavailable(self.settings.broker_url, exc) from None
            if not reply:
                if not follow:
                    return
                continue
            for raw_id, fields in reply[0][1]:
                last = raw_id.decode()
                try:
                    yield last, json.loads(fields[b"data"])
                except (KeyError, ValueError):
                    log.warning("skipping results stream entry %s without a JSON 'data' field", last)

    def queue_depth(self) -> int:
        """Messages waiting in the queue (not yet taken by a worker), over kombu's priority lists."""
        queue = self.settings.queue
        keys = [queue] + [f"{queue}{_KOMBU_PRIORITY_SEP}{step}" for step in _KOMBU_PRIORITY_STEPS[1:]]
        try:
            pipe = self.redis.pipeline(transaction=False)
            for key in keys:
                pipe.llen(key)
            return sum(pipe.execute())
        except (redis.exceptions.RedisError, OSError) as exc:
            raise BrokerUnavailable(self.settings.broker_url, exc) from None


def _make_app(settings: Settings, connect_timeout_s: float) -> Celery:
    """A Celery app that can only publish JSON and read JSON results, and gives up quickly."""
    app = Celery("ticketq-producer", broker=settings.broker_url, backend=settings.backend_url,
                 set_as_current=False)
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
        task_publish_retry_policy=few_retries,
        broker_transport_options={
            "socket_connect_timeout": connect_timeout_s,
            # Must match the worker's: Redis redelivers unacked messages after this.
            "visibility_timeout": settings.visibility_timeout_s,
        },
        redis_socket_connect_timeout=connect_timeout_s,
        result_backend_transport_options={"retry_policy": few_retries},
    )
    return app


def _redis_client(url: str, timeout_s: float) -> redis.Redis:
    """A redis-py client for a Celery-style Redis URL (accepts `ssl_cert_reqs=CERT_REQUIRED`)."""
    parts = urlsplit(url)
    # Celery/kombu spell it CERT_REQUIRED; redis-py wants required/optional/none.
    query = [(k, v.lower().removeprefix("cert_") if k == "ssl_cert_reqs" else v)
             for k, v in parse_qsl(parts.query)]
    url = urlunsplit(parts._replace(query=urlencode(query)))
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=max(timeout_s, 10.0))
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {mask_url(url)}: {exc}") from None


def ticket_results(result: AsyncResult, state: str, value: object) -> list[dict]:
    """Expand one finished message into per-ticket dicts (see the module docstring).

    `value` is the task's return value, or its exception when `state` is not SUCCESS.
    """
    ids = _ticket_ids(result)
    if state != states.SUCCESS:
        # A message this producer did not send has no known ticket ids: report it once.
        return _failed(result.id, ids or [None], str(value) or state)
    packed = getattr(result, "packed", isinstance(value, list))
    rows = value if packed else [value]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        return _failed(result.id, ids or [None], f"worker returned an unexpected result: {value!r:.200}")
    rows = [{**row, "task_id": row.get("task_id") or result.id} for row in rows]
    returned = {row.get("id") for row in rows}
    missing = [ticket_id for ticket_id in ids if ticket_id not in returned]
    return rows + _failed(result.id, missing, "worker returned no result for this ticket")


def _argsrepr(ticket_ids: list[str], packed: bool, shown: int = 5) -> str:
    if not packed:
        return f"[<ticket {ticket_ids[0]}>]"
    more = ", ..." if len(ticket_ids) > shown else ""
    return f"[<{len(ticket_ids)} tickets: {', '.join(ticket_ids[:shown])}{more}>]"


def _ticket_ids(result: AsyncResult) -> tuple[str, ...]:
    return getattr(result, "ticket_ids", ())


def _fields(ticket: Mapping[str, object]) -> tuple[object, object]:
    if not isinstance(ticket, Mapping):
        raise TypeError(f"a ticket must be a str or a mapping with 'text', got {type(ticket).__name__}")
    return ticket.get("text"), ticket.get("id")


def _failed(task_id: str, ticket_ids: Iterable[str | None], error: str, status: str = "failed") -> list[dict]:
    return [{"id": ticket_id, "task_id": task_id, "status": status, "error": error} for ticket_id in ticket_ids]
