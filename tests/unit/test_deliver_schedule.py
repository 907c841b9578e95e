"""The dispatcher's default retry schedule and consumer name (no Redis, no HTTP)."""

from __future__ import annotations

import os
import socket

import pytest

from gateway.deliver import pause_bounds
from gateway.settings import GatewaySettings

TEN_MINUTES_S = 600


@pytest.fixture(autouse=True)
def _no_ticketq_env(monkeypatch):
    for name in [name for name in os.environ if name.startswith("TICKETQ_")]:
        monkeypatch.delenv(name)


def test_the_default_schedule_rides_out_a_ten_minute_outage():
    """Even with every pause at its jittered least, the last POST of a result comes more than ten
    minutes after its first: a receiver down for ten minutes dead-letters nothing."""
    settings = GatewaySettings()
    least, most = pause_bounds(settings.deliver_max_attempts, settings.deliver_backoff_s,
                               settings.deliver_backoff_max_s)  # fmt: skip
    assert least > TEN_MINUTES_S
    assert most == 2 * least and most < 30 * 60  # and a dead receiver is still given up on within half an hour


def test_pause_bounds_sum_the_doubling_capped_pauses():
    assert pause_bounds(1, 0.5, 30) == (0, 0)  # one POST: no pause
    assert pause_bounds(4, 1, 3) == ((1 + 2 + 3) / 2, 1 + 2 + 3)


def test_the_default_consumer_name_survives_a_restart():
    """No pid in it: a restarted dispatcher reads its own pending entries under the same name."""
    from gateway.deliver import Dispatcher

    assert GatewaySettings().deliver_consumer is None
    assert Dispatcher.consumer_name(GatewaySettings()) == socket.gethostname()
    assert Dispatcher.consumer_name(GatewaySettings(deliver_consumer="eu-1")) == "eu-1"


def _state(first: str | None, last: str, read: int | None, added: int | None, length: int) -> tuple[dict, dict]:
    stream = {"first-entry": (first.encode(), {}) if first else None, "length": length}
    if added is not None:
        stream["entries-added"] = added
    return stream, {"last-delivered-id": last.encode(), "entries-read": read}


@pytest.mark.parametrize(
    ("first", "last", "read", "added", "length", "trimmed"),
    [
        ("5-0", "7-0", 7, 20, 16, 0),  # the stream still holds what follows the last read
        (None, "0-0", None, 0, 0, 0),  # empty
        ("9-0", "0-0", None, 1000, 150, 850),  # a new (or never read) group: all but what is left
        ("900-0", "100-0", 100, 1000, 150, 750),  # read 100, then 750 trimmed unread
        ("101-0", "100-0", 100, 250, 150, 0),  # trimmed exactly up to the last read: none lost
        ("900-0", "100-0", None, 1000, 150, None),  # entries-read unknown (an XDEL, a SETID)
        ("900-0", "100-0", 100, None, 150, None),  # Redis 6: no entries-added
    ],
)
def test_trimmed_unread_counts_what_the_group_never_read(first, last, read, added, length, trimmed):
    from gateway.group import trimmed_unread

    assert trimmed_unread(*_state(first, last, read, added, length)) == trimmed
