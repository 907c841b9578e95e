"""Every Redis key and stream ticketq writes besides the broker's own queue traffic, and what each means.

Keys and streams, what each holds, and who writes it (stream names and the delivery records'
templates in ticketq.names, the others below; <task> is a Celery task id, <slot> a ticket's place
in its message, <consumer> one consuming channel, host:pid:random):

- `ticketq:results` (stream) — one entry per final ticket result (ok, failed, expired), field
  `data` = the result JSON, field `epoch` = the epoch marker's id it was published under (read by
  the publish script; absent before any marker); capped with MAXLEN ~ TICKETQ_STREAM_MAXLEN. `Outbox.publish`
  (`Outbox.stream_results` for the answers of a message that reused a task id).
- `ticketq:dead` (stream) — one entry per refused ticket or message: reason, error, payload (the
  ticket or arguments as JSON, or the raw bytes as `payload_b64` when it never became a ticket),
  whole up to `ticketq.dead_letters.dead_letter_bound`, `truncated` when cut. `Outbox.dead_letter`; `drop_dead_letter`
  (operator requeue, once the re-sent message is answered).
- `ticketq:requeued` (hash) — dead-letter entry id -> the task id it was re-sent as, until that task
  has a result and the entry is dropped. `mark_requeued`, `settle_requeued` (operator commands).
- `ticketq:done:<task>` (bit string, TTL = result expiry) — bit <slot> is set once that ticket's
  final result is streamed, so a re-executed message never publishes twice. `Outbox.publish`.
- `ticketq:failed:<task>` (hash, TTL = result expiry) — slot -> the reason of a failure that was
  streamed and kept by a requeue (its done bit stays set): the re-sent ticket failing for the same
  reason is a repeat, not a second `failed` entry; its answer or another failure is streamed once.
  `keep_failure` (operator requeue), `Outbox.publish`.
- `ticketq:epoch`, `ticketq:epoch:lost` (strings; names in ticketq.names) — the epoch marker every
  worker and producer sets if absent and reads with its work, and the record of the latest loss
  noticed (TTL a day): a Redis that came back without its data is reported. ticketq.epoch,
  `Outbox.attempts`.
- `ticketq:digest:<task>` (string, TTL = result expiry) — a hash of the message's arguments, written
  with its first published result: a re-delivery of the same message is published once, another
  message under the same task id is answered `duplicate_task_id`. `Outbox.publish`.
- `ticketq:publish:<call>` (string, TTL PUBLISH_CALL_TTL_S) — the answer of one publish call,
  so that the call repeated after a lost reply (a timeout, a partition) gets the first answer
  again instead of "all repeats": each result is counted once, by the worker that published it;
  `cancelled` when the call gave up before it ran, so a copy that arrives late does nothing.
  `Outbox.publish`, `Outbox.landed`.
- `ticketq:attempts:<task>` (counter, TTL = result expiry) — deliveries of an unfinished message;
  bounds crash loops on poison tickets, deleted when the message is finished.
  `Attempts.count_deliveries`, `Outbox.publish`; `forget_message` (operator requeue).
- `ticketq:answer:<digest>` (string, TTL TICKETQ_ANSWER_CACHE_S) and `ticketq:answers` (sorted set:
  entry key -> write time, ms) — the answer cache, off unless TICKETQ_ANSWER_CACHE_S is set: a
  ticket's answer by a digest of its canonical text, schema and model; at most
  TICKETQ_ANSWER_CACHE_ENTRIES, the oldest deleted past it. worker.redis.answer_cache (answer_cache.lua).
- `celery-task-meta-<task>` (string, also PUBLISHed) — Celery's result in Celery's own format:
  what `AsyncResult.get()` waits on. `store_successes`, `mark_failed`.
- `ticketq:fetching:<consumer>:<queue>` (list) — a message between its pop and its unacked
  record. worker.transport.fetch (fetch), .lease (recovery).
- `ticketq:owned:<consumer>` (set) — delivery tags one consumer holds unacked. worker.transport.fetch
  (fetch, ack, recovery).
- `ticketq:alive:<consumer>` (string, TTL = TICKETQ_LEASE_S) — exists while the consumer beats:
  its lease. worker.transport.lease.
- `ticketq:consumers` (hash) — consumer -> {host, pid, queues, since}: whom recovery checks.
  worker.transport.lease.
- `unacked`, `unacked_index` (hash, zset) — kombu's own record of delivered, unacknowledged
  messages. kombu, through worker.transport.fetch.QoS.

The fetch and lease keys are written by one script, worker/transport/worker_state.lua
(dispatched by worker.transport.state); their names are ticketq.names' (a producer reads them).

Writers: `Outbox` is worker.redis.outbox, the `celery-task-meta-` writes worker.redis.celery_results,
the operator's requeue (`forget_message`, `keep_failure`, `mark_requeued`, ...) worker.redis.requeue.
"""

DONE_KEY = "ticketq:done:{task_id}"
DIGEST_KEY = "ticketq:digest:{task_id}"
FAILED_KEY = "ticketq:failed:{task_id}"
REQUEUED_KEY = "ticketq:requeued"
PUBLISH_CALL_KEY = "ticketq:publish:{call}"
# Longer than any retrying of one call, and than TCP holds an unsent command (tcp_retries2: ~15 min).
PUBLISH_CALL_TTL_S = 1800
ANSWER_KEY = "ticketq:answer:{digest}"
ANSWERS_INDEX = "ticketq:answers"
CANCELLED = b"cancelled"  # a publish call's key when the call gave up before it ran (`Outbox.landed`)
