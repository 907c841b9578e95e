"""The gateway's HTTP server settings for uvicorn, and the one place that touches uvicorn's protocol
internals: h11 with a deadline on each request's head.

Why: uvicorn arms its keep-alive timer only after a response and cancels it on any byte received,
so a client that opens a connection and drips its headers (slowloris) holds it for ever. Here a
request's head (request line and headers) must be complete within TICKETQ_GATEWAY_HEADER_TIMEOUT_S
of the connection opening or of the previous response; else the connection is closed. The head's
size is bounded by h11 itself (TICKETQ_GATEWAY_MAX_HEADER_BYTES); the httptools protocol bounds
neither, so the gateway always runs h11. The 400 h11 answers for a head it cannot take (too large,
malformed) is given the gateway's error shape (`gateway.errors`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway import errors
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
# Checked against uvicorn 0.29-0.55: H11Protocol.connection_made / on_response_complete /
# send_400_response and its `conn` (h11.Connection), `loop` and `transport` attributes.
TESTED_UVICORN = ((0, 29), (0, 55))


def header_timed_h11(timeout_s: float) -> type[asyncio.Protocol] | str:
    """uvicorn's h11 protocol with a `timeout_s` deadline on each request's head; plain "h11" (with a
    warning) on a uvicorn outside TESTED_UVICORN."""
    version = tuple(int(part) for part in uvicorn.__version__.split(".")[:2])
    if not TESTED_UVICORN[0] <= version <= TESTED_UVICORN[1]:
        log.warning("uvicorn %s is untested here: no header timeout (TICKETQ_GATEWAY_HEADER_TIMEOUT_S); the "
                    "ingress's header timeout must bound slow clients", uvicorn.__version__)  # fmt: skip
        return "h11"

    class HeaderTimedH11(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # uvicorn's is text/plain: the gateway answers every refusal as {"error", "message"}
            payload = errors.body("bad_http_request", msg)
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=payload),
                          h11.EndOfMessage()):  # fmt: skip
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_overdue)

        def _head_overdue(self) -> None:
            # h11 leaves IDLE only once a whole request head is parsed.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimedH11


def uvicorn_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn.run's limits from the settings (docs/gateway.md, "Connection limits")."""
    return {
        "http": header_timed_h11(settings.gateway_header_timeout_s),
        "h11_max_incomplete_event_size": settings.gateway_max_header_bytes,
        "timeout_keep_alive": settings.gateway_keep_alive_s,
        "limit_concurrency": settings.gateway_max_connections,
    }
