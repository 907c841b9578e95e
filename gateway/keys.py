"""Every Redis key, stream, header and metric name the gateway and the dispatcher use.

The broker's own names (queue, results stream) are `ticketq.names`; these are the front door's.
"""

# A ticket the gateway accepted: `{queue}` and the ticket's id as sent to the workers (`tenant:id`
# with several tenants, see `gateway.intake.Intake.wire_id`) -> JSON {task_id (of the packed message
# that carries it), packed, metadata, token, tenant, id (as the tenant sent it)}, written with the
# message in one step (gateway.enqueue) and kept as long as results are (TICKETQ_RESULT_EXPIRES_S). A
# retried POST finds it and sends nothing; GET /v1/tickets/{id} tells "pending" from "unknown" by
# it; the dispatcher finds it by the result's `id` (that same sent id) and delivers the result to
# its tenant, with its metadata.
TICKET_KEY = "ticketq:gateway:ticket:{queue}:{ticket_id}"
# The messages the gateway queued to `{queue}` (gateway.enqueue, enqueue.lua), newest first: a list of
# `<running total of tickets>:<tickets of the message>`, trimmed to the queue's length at each push; the
# queue's depth in tickets is summed from it.
QUEUED_KEY = "ticketq:gateway:queued:{queue}"
# An Idempotency-Key seen: per tenant, sha256 of the key -> JSON {body sha256, answer, claim}; the
# answer is null while the first POST under the key is in flight (`gateway.intake.CLAIM_SCRIPT`).
IDEMPOTENCY_KEY = "ticketq:gateway:idem:{tenant}:{digest}"
# A review item decided on the review page: the review stream's entry id -> the decision record JSON
# (`ticketq.labelled`), written once by `gateway/review/decide.lua`, kept TICKETQ_RESULT_EXPIRES_S
# to tell a second reviewer who decided first. Each tenant's undecided items are pending in the
# consumer group `names.REVIEW_GROUP` under the consumer REVIEW_CONSUMER + tenant.
REVIEW_DECISION_KEY = "ticketq:review:decision:{entry_id}"
REVIEW_CONSUMER = "tenant:"
# The review page's session cookie (HttpOnly, SameSite=Strict; gateway.review.session signs it).
REVIEW_COOKIE = "ticketq_review"
# Results the dispatcher gave up on after TICKETQ_DELIVER_MAX_ATTEMPTS POSTs, with the last error.
DELIVER_DEAD_STREAM = "ticketq:deliver:dead"
# Ranges of the results stream trimmed before a dispatcher group read them: {group, after, before,
# count}; results stored in the Celery backend between `after` and `before` (stream ids, ms) are
# what `ticketq-deliver redeliver-trimmed` re-POSTs, and it deletes each range it repaired.
DELIVER_GAPS_STREAM = "ticketq:deliver:trimmed"
# Write-back (gateway.writeback): labels written to helpdesks given up on after
# TICKETQ_DELIVER_MAX_ATTEMPTS requests, as DELIVER_DEAD_STREAM's entries (`ticketq-writeback dead`).
WRITEBACK_DEAD_STREAM = "ticketq:writeback:dead"
# The state last written to a helpdesk ticket: target and the helpdesk's ticket id -> the sha256 of
# that write (`gateway.writeback.adapters.Write.digest`), kept TICKETQ_RESULT_EXPIRES_S; the same
# answer again is not re-written.
WRITEBACK_WRITTEN_KEY = "ticketq:writeback:written:{target}:{ticket}"
# Celery's result backend key of a task (what `redeliver-trimmed` reads).
CELERY_RESULT_KEY = "celery-task-meta-{task_id}"

# HTTP headers of a delivered result.
DELIVERY_HEADER = "X-Ticketq-Delivery"  # the same on every retry of one result: the receiver's idempotency key
SIGNATURE_HEADER = "X-Ticketq-Signature"  # sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>
TIMESTAMP_HEADER = "X-Ticketq-Timestamp"  # unix seconds of this attempt
IDEMPOTENCY_HEADER = "Idempotency-Key"

# Prometheus metric names (prometheus_client adds _total / _bucket suffixes where it should).
REQUESTS = "ticketq_gateway_requests"
REQUEST_SECONDS = "ticketq_gateway_request_seconds"
REJECTS = "ticketq_gateway_rejects"
TICKETS = "ticketq_gateway_tickets"
DELIVERIES = "ticketq_deliver_deliveries"
DELIVER_ATTEMPTS = "ticketq_deliver_attempts"
DELIVER_DEAD = "ticketq_deliver_dead_letters"
DELIVER_SECONDS = "ticketq_deliver_post_seconds"
DELIVER_TRIMMED = "ticketq_deliver_trimmed_results"
DELIVER_LAG = "ticketq_deliver_lag_results"
DELIVER_REPEATS = "ticketq_deliver_repeats"
WRITEBACK_WRITES = "ticketq_writeback_writes"
WRITEBACK_REQUESTS = "ticketq_writeback_requests"
WRITEBACK_DEAD = "ticketq_writeback_dead_letters"
WRITEBACK_SECONDS = "ticketq_writeback_request_seconds"
WRITEBACK_TRIMMED = "ticketq_writeback_trimmed_results"
WRITEBACK_LAG = "ticketq_writeback_lag_results"
WRITEBACK_SKIPPED = "ticketq_writeback_skipped"
WRITEBACK_REPEATS = "ticketq_writeback_repeats"
REVIEW_DECISIONS = "ticketq_gateway_review_decisions"
REVIEW_CONFLICTS = "ticketq_gateway_review_conflicts"
