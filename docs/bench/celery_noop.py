"""The yardstick for docs/bench/queue_ceiling.py: stock Celery, one no-op task, no ticketq code.

    .venv/bin/python docs/bench/queue_ceiling.py --tickets 4000 --plain-celery --prefill

The same settings a ticketq worker runs with where they bear on the queue path (Redis broker
and backend, JSON, acks_late, the threads pool with one thread, prefetch 128, stock kombu fetch),
and a task that returns at once: what Celery itself costs per message on this machine.
"""

from __future__ import annotations

import os

from celery import Celery

BROKER = os.environ.get("NOOP_BROKER_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("NOOP_QUEUE", "noop")

app = Celery("noop", broker=BROKER, backend=BROKER)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    worker_prefetch_multiplier=128,
    task_default_queue=QUEUE,
    result_expires=600,
    broker_connection_retry_on_startup=True,
)


@app.task(name="noop")
def noop(ticket: dict) -> dict:
    return {"id": ticket.get("id"), "status": "ok", "label": "noop"}
