"""Every private name of Celery, kombu, celery-batches and redis-py that ticketq relies on,
checked at worker start-up.

`check_versions()` stops the worker when a version outside the range the shims in
`worker.transport` were written and tested against is installed, or when a name they override,
call or read is gone, naming each one. The shims use these names directly (never through a
`getattr` default), so a rename fails here, loudly, instead of switching a fix off in silence.
torch's private ops are guarded where they are used, in `worker.engine.kernels`; the result meta
ticketq writes in Celery's format is checked against Celery's in `worker.redis.celery_results`.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import celery_batches
import kombu
import redis.connection
from celery.app.amqp import AMQP
from celery.backends.base import BaseBackend
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer
from celery.worker.consumer.heart import Heart
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual

from ticketq.errors import TicketqError

log = logging.getLogger(__name__)

# Library -> (lowest, first untested) versions the shims were written and tested against.
TESTED = {"kombu": ((5, 5), (5, 8)), "celery": ((5, 4), (5, 7)), "celery-batches": ((0, 10), (0, 12))}

# Owner (class or module) -> the names ticketq overrides, calls or reads on it.
REQUIRED: dict[Any, tuple[str, ...]] = {
    kombu_redis.Channel: (
        "_brpop_start",
        "_brpop_read",
        "_in_poll",
        "_brpop_sent_at",
        "_connparams",
        "_create_client",
        "_disconnect_pools",
        "_do_restore_message",
        "client",
        "conn_or_acquire",
        "sep",
        "priority_steps",
        "from_transport_options",
        "socket_timeout",
        "socket_connect_timeout",
        "health_check_interval",
    ),
    kombu_redis.QoS: ("_remove_from_indices", "restore_unacked", "restore_by_tag", "ack",
                      "restore_visible", "unacked_key", "unacked_index_key", "unacked_mutex_key",
                      "unacked_mutex_expire", "visibility_timeout"),
    kombu_redis: ("Mutex", "MutexHeld"),  # qos.QoS.restore_visible: kombu's sweep mutex
    kombu_redis.Transport: ("register_with_event_loop", "connection_errors"),
    # fetch.SentinelChannel leaves building its pools to kombu's: the master from the sentinels.
    kombu_redis.SentinelChannel: ("_get_pool", "_sentinel_managed_pool", "from_transport_options"),
    kombu_redis.SentinelTransport: ("default_port",),
    kombu_redis.MultiChannelPoller: ("discard",),
    virtual.QoS: ("can_consume_max_estimate", "can_consume"),
    kombu.Connection: ("switch",),  # fetch.PinnedConnection keeps its transport across it
    AMQP: ("Connection",),
    virtual.Transport: ("_deliver",),
    celery_batches.Batches: ("_do_flush", "flush", "Strategy"),
    celery_batches: ("apply_batches_task", "SimpleRequest"),
    Consumer: ("create_task_handler", "on_invalid_task", "on_ready", "shutdown", "Blueprint"),
    worker_state: ("task_reserved", "task_accepted", "task_ready", "active_requests", "all_total_count",
                   "SOFTWARE_INFO"),
    Consumer.Blueprint: ("default_steps",),
    BaseBackend: ("_get_result_meta",),
}

# Instance attributes, assigned in a constructor or method rather than declared on the class:
# (owner, function that assigns them) -> the names, each found as `self.<name>` in its source.
ASSIGNED: dict[tuple[Any, str], tuple[str, ...]] = {
    (virtual.Message, "__init__"): ("_raw",),  # the message as fetched: kombu's unacked record
    (celery_batches.Batches, "__init__"): ("_tref", "_buffer"),  # the flush timer; the buffered requests
    (celery_batches.Batches, "Strategy"): ("_pool",),  # the worker's pool
    (kombu_redis.Channel, "__init__"): ("_queue_cycle", "brpop_timeout"),
    (kombu_redis.Transport, "__init__"): ("cycle",),  # the poller a channel is taken out of
    (kombu.Connection, "__init__"): ("alt",),  # the `;`-separated URLs: the sentinels' addresses
    (kombu.Connection, "_init_params"): ("transport_cls",),
    (redis.connection.AbstractConnection, "disconnect"): ("_sock",),  # fetch.Channel._lost_reply: dropped?
}

REDIS_MIN = (6, 2)  # BLMOVE

# The consumer step `consumer.GuardedConsumer` leaves out: it must exist in Celery's blueprint.
HEART_STEP = f"{Heart.__module__}:{Heart.__name__}"


class IncompatibleLibrary(TicketqError, RuntimeError):
    """A library changed under a shim of `worker.transport`."""


def missing_names(
    required: Mapping[Any, tuple[str, ...]] = REQUIRED,
    assigned: Mapping[tuple[Any, str], tuple[str, ...]] = ASSIGNED,
) -> list[str]:
    """Every guarded name that is gone, as `owner.name`."""
    missing = [f"{_name(owner)}.{name}" for owner, names in required.items() for name in names
               if not hasattr(owner, name)]  # fmt: skip
    for (owner, function), names in assigned.items():
        source = _source(getattr(owner, function, None))
        missing += [f"{_name(owner)}.{name}" for name in names if f"self.{name}" not in source]
    return missing


def check_versions() -> None:
    """Fail loudly at start-up when kombu, Celery or celery-batches moved under the shims."""
    for name, (low, high) in TESTED.items():
        found = version(name)
        parts = tuple(int(p) for p in found.split(".")[:2] if p.isdigit())
        if not low <= parts < high:
            raise IncompatibleLibrary(
                f"{name} {found} is outside the range ticketq's shims were tested with "
                f"({'.'.join(map(str, low))} <= version < {'.'.join(map(str, high))}); install a tested "
                f"version (pip install 'ticketq') or review worker/transport/ for this release"
            )
    missing = missing_names()
    if HEART_STEP not in Consumer.Blueprint.default_steps:
        missing.append(f"celery.worker.consumer.Consumer.Blueprint.default_steps[{HEART_STEP!r}]")
    if missing:
        raise IncompatibleLibrary(f"private names ticketq relies on are gone: {', '.join(missing)}; "
                                  "see worker/transport/guards.py")  # fmt: skip


def _name(owner: Any) -> str:
    return owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"


def _source(function: Any) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):  # gone, or not Python source
        return ""
