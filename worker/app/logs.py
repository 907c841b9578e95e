"""The worker's log handling around Celery: a lost broker connection in one line, start-up lines kept."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import kombu.exceptions
import redis

# Celery's consumer logs each lost broker connection with its whole chained traceback (three per
# failover or restart): an outage, not a bug, gets its one line with the reason instead.
CONSUMER_LOGGER = "celery.worker.consumer.consumer"


_OUTAGES = (redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError, ConnectionError)


class OutageWithoutTraceback(logging.Filter):
    """A record whose exception is a lost connection keeps its message and the reason, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, _OUTAGES):
            record.msg, record.args = f"{record.getMessage()} ({type(exc).__name__}: {exc})", ()
            record.exc_info = record.exc_text = None
        return True


def quiet_outages(logger: logging.Logger | None = None) -> None:
    """Install `OutageWithoutTraceback` on Celery's consumer logger, once."""
    logger = logger or logging.getLogger(CONSUMER_LOGGER)
    if not any(isinstance(f, OutageWithoutTraceback) for f in logger.filters):
        logger.addFilter(OutageWithoutTraceback())


@contextmanager
def startup_logging() -> Iterator[None]:
    """worker_init runs before Celery configures logging: without this, the start-up INFO lines
    (dtype chosen, model ready, autotune fit) were dropped and only warnings reached the log."""
    logger = logging.getLogger("worker")
    if logging.getLogger().handlers or logger.handlers:  # somebody configured logging already
        yield
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
