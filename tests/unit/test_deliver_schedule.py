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
