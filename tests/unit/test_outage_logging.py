"""A lost broker connection is one line with its reason, not Celery's chained traceback; any
other exception keeps its traceback."""

from __future__ import annotations

import io
import logging

import kombu.exceptions
import pytest
import redis

from worker.app import CONSUMER_LOGGER, quiet_outages


@pytest.fixture
def consumer_log():
    logger = logging.getLogger(CONSUMER_LOGGER)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    quiet_outages()
    quiet_outages()  # once, however often a process builds an app
    yield logger, out
    logger.removeHandler(handler)


def _logged(logger: logging.Logger, exc: BaseException) -> None:
    try:
        try:
            raise OSError("connection reset")
        except OSError as inner:
            raise exc from inner
    except BaseException:
        logger.warning("consumer: Connection to broker lost. Trying to re-establish the connection...", exc_info=True)


@pytest.mark.parametrize("exc", [redis.ConnectionError("Connection closed by server."),
                                 kombu.exceptions.OperationalError("Error 111 connecting")])  # fmt: skip
def test_a_lost_connection_is_one_line_with_its_reason(consumer_log, exc):
    logger, out = consumer_log
    _logged(logger, exc)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.getvalue(), out.getvalue()
    assert lines[0].endswith(f"({type(exc).__name__}: {exc})")
    assert sum(isinstance(f, logging.Filter) for f in logger.filters) >= 1


def test_any_other_error_keeps_its_traceback(consumer_log):
    logger, out = consumer_log
    _logged(logger, KeyError("a bug"))
    assert "Traceback" in out.getvalue() and "KeyError" in out.getvalue()
