"""Every name a client and a worker must agree on: the Celery task and queue, the Redis streams,
the default label set.

Producers, workers, any Celery client and the deployment files refer to these strings; a rename
here is a protocol change. Worker-only names (metrics, the worker's own Redis keys) live in
`worker.constants` and `worker.redis.keys`; the worker's delivery records live here, because a
producer reads them to tell a lost message from one that is queued or being worked on.
"""

# Celery: the task any client sends (`app.send_task(TASK_CLASSIFY, args=[payload])`) and its queue.
TASK_CLASSIFY = "ticketq.classify"
QUEUE = "ticketq"

# Redis streams on the broker (capped with MAXLEN ~ TICKETQ_STREAM_MAXLEN): every final per-ticket
# result, and every refused ticket or message with its raw payload.
RESULTS_STREAM = "ticketq:results"
DEAD_LETTER_STREAM = "ticketq:dead"
# Results a person should look at (a schema field's confidence below its threshold): a copy of
# each such result, written once with its first publication; consume it with a consumer group.
REVIEW_STREAM = "ticketq:review"
# The review page's consumer group on REVIEW_STREAM (an item is pending there, under its tenant's
# consumer, until a reviewer decides it: XACK) and the stream of those decisions, one entry per
# reviewed item (`data` = `ticketq.labelled` record JSON), never trimmed: it is training data
# (`ticketq reviews export` writes it as a labelled file for `ticketq eval` and `ticketq fit`).
REVIEW_GROUP = "ticketq-review"
LABELLED_STREAM = "ticketq:labelled"
# Which Redis "life" a client talks to (`ticketq.epoch`): a marker every worker and producer sets
# if absent and reads now and then; when the one it knew is gone or replaced, Redis restarted
# without its data (or was flushed). The record of the latest such loss, for `ticketq status`.
EPOCH_KEY = "ticketq:epoch"
DATA_LOST_KEY = "ticketq:epoch:lost"

# Where a message is between the queue and its ack, as the worker's atomic fetch and leases record
# it (worker/transport/worker_state.lua lists what each holds; the worker writes them, a
# producer only reads them): a consumer's fetching list (BLMOVE target), the delivery tags it
# holds unacked, its lease, and the registry of consumers. kombu's own unacked record is
# `unacked_key()`. An attempts key counts the deliveries of an unfinished message.
FETCHING_KEY = "ticketq:fetching:{consumer}:{queue}"
OWNED_KEY = "ticketq:owned:{consumer}"
ALIVE_KEY = "ticketq:alive:{consumer}"
CONSUMERS_KEY = "ticketq:consumers"
ATTEMPTS_KEY = "ticketq:attempts:{task_id}"

# Default labels of the closed set (TICKETQ_LABELS).
DEFAULT_LABELS = ("billing", "technical", "account")


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold `queue`'s waiting messages: the queue list, then the lists kombu's
    Redis transport keeps per priority step for messages sent with a priority (`<queue>\\x06\\x16<n>`),
    named with kombu's own (public) separator and steps."""
    from kombu.transport.redis import Channel

    return [queue] + [f"{queue}{Channel.sep}{step}" for step in Channel.priority_steps[1:]]


def unacked_key() -> str:
    """kombu's Redis hash of unacknowledged messages (delivery tag -> [message, exchange, routing
    key]), named by kombu's own (public) channel attribute; ticketq never renames it."""
    from kombu.transport.redis import Channel

    return Channel.unacked_key
