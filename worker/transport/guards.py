"""Every private name of Celery, kombu, celery-batches, redis-py and torch that ticketq relies on,
checked at worker start-up.

`check_versions()` stops the worker, naming the library, when a version outside the range the
shims in `worker.transport` were written and tested against is installed, or when a name they
override, call or read is gone. The shims read these names directly (never with a default), so
a rename fails here, loudly, not later and silently.
"""

from __future__ import annotations

import logging
from importlib.metadata import version

import celery_batches
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

log = logging.getLogger(__name__)

# Library -> (lowest, first untested) versions the shims below were written and tested against.
TESTED = {"kombu": ((5, 5), (5, 8)), "celery": ((5, 4), (5, 7)), "celery-batches": ((0, 10), (0, 12))}
# Private names overridden or called below, per class.
REQUIRED = {
    kombu_redis.Channel: (
        "_brpop_start",
        "_brpop_read",
        "_in_poll",
        "_brpop_sent_at",
        "client",
        "_connparams",
        "_create_client",
        "conn_or_acquire",
        "_do_restore_message",
    ),
    kombu_redis.QoS: ("_remove_from_indices", "pipe_or_acquire", "restore_unacked", "restore_by_tag", "ack"),
    kombu_redis.Transport: ("register_with_event_loop",),
    virtual.QoS: ("can_consume_max_estimate",),
    virtual.Transport: ("_deliver",),
}
REDIS_MIN = (6, 2)  # BLMOVE



class IncompatibleLibrary(RuntimeError):
    """A library changed under a shim of this module."""


def check_versions() -> None:
    """Fail loudly at start-up when kombu, Celery or celery-batches moved under these shims."""
    for name, (low, high) in TESTED.items():
        found = version(name)
        parts = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
        if not low <= parts < high:
            raise IncompatibleLibrary(
                f"{name} {found} is outside the range ticketq's shims were tested with "
                f"({'.'.join(map(str, low))} <= version < {'.'.join(map(str, high))}); install a tested "
                f"version (pip install 'ticketq') or review worker/transport/ for this release"
            )
    for cls, names in REQUIRED.items():
        missing = [name for name in names if not hasattr(cls, name)]
        if missing:
            where = f"{cls.__module__}.{cls.__name__}"
            raise IncompatibleLibrary(f"{where} no longer has {missing}: see worker/transport/")
    for name in ("_do_flush", "flush", "Strategy"):  # Strategy sets the `_pool` that Batches.flush uses
        if not hasattr(celery_batches.Batches, name):
            raise IncompatibleLibrary(f"celery_batches.Batches no longer has {name}: see worker/transport/")
    for name in ("apply_batches_task", "SimpleRequest"):
        if not hasattr(celery_batches, name):
            raise IncompatibleLibrary(f"celery_batches no longer has {name}: see worker/transport/")
