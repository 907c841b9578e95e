"""Celery's result backend format, written by ticketq itself: one script call per forward batch,
not a backend call per ticket (key `celery-task-meta-<task>`, what `AsyncResult.get()` waits on).

The one private library name used outside worker.transport is here: `BaseBackend._get_result_meta`,
which builds a failure's meta. It is listed with the others in worker.transport.guards.REQUIRED,
and `check_result_meta`, beside the meta it checks, stops the worker at start-up when the meta
`success_meta` builds is not exactly what the installed Celery stores.
"""

from __future__ import annotations

import json
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis
from celery import states

from ticketq.lua import script
from worker.transport.guards import IncompatibleLibrary

if TYPE_CHECKING:
    from celery.backends.base import BaseBackend

    from worker.redis.writes import Writes

STORE_ONCE = script(__package__, "store_once")  # Celery backend results, SET NX + PUBLISH


def store_successes(writes: Writes, backend: Any, successes: Sequence[tuple[Any, bytes]]) -> None:
    """Celery SUCCESS results for (request, value as JSON) pairs: one STORE_ONCE call on a Redis backend.

    The values come already serialised (each ticket's result JSON is the one streamed); with
    Celery's JSON result serializer the meta is assembled around them, not serialised again.
    """
    client = getattr(backend, "client", None)
    if not isinstance(client, redis.Redis):  # not a Redis backend: Celery's own write, one per task
        for request, value in successes:
            writes.retrying(lambda r=request, v=json.loads(value): backend.mark_as_done(r.id, v, request=r))
        return
    expires = int(backend.expires or 0)
    done = backend.app.now().isoformat()  # one date_done for the batch (Celery's now() is not cheap)
    keys = [backend.get_key_for_task(request.id) for request, _ in successes]
    if backend.serializer == "json":
        metas = [success_meta_json(request.id, value, done) for request, value in successes]
    else:
        metas = [backend.encode(success_meta(request.id, json.loads(value), done)) for request, value in successes]
    writes.durable(client, lambda target: target.eval(STORE_ONCE, len(keys), *keys, expires, *metas))


def mark_failed(writes: Writes, backend: Any, request: Any, exc: BaseException, state: str = states.FAILURE) -> None:
    """Celery FAILURE result for one request (or REVOKED, as Celery ends a message past its `expires`).

    On a Redis backend it is stored only where no result is yet (STORE_ONCE, as successes
    are), in Celery's format (`_get_result_meta`): a failure never overwrites the answer of a
    worker that took the message over (Celery's own check, a GET then a SET, leaves a window).
    Elsewhere Celery's mark_as_failure, with call_errbacks=False: it reads `request.errbacks`,
    which celery-batches' SimpleRequest lacks, and batch tasks carry no errbacks.
    """
    client = getattr(backend, "client", None)
    if isinstance(client, redis.Redis):  # set if absent, like a SUCCESS: never over another worker's answer
        meta = backend._get_result_meta(result=backend.prepare_exception(exc), state=state,
                                        traceback=None, request=request)  # fmt: skip
        meta["task_id"] = request.id
        keys, expires = [backend.get_key_for_task(request.id)], int(backend.expires or 0)
        writes.durable(client, lambda target: target.eval(STORE_ONCE, 1, *keys, expires, backend.encode(meta)))
        return
    if state == states.REVOKED:
        writes.retrying(lambda: backend.mark_as_revoked(request.id, str(exc), request=request))
        return
    writes.retrying(lambda: backend.mark_as_failure(request.id, exc, request=request, call_errbacks=False))


def success_meta(task_id: str, value: Any, date_done: str) -> dict:
    """Celery's result meta for a SUCCESS, as `BaseBackend._store_result` builds it (result_extended off).

    ticketq tasks have no children, group or parent, and the worker runs with
    `result_extended=False`; `check_result_meta` checks at start-up that this equals what the
    installed Celery stores.
    """
    return {"status": "SUCCESS", "result": value, "traceback": None, "children": [], "date_done": date_done,
            "task_id": task_id}  # fmt: skip


_VALUE_MARK = "\x00ticketq-value\x00"  # stands for the value in `success_meta_json`; JSON-escaped, never a real value


def success_meta_json(task_id: str, value_json: bytes, date_done: str) -> bytes:
    """`success_meta` as JSON, around a value that is JSON already (equal to json.dumps of the meta):
    the meta's shape stays defined once, in `success_meta`."""
    head, tail = json.dumps(success_meta(task_id, _VALUE_MARK, date_done)).split(json.dumps(_VALUE_MARK))
    return head.encode() + value_json + tail.encode()


def check_result_meta(backend: BaseBackend) -> None:
    """`store_successes` writes Celery's result meta itself (one script call per forward batch, not a
    backend call per ticket): it must be exactly what this Celery's backend would store."""
    request = types.SimpleNamespace(children=[], group=None, parent_id=None)  # a ticketq task's request
    theirs = backend._get_result_meta({"probe": 1}, "SUCCESS", None, request)
    theirs["task_id"] = "probe"  # BaseBackend._store_result adds it
    ours = success_meta("probe", {"probe": 1}, theirs["date_done"])
    if ours != theirs:
        raise IncompatibleLibrary(
            f"Celery's result meta changed: it stores {sorted(theirs)}, worker.redis.celery_results writes "
            f"{sorted(ours)}; see worker/redis/celery_results.py"
        )
