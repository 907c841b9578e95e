"""The Python API for sending tickets to ticketq workers and collecting their results:
`from producer.api import Producer`.

`Producer` owns a minimal Celery app (JSON only) and a Redis client on the broker. It imports
no torch and nothing from `worker/`, only the shared contract (`ticketq`), so a web app can
embed it.

The message and ticket rules are `ticketq.contract`'s (the worker applies the same validator):
a ticket is checked here before anything is sent, `submit_many` also refuses a repeated id, and
each message goes to task `ticketq.names.TASK_CLASSIFY` on queue `settings.queue`, one ticket or a
packed list. `wait()` gives one dict per ticket (`producer.messages`): the worker's `Classified`
or `Failed` result, `status: "failed"` for each ticket of a failed task, `status: "timeout"` for
a task with no result by the deadline.

A Redis that goes away (a restart, a Sentinel failover) is asked again, sending and waiting alike,
for up to `retry_for_s` (`producer.outage`): a bulk send then sends again the pipeline it was
flushing, under the same task ids. Past that, or when Redis refuses a send's writes (full),
`SendStopped` / `WaitStopped` (`producer.errors`) say what was sent and what came back.
`wait(resend_after=S)` sends again what is plausibly lost, with a budget (`producer.resends`).

`submit_many(..., idempotent=True)` (what `ticketq-produce file` sends) derives each message's task
id from its queue and ticket ids (`producer.messages.idempotent_task_id`), and does not send again
a message that already has a result: a re-sent ticket is a re-execution of the same task, which
the worker publishes once.

The broker may be Redis Sentinel (`sentinel://h1:26379;sentinel://h2:26379` with
TICKETQ_SENTINEL_MASTER): every client here follows the master through a failover. With
TICKETQ_REPLICA_ACKS, a send returns once that many replicas hold it (WAIT), else raises
`NotReplicated`, which carries what was sent.

The rooms: `producer.client` (validate, send, the entry point), `producer.sending` (pipelines),
`producer.waiting` (results, outages, re-sends), `producer.backend` (the Celery app and its bulk
result backend), `producer.broker` (the Redis connection), ticket files in `producer.ticketfile`
and result files in `producer.resultfile`.
"""

from __future__ import annotations

from producer.client import Producer
from producer.errors import BrokerUnavailable, NotReplicated, SendInterrupted, SendStopped, WaitStopped
from producer.messages import TicketResult, idempotent_task_id
from producer.queued import QueuedMessages

# The public surface: the client, what it raises, what it returns.
__all__ = ["BrokerUnavailable", "NotReplicated", "Producer", "QueuedMessages", "SendInterrupted", "SendStopped",
           "TicketResult", "WaitStopped", "idempotent_task_id"]  # fmt: skip
