"""The gateway's HTTP server settings for uvicorn, and the one place that touches uvicorn's protocol
internals: h11 with a deadline on each request's head.

Why: uvicorn arms its keep-alive timer only after a response and cancels it on any byte received,
so a client that opens a connection and drips its headers (slowloris) holds it for ever. Here a
request's head (request line and headers) must be complete within TICKETQ_GATEWAY_HEADER_TIMEOUT_S
of the connection opening or of the previous response; else the connection is closed. The head's
size is bounded by h11 itself (TICKETQ_GATEWAY_MAX_HEADER_BYTES); the httptools protocol bounds
neither, so the gateway always runs h11. The 400 h11 answers for a head it cannot take (too large,
malformed) is given the gateway's error shape (`gateway.errors`).

Neither deadline (the head's, uvicorn's keep-alive) closes a connection whose next request already
waits unread in its socket: uvloop runs the timers that fell due while it was busy before it reads
what arrived meanwhile, and a close then would drop that request with a reset, unanswered. The
keep-alive close is skipped (reading the request cancels it); the head's deadline is judged again
once those bytes are read.

The connection limit (TICKETQ_GATEWAY_MAX_CONNECTIONS) is the gateway's own, not uvicorn's
`limit_concurrency`: uvicorn's answer above its limit is a plain-text 503 without Retry-After, and
it counts every open connection (idle keep-alive ones too), so a limit of ours set a little below
it would still let its plain text answer first once that many clients are connected. Here the same
counts uvicorn reads (its server's open connections and requests in flight) are read by the app's
wrapper (`Limited`) before each request, and one above the limit is answered 503 `too_many_connections`
in the error shape with Retry-After (TICKETQ_GATEWAY_RETRY_AFTER_S) and `Connection: close`, counted
in `ticketq_gateway_rejects_total`. On a uvicorn outside TESTED_UVICORN, uvicorn's own limit is set.
"""

from __future__ import annotations

import asyncio
import logging
import select
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway import errors
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings

log = logging.getLogger(__name__)
# Checked against uvicorn 0.29-0.55: H11Protocol.connection_made / data_received / on_response_complete /
# send_400_response / timeout_keep_alive_handler and its `conn` (h11.Connection), `loop`, `transport`,
# `app`, `connections` (the server's open connections) and `tasks` (its requests in flight) attributes.
TESTED_UVICORN = ((0, 29), (0, 55))


class Limited:
    """The ASGI app behind the gateway's connection limit: a request that finds more than `limit`
    connections open or requests in flight (each counting its own) is answered 503 in the error shape."""

    def __init__(self, app: Any, connections: set, tasks: set, settings: GatewaySettings,
                 refused: Callable[[], None]) -> None:  # fmt: skip
        self.app, self.connections, self.tasks, self.refused = app, connections, tasks, refused
        self.limit, self.retry_after_s = settings.gateway_max_connections, settings.gateway_retry_after_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if len(self.connections) <= self.limit and len(self.tasks) <= self.limit:
            await self.app(scope, receive, send)
            return
        self.refused()
        payload = errors.body("too_many_connections", f"the gateway serves more than TICKETQ_GATEWAY_MAX_CONNECTIONS="
                              f"{self.limit} connections or requests at once; retry after {self.retry_after_s} s")
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            (b"retry-after", str(self.retry_after_s).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


class GatewayH11(H11Protocol):
    """uvicorn's h11 protocol with the head's deadline and the connection limit; `gateway_h11` binds its
    `settings` and `refused` (a subclass each)."""

    settings: GatewaySettings
    refused: Callable[[], None]
    _head_timer: asyncio.TimerHandle | None = None
    _head_late = False  # the head's deadline passed with bytes unread: judged once they are read

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn reads `self.app` for each request; the counts are its server's, shared by every connection
        self.app = Limited(self.app, self.connections, self.tasks, self.settings, self.refused)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_late:
            self._head_late = False
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # what had come by the deadline was no whole head

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def timeout_keep_alive_handler(self) -> None:
        if not unread(self.transport):  # else the next request is here: reading it cancels this close
            super().timeout_keep_alive_handler()

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
        self._head_timer = self.loop.call_later(self.settings.gateway_header_timeout_s, self._head_overdue)

    def _head_overdue(self) -> None:
        # h11 leaves IDLE only once a whole request head is parsed.
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if unread(self.transport):
            self._head_late = True
        else:
            self.transport.close()


def gateway_h11(settings: GatewaySettings, refused: Callable[[], None]) -> type[asyncio.Protocol] | str:
    """uvicorn's h11 protocol with a deadline on each request's head (TICKETQ_GATEWAY_HEADER_TIMEOUT_S) and
    the gateway's connection limit (`Limited`); plain "h11" (with a warning) on a uvicorn outside TESTED_UVICORN."""
    version = tuple(int(part) for part in uvicorn.__version__.split(".")[:2])
    if not TESTED_UVICORN[0] <= version <= TESTED_UVICORN[1]:
        log.warning("uvicorn %s is untested here: no header timeout, uvicorn's plain-text 503 above "
                    "TICKETQ_GATEWAY_MAX_CONNECTIONS; the ingress must bound slow clients", uvicorn.__version__)
        return "h11"

    return type("GatewayH11", (GatewayH11,), {"settings": settings, "refused": staticmethod(refused)})


def unread(transport: asyncio.Transport) -> bool:
    """Whether bytes (or the peer's end of stream) wait in the transport's socket, not yet read by the loop."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()  # not select.select: a server's descriptors pass FD_SETSIZE
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def uvicorn_options(settings: GatewaySettings, metrics: GatewayMetrics) -> dict[str, Any]:
    """uvicorn.run's limits from the settings (docs/gateway.md, "Connection limits"); refusals above the
    connection limit are counted in `metrics` (the app's)."""
    http = gateway_h11(settings, metrics.rejects.labels("too_many_connections").inc)
    return {
        "http": http,
        "h11_max_incomplete_event_size": settings.gateway_max_header_bytes,
        "timeout_keep_alive": settings.gateway_keep_alive_s,
        "limit_concurrency": settings.gateway_max_connections if http == "h11" else None,  # else ours: `Limited`
    }
