"""The Redis store: every Redis write the worker makes besides the broker's own queue traffic.

- `keys` — every key and stream ticketq writes, what each holds and who writes it.
- `writes` — riding out a Redis that is away or refuses writes; replica confirmation (WAIT).
- `outbox` — publish once (results and review streams), dead letters; `publish_once.lua`.
- `attempts` — each message's delivery count and the epoch check read with it (the outbox's
  base); `count_deliveries.lua`.
- `celery_results` — Celery's result format, written by ticketq itself (`store_once.lua`), and
  its start-up check against the installed Celery.
- `requeue` — what `ticketq dead requeue` writes and clears.

Below it: worker.transport (kombu and Celery internals), worker.health (refusal episodes, data
loss, progress), ticketq. Nothing below imports this package.
"""
