"""What a worker does with one drained buffer of Celery requests, as stages with hooks.

Nothing is imported here (so no module of the package imports another through this one):
`worker.service.core.TicketService` is the entry, `worker.service.ports` what it needs around it.

    core        TicketService: the job, the last line of defence around each run
    admission   redeliveries split, arguments decoded once, tickets validated, expired, routed
    routing     which schema answers a ticket and which engine computes it
    loop        the classifying loop: add, schedule, forward, update, publish; retry: the halves policy
    answers     result records in the contract's shapes
    publish     results streamed once, backend written, messages acked, dead letters
    failing     what an unexpected error left open is failed (or left to whoever answered it)
    hooks/      observers: metrics, progress, live cost, shadow check, dead-letter accounting
    memory      an in-memory outbox for the unit tests

Results stream out per forward batch: the loop runs each forward itself and publishes the
answers the scheduler's `update` returns for it (results stream, Celery backend, attempts keys)
in pipelined round trips, instead of after the whole buffer. A packed message's backend result is
written once its last ticket is done.

Between two forwards the loop takes the requests that arrived meanwhile from the job's `Feed`
(`worker.transport.batches.Batches`): they are split and validated like the first ones and join
the scheduler's plan, so every forward is chosen from everything waiting at its start. A message
is acknowledged through the feed as soon as its result is out, not when the job ends.
"""
