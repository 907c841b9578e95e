"""What this worker process knows of its own health, below every other worker layer.

- `progress` — whether the classifying loop moves: the service marks it, the lease holds back
  while it is stalled.
- `refusals` — Redis refusing writes (full, too few replicas, results not on the replicas), as
  episodes shared by every thread: the outbox, the transport's fetch and acks, the lease.
- `data_loss` — Redis found without its data, as this process noticed it.

Standard library and `ticketq` only: the transport, the Redis store, the service and the metrics
all import these records, none through another. `/readyz` and the metrics read them.
"""
