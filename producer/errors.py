"""What the producer raises when Redis cannot take or give what it asked, and what it catches.

Each error that stops a bulk send or a wait carries what was sent and what came back, so a caller
can wait on it or send it again under the same task ids rather than submit the tickets anew.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kombu.exceptions
import redis

from ticketq.config import mask_url
from ticketq.connections import RedisUnavailable

if TYPE_CHECKING:
    from producer.messages import TicketResult

CONNECTION_ERRORS = (kombu.exceptions.OperationalError, redis.exceptions.RedisError, OSError)
# kombu >= 5.7's pipelined publish wraps what failed (its __cause__) in this
BATCH_ERRORS = tuple(getattr(kombu.exceptions, name) for name in ("BatchPublishError",)
                     if hasattr(kombu.exceptions, name))  # fmt: skip


class BrokerUnavailable(RedisUnavailable):
    """Redis (broker or result backend) cannot be used; the message says where and what to do."""

    fix = "set TICKETQ_BROKER_URL (and TICKETQ_RESULT_BACKEND if results live elsewhere)"


class NotReplicated(BrokerUnavailable):
    """Redis took the send, but fewer replicas than TICKETQ_REPLICA_ACKS confirmed it in time.

    The messages are in the queue and will likely be classified, but a failover now could lose
    them. `results` are what was sent: wait on them with `resend_after` (a lost one is sent again
    under its task id, and a duplicate is published once), rather than submitting the tickets anew.
    """

    def __init__(self, url: str, results: list[TicketResult], acked: int, wanted: int, timeout_s: float) -> None:
        self.results, self.acked, self.wanted = results, acked, wanted
        tickets = sum(len(result.ticket_ids) for result in results)
        self._text = (
            f"Redis at {mask_url(url)} took {tickets} ticket(s), but only {acked} of {wanted} replica(s) "
            f"(TICKETQ_REPLICA_ACKS) confirmed them within {timeout_s:g} s: they are queued, and may or may not "
            "survive a failover. Check the replicas (INFO replication); wait for the results with resend_after "
            "(ticketq-produce --wait --resend-after S) instead of sending them again"
        )
        super().__init__(url, "not replicated")

    def _message(self, detail: str) -> str:
        return self._text


class _Stopped(BrokerUnavailable):
    """A `BrokerUnavailable` that stopped a send or a wait: the same cause, `str()` and all."""

    def __init__(self, error: BrokerUnavailable) -> None:
        ConnectionError.__init__(self, str(error))
        self.url, self.reason = error.url, error.reason
        self.refused, self.write_refused = error.refused, error.write_refused


class SendStopped(_Stopped):
    """Redis stopped a bulk send: unreachable for longer than `retry_for_s`, or refusing its writes
    (full, too few replicas). `results` are the messages Redis took, `unconfirmed` those of the
    pipeline it failed, which it may or may not hold; the tickets after them were not sent. Sent
    again with the same task ids (idempotent sends), each is answered once. `str()` is the cause."""

    def __init__(self, error: BrokerUnavailable, results: list[TicketResult], unconfirmed: list[TicketResult]) -> None:
        super().__init__(error)
        self.results, self.unconfirmed = results, unconfirmed


class WaitStopped(_Stopped):
    """Redis stayed unreachable for longer than `retry_for_s` while `wait` waited: `results` has a
    row for every ticket, as `wait` returns them (`status: "timeout"` for those without a result).
    `str()` is the cause."""

    def __init__(self, error: BrokerUnavailable, results: list[dict]) -> None:
        super().__init__(error)
        self.results = results


class SendInterrupted(KeyboardInterrupt):
    """Ctrl-C during `submit_many`: `results` are the messages Redis took (their pipelines were
    flushed), `unconfirmed` the ones of the pipeline being flushed when it came, which Redis may or
    may not hold. Sent again with the same task ids (idempotent sends), they are classified and
    published once either way. A `KeyboardInterrupt`, not a `TicketqError` (see `ticketq.errors`)."""

    def __init__(self, results: list[TicketResult], unconfirmed: list[TicketResult]) -> None:
        super().__init__(f"interrupted after {len(results)} message(s) sent ({len(unconfirmed)} unconfirmed)")
        self.results, self.unconfirmed = results, unconfirmed
