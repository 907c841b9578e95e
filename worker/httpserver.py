"""The worker's HTTP server: `/metrics`, `/healthz` (alive), `/readyz` (every check passes), else 404.

Standard library only (wsgiref, threads); what it serves comes from the caller: the metrics WSGI
app and the readiness checks (`worker.metrics.Metrics.serve`, `ticketq exporter`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from ticketq.errors import TicketqError

Check = Callable[[], "str | None"]  # a readiness check: None when fine, else why not


class MetricsPortInUse(TicketqError, OSError):
    """The metrics port is taken; the message names the port and TICKETQ_METRICS_PORT."""


def port_problem(host: str, port: int) -> str | None:
    """Why the metrics server could not listen on host:port, or None; checked before the model loads."""
    if not port:
        return None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the HTTP server will
            probe.bind((host, port))
    except OSError as exc:
        return _port_message(host, port, exc)
    return None


def _port_message(host: str, port: int, exc: OSError) -> str:
    why = "already in use" if isinstance(exc, OSError) and exc.errno in (98, 48) else (exc.strerror or str(exc))
    return (f"TICKETQ_METRICS_PORT={port}: cannot listen on {host}:{port} ({why}); set TICKETQ_METRICS_PORT to "
            "a free port (each worker on a host needs its own), or 0 to turn metrics off")


def wsgi_server(host: str, port: int, app: Callable) -> WSGIServer:
    """A threading HTTP server for `app` on host:port, not yet serving; `MetricsPortInUse` names the port."""
    try:
        return make_server(host, port, app, _server_class(host, port), handler_class=_QuietHandler)
    except OSError as exc:
        raise MetricsPortInUse(exc.errno, _port_message(host, port, exc)) from None


def health_app(metrics_app: Callable, checks: Iterable[Check], about: Callable[[], str] | None = None) -> Callable:
    """WSGI: /metrics, /healthz (alive), /readyz (every check passes, else 503 with reasons; then
    `about`'s line), else 404."""
    checks = list(checks)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            return _reply(start_response, "200 OK", "ok")
        if path == "/readyz":
            problems = [problem for problem in map(_run_check, checks) if problem]
            status, text = ("503 Service Unavailable", "not ready: " + "; ".join(problems)) if problems \
                else ("200 OK", "ready")  # fmt: skip
            line = _about(about)
            return _reply(start_response, status, f"{text}\n{line}" if line else text)
        if path == "/metrics":
            return metrics_app(environ, start_response)
        return _reply(start_response, "404 Not Found", "not found: try /metrics, /healthz or /readyz")

    return app


def _about(about: Callable[[], str] | None) -> str:
    if about is None:
        return ""
    try:
        return about()
    except Exception:  # the answer stands without it (Redis away: a check says so)
        return ""


def _run_check(check: Check) -> str | None:
    try:
        return check()
    except Exception as exc:  # a broken check is a reason not to be ready, not a crashed probe
        return f"readiness check failed ({type(exc).__name__}: {exc})"


def _reply(start_response: Callable, status: str, text: str) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
    return [body]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a hung scrape must not keep the worker from exiting


def _server_class(host: str, port: int) -> type[WSGIServer]:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv6 hosts ("::") too
    return type("MetricsServer", (_ThreadingServer,), {"address_family": family})


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds would flood the worker's log
