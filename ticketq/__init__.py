"""The contract that producers and workers share, and neither owns.

`names` (task, queue, streams, default labels), `contract` (the ticket schema, its one validator,
rejection reasons, result shapes), `config` (the client-side `TICKETQ_*` settings, URL masking)
and `connections` (a Redis client with a clear error). `producer/` and `worker/` both import it;
it imports neither, and nothing heavy (no torch, no Celery at import time).
"""
