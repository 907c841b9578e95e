"""The worker's `TicketService` run in the test process, on the machine's Redis (database 3, never
flushed: every check filters by its own task ids) with Celery's Redis result backend.

    client, app = service_fixtures("ticketq-NAME-test")   # at a test module's top: its two fixtures

`task_request` builds a request as celery-batches hands it to the service; `results_of` reads
the results stream back, for the given tasks only.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import datetime

import pytest
import redis
from celery import Celery
from celery_batches import SimpleRequest
from workers import celery_results_app, redis_or_skip

from ticketq import names

REDIS_URL = "redis://127.0.0.1:6379/3"


def service_fixtures(app_name: str):  # -> (client, app): two pytest fixtures
    """Module-scoped fixtures: `client` on REDIS_URL (skips without Redis, fails under CI) and `app`,
    a Celery app named `app_name` whose result backend is there (what the service is handed)."""

    @pytest.fixture(scope="module")
    def client() -> Iterator[redis.Redis]:
        client = redis_or_skip(REDIS_URL)
        yield client
        client.close()

    @pytest.fixture(scope="module")
    def app(client) -> Iterator[Celery]:
        app = celery_results_app(app_name, REDIS_URL)
        yield app
        app.close()

    return client, app


def task_request(payload: dict | list[dict], expires: datetime | None = None) -> SimpleRequest:
    """A classify task's request for one ticket (or a pack: a list), with Celery's `expires` if given."""
    headers = {"expires": expires.isoformat()} if expires else {}
    return SimpleRequest(str(uuid.uuid4()), names.TASK_CLASSIFY, (payload,), {}, {}, "test", False, None, None, headers)


def results_of(client: redis.Redis, task_ids: set[str]) -> list[dict]:
    """The results stream's entries of the tasks `task_ids`, in stream order."""
    entries = (json.loads(fields[b"data"]) for _, fields in client.xrange(names.RESULTS_STREAM))
    return [entry for entry in entries if entry["task_id"] in task_ids]
