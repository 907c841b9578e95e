"""The worker's Prometheus metric names: what dashboards and alert rules (deploy/) refer to.

Keep them in one place so a rename cannot leave a panel or an alert behind (tests/integration/test_deploy.py
checks every name deploy/ uses against this file). Names clients share (task, queue, streams)
are in ticketq.names; the Redis keys workers write, in worker.redis.keys.
"""

# Prometheus metric names (the client adds `_total` to counters, `_bucket/_sum/_count` to histograms).
METRIC_PREFIX = "ticketq"
M_TICKETS = "ticketq_tickets"  # counter, labels: queue, label, outcome
M_TOKENS_REAL = "ticketq_tokens_real"  # counter: real (non-pad) tokens run through the model
M_TOKENS_COMPUTED = "ticketq_tokens_computed"  # counter: all tokens computed, pads included
M_TOKENS_PADDED = "ticketq_tokens_padded"  # counter: pad tokens computed
M_PADDING_RATIO_LAST = "ticketq_batch_padding_ratio"  # gauge: last forward batch
M_BATCH_SIZE = "ticketq_batch_size"  # histogram: tickets per forward batch
M_BATCH_TOKENS = "ticketq_batch_tokens"  # histogram: padded tokens per forward batch
M_QUEUE_WAIT = "ticketq_queue_wait_seconds"  # histogram, labels: queue: enqueue -> batch start
M_FORWARD = "ticketq_forward_seconds"  # histogram: one forward batch
M_LATENCY = "ticketq_latency_seconds"  # histogram, labels: queue: enqueue -> result published
M_PREFIX_REUSES = "ticketq_prefix_cache_reuses"  # counter
M_DEAD_LETTERS = "ticketq_dead_letters"  # counter, labels: queue, reason
M_SHADOW_CHECKED = "ticketq_shadow_checked"  # counter
M_SHADOW_AGREED = "ticketq_shadow_agreed"  # counter
M_MODEL_INFO = "ticketq_model"  # info: model, standin, dtype, device, ..., scorer, heads
M_FLUSHES = "ticketq_flushes"  # counter: celery-batches flushes (buffer drains)
M_QUEUE_DEPTH = "ticketq_queue_depth"  # gauge, labels: queue: LLEN of the broker queue, sampled at scrape
M_DUPLICATES = "ticketq_duplicate_results"  # counter: re-executions whose result was already published
M_FIELD_ANSWERS = "ticketq_field_answers"  # counter: schema field answers, by queue, schema, field, label, review
M_SHADOW_DROPPED = "ticketq_shadow_dropped"  # counter: shadow samples dropped because the checker was busy
M_FIRST_RESULT = "ticketq_time_to_first_result_seconds"  # histogram: batch start -> its first result published
M_PUBLISH = "ticketq_publish_seconds"  # histogram: Redis work of publishing one forward batch's results
M_SHADOW_DISAGREED = "ticketq_shadow_disagreed"  # counter, labels: near_tie ("true": reference margin < NEAR_TIE)
M_REQUESTS_WAITING = "ticketq_requests_waiting"  # gauge: messages buffered in the worker, not yet in a job
M_REQUESTS_RUNNING = "ticketq_requests_running"  # gauge: messages of the running job not yet answered
M_BUILD_INFO = "ticketq_build"  # info: version, python, torch, transformers, celery, kombu
M_EXPORTER_REDIS_UP = "ticketq_exporter_redis_up"  # gauge: `ticketq exporter` read Redis at its last scrape
M_DEAD_LETTER_ENTRIES = "ticketq_dead_letter_entries"  # gauge (exporter): length of the dead-letter stream
M_RESULT_ENTRIES = "ticketq_result_entries"  # gauge (exporter): length of the results stream
M_CONSUMERS_ALIVE = "ticketq_consumers_alive"  # gauge (exporter): consumers holding a live lease
M_COST_MODEL = "ticketq_cost_model_seconds"  # gauge, labels: term (fixed, token, quad): the planner's cost model now
M_COST_MODEL_ERROR = "ticketq_cost_model_error_ratio"  # gauge: median relative error of the last live fit
M_COST_MODEL_FITS = "ticketq_cost_model_fits"  # counter: live refits kept
M_STALLED = "ticketq_classifying_stalled_seconds"  # gauge: seconds without progress with work in hand, past the bound
M_REDIS_DATA_LOST = "ticketq_redis_data_lost"  # counter: Redis found without its data (epoch marker gone)
M_ANSWERS = "ticketq_answers"  # counter, labels: precision, rechecked: answers by the arithmetic that computed them
M_RECHECKED = "ticketq_rechecked_tickets"  # counter: a fast precision's answers within its bound, redone in float32
M_ERROR_BOUND = "ticketq_precision_error_bound"  # gauge, labels: precision, schema: the re-check bound (log space)
M_DEDUPLICATED = "ticketq_deduplicated_tickets"  # counter: tickets answered with an identical ticket's answer
M_ANSWER_CACHE = "ticketq_answer_cache_lookups"  # counter, labels: result (hit, miss): the Redis answer cache
M_HOOK_ERRORS = "ticketq_hook_errors"  # counter, labels: hook, point: hook calls that raised (the job went on)

# A shadow disagreement where the reference's margin is below this is a near-tie: another summation
# order (bfloat16, oneDNN) may flip it without anything being wrong. The alert pages on the rest.
NEAR_TIE = 0.01
