"""A message as Redis holds it in the queue list, for a sender that pushes it itself inside a Redis
script (the gateway: the push, its bound and its records in one atomic step and one round trip).

kombu has no public call that gives the bytes it would LPUSH, so they are put together here:
Celery's own task message (`app.amqp.create_task_message`, protocol 2), its body as JSON, and the
envelope kombu's Redis transport stores (`prepare_message`, then base64 body, delivery info and
tag). The JSON is `ticketq.codec.dumps`' (orjson: the same values as kombu's encoder, a fifth of
its time; the encoding was a third of a POST's own cost). The worker reads it with kombu like any
other. `tests/integration/test_producer_wire.py` holds the envelope to what
kombu itself writes for the same task, field by field, so a kombu or Celery that changes the format
fails there, not in production.

Only for a priority-0 message on a Redis broker (the queue's own list, `queue_lists(queue)[0]`).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Sequence

from celery import Celery
from celery.utils.nodenames import anon_nodename

from producer.messages import Checked, argsrepr, payload
from ticketq import codec
from ticketq.names import TASK_CLASSIFY

DELIVERY_MODE = 2  # persistent: what a Celery queue's exchange declares (kombu's default for a direct exchange)


class QueuedMessages:
    """Encodes messages of the classify task to one queue as kombu's Redis transport stores them."""

    def __init__(self, app: Celery, queue: str) -> None:
        self.app, self.queue = app, queue
        self._origin = anon_nodename()  # the `origin` header, as Celery names a sender that is no worker

    def encode(self, task_id: str, tickets: Sequence[Checked], packed: bool = True) -> bytes:
        """The queue list item of one message carrying `tickets` (a packed list, or the one ticket)
        under `task_id`, `submitted_at` now; its headers name the ticket ids, never their text."""
        now = time.time()
        rows = [{**payload(ticket), "submitted_at": now} for ticket in tickets]
        ids = [ticket_id for ticket_id, *_ in tickets]
        headers, properties, body, _ = self.app.amqp.create_task_message(
            task_id, TASK_CLASSIFY, [rows if packed else rows[0]], {}, argsrepr=argsrepr(ids, packed),
            kwargsrepr="{}", reply_to=self.app.thread_oid, origin=self._origin,
        )  # fmt: skip
        envelope = {
            "body": base64.b64encode(codec.dumps(body)).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": {
                **properties,
                "delivery_mode": DELIVERY_MODE,
                "delivery_info": {"exchange": "", "routing_key": self.queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return codec.dumps(envelope)
