"""`Producer`: validates tickets at the edge, sends them, and collects their results.

It composes the rooms below it: `producer.checking` (tickets checked at the edge), `producer.broker`
(the Celery app and Redis client), `producer.reads` (the results stream, the queue depth),
`producer.sending` (publishing), `producer.waiting` (results, outages, re-sends). It imports no
torch and nothing from `worker/`, only the shared contract (`ticketq`), so a web app can embed it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence

import redis
from celery import Celery
from celery.result import AsyncResult

from producer import reads
from producer.broker import Broker
from producer.checking import check_all, check_ticket
from producer.messages import Ticket, TicketResult
from producer.outage import RETRY_FOR_S
from producer.sending import Sender
from producer.waiting import ResultCallback, Waiter
from ticketq.config import ClientSettings

log = logging.getLogger(__name__)


class Producer:
    """Sends tickets to the classify task and collects per-ticket results.

    Build it from `ClientSettings` (read from `TICKETQ_*` by default; a worker's `Settings` will
    do too) or override the URLs:
    `Producer(broker_url="redis://:secret@redis:6379/0")`. The first send checks the broker once
    and raises `BrokerUnavailable` within about `connect_timeout_s` instead of retrying
    (`check_connection(retry_for_s)` first waits for a Redis not reachable yet, as
    `ticketq-produce` does); once sending or waiting has begun, a Redis that went away is asked
    again for up to `retry_for_s`.
    """

    def __init__(self, settings: ClientSettings | None = None, *, broker_url: str | None = None,
                 backend_url: str | None = None, connect_timeout_s: float = 3.0,
                 retry_for_s: float = RETRY_FOR_S) -> None:  # fmt: skip
        settings = settings if settings is not None else ClientSettings()
        # Checked as TICKETQ_BROKER_URL is: SettingsError (a ValueError), one line per problem.
        self.settings = settings.with_overrides(broker_url=broker_url or None, result_backend=backend_url or None)
        if retry_for_s < 0:
            raise ValueError(f"retry_for_s must be >= 0 seconds, got {retry_for_s!r}")
        self.connect_timeout_s, self.retry_for_s = connect_timeout_s, retry_for_s
        self._broker = Broker(self.settings, connect_timeout_s)
        self._sender = Sender(self._broker, retry_for_s)
        self._waiter = Waiter(self._broker, self._sender, retry_for_s)

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release this producer's connections (a later call opens new ones)."""
        self._broker.close()

    @property
    def app(self) -> Celery:
        return self._broker.app

    @property
    def redis(self) -> redis.Redis:
        """A redis-py client on the broker (queue depth, results stream)."""
        return self._broker.redis

    def check_connection(self, retry_for_s: float = 0.0) -> None:
        """PING the broker and the Redis result backend, read the data-loss marker; raise
        `BrokerUnavailable` if down. `retry_for_s` > 0 asks a Redis not reachable yet (down, a
        Sentinel promotion, loading its data) again for that long before raising."""
        self._broker.check_connection(retry_for_s)

    def validate(self, text: object, id: object = None) -> tuple[str, str]:
        """Check one ticket at the edge with the contract's rule; `(id, text)`, a missing id assigned.

        Raises `TicketRejected` (a `ValueError`; `.reason` says why), or `TypeError` for a text or
        id of the wrong type. An integer id comes back as its decimal string.
        """
        return check_ticket({"id": id, "text": text}, self.settings.max_ticket_bytes)[:2]

    def submit(self, text: str, id: str | int | None = None, idempotent: bool = False,
               schema: str | None = None) -> TicketResult:  # fmt: skip
        """Send one ticket as its own message; returns its Celery `AsyncResult` (`NotReplicated`
        with it when TICKETQ_REPLICA_ACKS replicas did not confirm it).

        `idempotent=True` (with an `id`): the task id comes from (queue, id), and a ticket that
        already has a result is not sent again; its result is returned as the first time.
        `schema`: the name of the schema (fields) the worker answers it with (default: the worker's first).
        """
        ticket = check_ticket({"id": id, "text": text}, self.settings.max_ticket_bytes, schema)
        if idempotent:
            return self.submit_many([{"id": ticket[0], "text": ticket[1]}], idempotent=True, schema=schema)[0]
        result = self._sender.send([ticket], packed=False)
        self._broker.confirm_replicas([result])
        return result

    def submit_many(self, tickets: Iterable[Ticket], pack: int = 1, progress: bool = False, idempotent: bool = False,
                    already_sent: Iterable[str] = (), schema: str | None = None) -> list[TicketResult]:  # fmt: skip
        """Send tickets (strings or `{"id"?, "text", "schema"?}` mappings), `pack` per message;
        `schema` names the schema of those that name none (default: the worker's first).

        Every ticket is validated before the first is sent, so one bad ticket (or an id given
        twice in `tickets`) sends nothing. With TICKETQ_REPLICA_ACKS, one WAIT after the last send
        covers them all.

        `idempotent=True`: each message's task id comes from (queue, its ticket ids), see
        `idempotent_task_id`, and a message whose task already has a result in the backend is not
        sent again (it is in the returned list, and `wait` reads its result at once), nor is one
        whose task id is in `already_sent` (the task ids an interrupted run reported as sent).
        Tickets without an id get a random one, so only tickets with ids are idempotent.
        Ctrl-C raises `SendInterrupted`, which says what was sent.
        """
        if not isinstance(pack, int) or pack < 1:
            raise ValueError(f"pack must be an integer >= 1, got {pack!r}")
        checked = check_all(tickets, self.settings.max_ticket_bytes, schema)
        self._broker.ensure_checked()
        chunks = [checked[start : start + pack] for start in range(0, len(checked), pack)]
        if idempotent:
            return self._sender.send_once(chunks, pack > 1, progress, already_sent)
        results = self._sender.send_chunks(chunks, [None] * len(chunks), pack > 1, progress)
        self._sender.confirm(results)
        return results

    def resend(self, result: TicketResult) -> TicketResult:
        """Send a message again with its original task id; the worker publishes each ticket once.

        For a message that may have been lost after it was sent (a worker or Redis that lost it);
        when both copies arrive, the second is classified and recognised as a duplicate.
        """
        if not result.message_args:
            raise ValueError(f"task {result.id} was not sent by this producer: nothing to resend")
        again = self._sender.publish(result.id, result.message_args, result.ticket_ids, result.packed)
        self._broker.confirm_replicas([again])
        return again

    def wait(self, results: Sequence[AsyncResult], timeout: float | None = None, progress: bool = False,
             on_result: ResultCallback | None = None, resend_after: float | None = None) -> list[dict]:  # fmt: skip
        """Per-ticket result dicts for `results`, in submission order.

        Blocks until every task is done or `timeout` seconds pass overall; unfinished tickets come
        back as `status: "timeout"`. `on_result` gets each task's ticket dicts as they arrive.
        A Redis that goes away meanwhile (a restart, a failover) is asked again, with pauses
        doubling (`producer.outage`), for up to `retry_for_s` (within the timeout); results
        stored meanwhile are read once it is back. Past `retry_for_s` it raises `WaitStopped`
        with every row; refused credentials raise `BrokerUnavailable` at once.
        With `resend_after`, a message still without a result after that many seconds is sent
        again with the same task id when it is plausibly lost (not queued, not fetched by a
        worker), with backoff per message and a budget per period tied to the answer rate; the
        rule, its cost per period and the bound on a lost message are in `producer.resends`.
        """
        return self._waiter.wait(results, timeout, progress, on_result, resend_after)

    def ready_now(self, results: Sequence[AsyncResult]) -> list[dict]:
        """Per-ticket result dicts of those of `results` that are finished now: one pass of MGETs,
        no waiting (what a wait stopped by Ctrl-C had not read yet). On a Redis backend only; what
        cannot be read (Redis away) is simply not there."""
        return self._waiter.ready_now(results)

    def results_stream(self, since_id: str = "0", follow: bool = False) -> Iterator[tuple[str, dict]]:
        """`(entry_id, result)` from the results stream on the broker's Redis, after `since_id`.

        Stops at the end of the stream, or with `follow=True` waits for new entries forever (the
        caller breaks out). Resume later by passing the last `entry_id` as `since_id`. A ticket this
        producer's reads yielded before a data loss is not yielded again after it
        (`ticketq.epoch.AcrossEpochs`, over the last `stream_maxlen` results).
        """
        return reads.results_stream(self._broker.redis, self.settings.broker_url, since_id, follow,
                                    self._broker.epochs)  # fmt: skip

    def queue_depth(self) -> int:
        """Messages waiting in the queue (not yet taken by a worker), over kombu's priority lists."""
        return reads.queue_depth(self._broker.redis, self.settings.broker_url, self.settings.queue)
