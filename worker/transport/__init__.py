"""Everything ticketq builds on a private part of Celery, kombu, celery-batches or redis-py.

- `guards` — the tested version ranges and every private name relied on, checked at start-up.
- `fetch` — the atomic fetch: kombu's Redis transport (`Transport`, `Channel`, `QoS`), and the
  same through Redis Sentinel (`SentinelTransport`, `SentinelChannel`).
- `qos` — kombu's unacked record for the atomic fetch: recorded per batch, acked per turn, swept by
  Redis's clock.
- `lease` — each consumer's lease, renewed while both loops move.
- `recovery` — the recovery of consumers whose lease ran out.
- `batches` — celery-batches' task base, feeding the running job between forwards.
- `state` — the fetch's and leases' Redis state, one script (`worker_state.lua`; `fetch_more.lua`
  beside `fetch`).
- `events`, `consumer` — Celery's worker events and consumer, guarded.

Nothing outside this package touches a private name, except `worker.engine.kernels` (torch's) and
`worker.redis.celery_results` (Celery's result meta; listed in `guards.REQUIRED`). This package
imports nothing of the worker above it: only `ticketq` and `worker.health`.
`broker_transport = "worker.transport:Transport"` selects the atomic fetch
(`worker.transport:SentinelTransport` for a sentinel:// broker, with `amqp="worker.transport:AMQP"`
so that a failover to the next sentinel keeps it).
"""

from worker.transport.fetch import AMQP, TRANSPORT_OPTIONS, SentinelTransport, Transport

__all__ = ["AMQP", "TRANSPORT_OPTIONS", "SentinelTransport", "Transport"]
