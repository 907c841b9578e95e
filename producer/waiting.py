"""Waiting for results: per-ticket rows as they come, through an outage, re-sending what is
plausibly lost when asked (`resend_after`, see `producer.resends` for its rule, cost and bound).

Cost of riding an outage: `producer.outage`; results stored meanwhile are read once Redis is back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import AsyncResult
from tqdm import tqdm

from producer.backend import BulkRedisBackend, finished, iter_ready, unsubscribe
from producer.broker import LOST, Broker
from producer.errors import CONNECTION_ERRORS, BrokerUnavailable, WaitStopped
from producer.messages import TicketResult, in_order, ticket_ids, ticket_results
from producer.outage import Outage
from producer.resends import PERIOD_MAX_S, Resends, Whereabouts
from producer.sending import Sender, publish_batch
from ticketq.process import bar_disabled, paused_gc

log = logging.getLogger(__name__)

ResultCallback = Callable[[list[dict]], None]


class Waiter:
    """Collects the results of messages sent through `sender`; see `Producer.wait`."""

    def __init__(self, broker: Broker, sender: Sender, retry_for_s: float) -> None:
        self.broker, self.sender, self.retry_for_s = broker, sender, retry_for_s
        self.losses_seen = 0  # data losses (`broker.epoch.losses`) whose messages were made due

    def wait(self, results: Sequence[AsyncResult], timeout: float | None, progress: bool,
             on_result: ResultCallback | None, resend_after: float | None) -> list[dict]:  # fmt: skip
        if resend_after is not None and resend_after <= 0:
            raise ValueError(f"resend_after must be > 0 seconds, got {resend_after!r}")
        by_task: dict[str, list[dict]] = {}
        sent = {result.id: result for result in results}
        total = sum(len(ticket_ids(result)) or 1 for result in results)
        deadline = None if timeout is None else time.monotonic() + timeout
        outage = Outage("waiting for results", deadline, self.retry_for_s)
        resends = _resends_for(results, resend_after)
        with tqdm(total=total, unit="ticket", desc="results", disable=bar_disabled(progress)) as bar, paused_gc():

            def take(task_id: str, state: str, value: object) -> None:
                tickets = ticket_results(sent[task_id], state, value)
                by_task[task_id] = tickets
                if resends is not None:
                    resends.answered(task_id)
                bar.update(len(tickets))
                if on_result is not None:
                    on_result(tickets)

            try:
                while len(by_task) < len(sent):
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        break
                    if not self._round(results, sent, by_task, take, remaining, outage, resends):
                        break
            finally:
                unsubscribe(self.broker.app, (result for result in results if result.id not in by_task))
        collected = in_order(results, by_task, timeout)
        if outage.gave_up is not None:
            raise WaitStopped(outage.gave_up, collected)
        return collected

    def _round(self, results: Sequence[AsyncResult], sent: Mapping[str, AsyncResult], by_task: dict,
               take: Callable[[str, str, object], None], remaining: float | None, outage: Outage,
               resends: Resends | None) -> bool:  # fmt: skip
        """Read what finishes within `remaining` (or the re-send period), then re-send what is lost:
        True to go on waiting."""
        pending = [result for result in results if result.id not in by_task]
        # A tick at least every PERIOD_MAX_S, so that a data loss is noticed then, re-sends or not.
        periods = [p for p in (remaining, resends.period if resends else PERIOD_MAX_S) if p is not None]
        try:
            self._notice_data_loss(resends)
            for task_id, state, value in iter_ready(self.broker.app, pending, min(periods)):
                outage.over()
                take(task_id, state, value)
                if len(by_task) == len(sent):
                    # ResultSet can miss that it is complete when some results arrived
                    # over pub/sub during an earlier wait; stop once every task is in.
                    break
            outage.over()
        except CeleryTimeoutError:
            outage.over()  # what is missing is re-sent below, or reported as a timeout
        except (*CONNECTION_ERRORS, RuntimeError) as exc:
            return outage.ride_out(self.broker.unreachable(exc))
        if len(by_task) == len(sent):
            return False
        if resends is None:
            return True  # the loop stops at the deadline
        try:
            self._resend_lost(resends, sent)
        except (*CONNECTION_ERRORS, RuntimeError) as exc:
            return outage.ride_out(self.broker.unreachable(exc))
        return True

    def ready_now(self, results: Sequence[AsyncResult]) -> list[dict]:
        backend = self.broker.app.backend
        if not isinstance(backend, BulkRedisBackend) or not results:
            return []
        sent = {result.id: result for result in results}
        rows: list[dict] = []
        try:
            for task_id, state, value in finished(backend, list(sent)):
                rows.extend(ticket_results(sent[task_id], state, value))
        except CONNECTION_ERRORS as exc:
            log.debug("could not read the results ready now: %s", exc)
        return rows

    def _resend_lost(self, resends: Resends, sent: Mapping[str, AsyncResult]) -> None:
        """Send again the due messages that are plausibly lost, within the period's budget (see
        `producer.resends`): where the messages are, read at one instant, then their results read
        again, so one answered since is not taken for lost."""
        allowed, now = resends.budget(), time.monotonic()
        due = resends.due(now)
        if not due:
            return
        where = Whereabouts.read(self.broker.redis, self.broker.settings.queue, resends.sends())
        lost = resends.lost(due, where)
        answered = self.sender.answered(lost[:allowed])
        chosen = [task_id for task_id in lost[:allowed] if task_id not in answered]
        if not chosen:
            return
        again: list[TicketResult] = []
        with self.broker.acquire_producer() as kombu_producer, publish_batch(kombu_producer):
            for task_id in chosen:
                result = sent[task_id]
                # No replica check here: the wait goes on, and sends again what still has no result.
                again.append(self.sender.publish(task_id, result.message_args, result.ticket_ids, result.packed,
                                                 kombu_producer))  # fmt: skip
        for result in again:
            resends.resent(result.id, result.sent_seq or 0, now)
        waiting = len(lost) - len(answered) - len(chosen)
        log.warning("re-sent %d message(s) found lost (no result, not queued, not fetched by a worker; same task "
                    "ids)%s", len(chosen), f"; {waiting} more wait for the re-send budget" if waiting > 0 else "")


    def _notice_data_loss(self, resends: Resends | None) -> None:
        """A Redis that came back without its data (`ticketq.epoch`, read before the first send and
        at every tick) lost every message waited for: each is due at once (past its backoff; the
        budget still paces them), said once per loss. A loss noticed elsewhere (a reconnection's
        check) counts too."""
        try:
            self.broker.check_epoch()
        except BrokerUnavailable as exc:  # the read of the results meets it too, and rides it out
            log.debug("epoch marker not checked (%s)", exc)
        if self.broker.epoch.losses == self.losses_seen:
            return
        self.losses_seen = self.broker.epoch.losses
        if resends is None:
            log.warning("%s: the messages still waited for may be gone with it; wait with resend_after "
                        "(--resend-after) to send them again", LOST)  # fmt: skip
            return
        waiting = resends.all_due(time.monotonic())
        log.warning("%s: the %d message(s) still waited for are re-sent under their task ids", LOST, waiting)


def _resends_for(results: Sequence[AsyncResult], resend_after: float | None) -> Resends | None:
    """The re-send plan of a wait: every message this producer can send again (None without `resend_after`)."""
    if resend_after is None:
        return None
    messages = [(result.id, getattr(result, "sent_seq", None)) for result in results
                if getattr(result, "message_args", ())]  # fmt: skip
    return Resends(messages, resend_after, time.monotonic())

