"""The gateway's HTTP API (FastAPI on uvicorn): tickets in, their results out, helpdesk webhooks,
health, readiness and metrics. The rules live in `gateway.intake` (tickets, idempotency,
backpressure), `gateway.auth` (tokens, rate) and `gateway.webhooks` (signatures, mappings); this
module maps them onto routes and statuses.

Statuses: 202 accepted (every ticket is in Redis) · 200 a result · 400 not JSON, nested deeper than 32,
a non-finite number, not a ticket or a list, a bad query parameter · 401 no or wrong token (with
`WWW-Authenticate: Bearer`), bad webhook signature ·
404 unknown ticket or source, admin endpoints off · 408 a body not received in
TICKETQ_GATEWAY_BODY_TIMEOUT_S · 409 an Idempotency-Key whose first POST is still in flight ·
413 body above TICKETQ_GATEWAY_MAX_BODY_BYTES, or too many
tickets · 422 a ticket breaks the contract (each bad field named) · 429 rate limit, or the request's
new tickets would take the queue past TICKETQ_GATEWAY_MAX_QUEUE_DEPTH · 503 Redis unreachable or refusing writes,
or more than TICKETQ_GATEWAY_MAX_CONNECTIONS at once (`gateway.server`). Every
refusal is JSON `{"error": reason, "message": one line}` (`gateway.errors`: also 404/405/500 and
h11's 400); 429 and 503 carry Retry-After. The OpenAPI document is `gateway.openapi`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from gateway import errors, intake, webhooks
from gateway import openapi as api_document
from gateway.auth import TokenBuckets, caller, tenant_of
from gateway.intake import Intake, Refused
from gateway.keys import IDEMPOTENCY_HEADER
from gateway.metrics import GatewayMetrics
from gateway.review import pages as review_pages
from gateway.settings import GatewaySettings
from ticketq import codec, connections

log = logging.getLogger(__name__)
MAX_WAIT_S = 30.0  # the longest long-poll of GET /v1/tickets/{id}?wait=
POLL_PAUSE_S = (0.02, 0.5)  # a long-poll's pause between reads: the first, the longest (doubling)
THREADS = 16  # Redis calls run in worker threads, this many at once (one Producer each)


class TicketIn(BaseModel):
    """One ticket, as `ticketq.contract` defines it (checked by its rule, not by this model)."""

    id: str | int | None = Field(None, description="Your ticket id; a retried POST of the same id is a no-op.")
    text: str = Field(..., description="The ticket's text (UTF-8, at most TICKETQ_MAX_TICKET_BYTES bytes).")
    schema_: str | None = Field(None, alias="schema", description="The schema (fields) to answer it with.")
    metadata: dict[str, Any] | None = Field(None, description="Kept with the ticket; delivered with its result.")


_TICKETS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "anyOf": [{"$ref": "#/components/schemas/TicketIn"},
              {"type": "array", "items": {"$ref": "#/components/schemas/TicketIn"}}]}}}}}  # fmt: skip


def create_app(settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> FastAPI:
    """The ASGI app; `settings` as `GatewaySettings.from_env()` reads them."""
    state = _State(settings, metrics or GatewayMetrics.build())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await state.intake.enqueue.aclose()
        state.intake.close()

    # /docs and /openapi.json are served by `_ops_routes`, behind TICKETQ_GATEWAY_ADMIN_TOKENS.
    app = FastAPI(title="ticketq gateway", version="1", lifespan=lifespan, description=__doc__,
                  docs_url=None, redoc_url=None, openapi_url=None)  # fmt: skip
    app.state.gateway = state
    errors.install(app)
    app.exception_handler(Refused)(state.refused)
    app.add_middleware(_Measured, metrics=state.metrics)
    _ticket_routes(app, state)
    _ops_routes(app, state)
    review_pages.install(app, state, state.metrics.registry, lambda: state.intake.producer.redis)
    app.openapi_schema = None
    api_document.document(app, (TicketIn,))
    return app


class _Measured:
    """Counts and times each HTTP request by route template and status (a plain ASGI middleware:
    Starlette's BaseHTTPMiddleware costs a task and a stream per request)."""

    def __init__(self, app: Any, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = getattr(scope.get("route"), "path", "other")
            self.metrics.requests.labels(route, str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)


class _State:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.settings, self.metrics = settings, metrics
        self.intake = Intake(settings)
        self.buckets = TokenBuckets(settings.gateway_rate, settings.gateway_burst)
        self.sources = webhooks.load_sources(settings.gateway_webhook_mapping)
        self.limiter = anyio.CapacityLimiter(THREADS)

    async def run(self, call: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(call, *args, limiter=self.limiter)

    async def refused(self, request: Request, exc: Refused) -> JSONResponse:
        self.metrics.rejects.labels(exc.reason).inc()
        headers = {**exc.headers, **({"Retry-After": str(exc.retry_after)} if exc.retry_after else {})}
        return JSONResponse(exc.body(), exc.status, headers=headers or None)

    def authorize(self, request: Request) -> Caller:
        """The caller: its token name (rate-limited) and tenant, or `Refused` 401/429."""
        if self.settings.gateway_anonymous and not self.settings.gateway_tokens:
            name = "anonymous"
        else:
            name = caller(request.headers.get("authorization"), self.settings.gateway_tokens)
            if name is None:
                raise _unauthorized("missing or unknown bearer token (Authorization: Bearer TOKEN)")
        self.limit(name)
        return Caller(name, tenant_of(name))

    def authorize_admin(self, request: Request) -> None:
        """`Refused` 404 when TICKETQ_GATEWAY_ADMIN_TOKENS is empty, 401 without one of its tokens."""
        if not self.settings.gateway_admin_tokens:
            raise Refused(404, "admin_off", "this endpoint is off: set TICKETQ_GATEWAY_ADMIN_TOKENS to open it")
        if caller(request.headers.get("authorization"), self.settings.gateway_admin_tokens) is None:
            raise _unauthorized("missing or unknown admin token (TICKETQ_GATEWAY_ADMIN_TOKENS)")

    def limit(self, name: str) -> None:
        wait_s = self.buckets.take(name)
        if wait_s:
            raise Refused(429, "rate_limited", f"{name} is above {self.settings.gateway_rate:g} requests/s "
                          f"(TICKETQ_GATEWAY_RATE)", [], TokenBuckets.retry_after(wait_s))  # fmt: skip

    async def body(self, request: Request) -> bytes:
        """The request body, or `Refused` 413 as soon as it is known to pass the limit."""
        limit = self.settings.gateway_max_body_bytes
        too_big = Refused(413, "body_too_large", f"the body is above TICKETQ_GATEWAY_MAX_BODY_BYTES={limit} bytes")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        timeout_s = self.settings.gateway_body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # a client that stalls its body holds no slot for long
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_big
                    chunks.append(chunk)
        except TimeoutError:
            raise Refused(408, "body_timeout", f"the body was not received within TICKETQ_GATEWAY_BODY_TIMEOUT_S="
                          f"{timeout_s:g} s", headers={"Connection": "close"}) from None  # fmt: skip
        return b"".join(chunks)

    async def take(self, tickets: list[object], who: Caller, key: str | None, body: bytes) -> JSONResponse:
        """Check and accept `tickets` (one POST's), answering an Idempotency-Key's retry as the first time."""
        seed = intake.body_digest(f"{who.tenant}:{key}".encode())[:24] if key is not None else None
        checked = intake.check_tickets(tickets, self.settings, seed)
        claim = None
        if key is not None:
            claim, stored = await self.intake.claim(who.tenant, key, intake.body_digest(body))
            if stored is not None:
                return JSONResponse(stored, 202, headers={"Idempotent-Replayed": "true"})
        try:
            rows = await self.intake.accept(checked, who.tenant, who.token)
        except Exception:
            if claim is not None:
                await self.intake.release(who.tenant, key, claim)
            raise
        for status, count in Counter(row["status"] for row in rows).items():
            self.metrics.tickets.labels(status).inc(count)
        answer = {"tickets": rows}
        if claim is not None:
            await self.intake.remember(who.tenant, key, claim, answer)
        return Response(codec.dumps(answer), 202, media_type="application/json")  # orjson: the stdlib's cost, a fifth


class Caller(NamedTuple):
    """Who sent a request: the token's name (its rate bucket) and its tenant."""

    token: str
    tenant: str


def _unauthorized(message: str) -> Refused:
    return Refused(401, "unauthorized", message, headers={"WWW-Authenticate": 'Bearer realm="ticketq"'})


def _ticket_routes(app: FastAPI, state: _State) -> None:
    @app.post("/v1/tickets", status_code=202, openapi_extra=_TICKETS_BODY, summary="Send one ticket or a list")
    async def post_tickets(request: Request) -> JSONResponse:
        who = state.authorize(request)
        body = await state.body(request)
        key = request.headers.get(IDEMPOTENCY_HEADER)
        return await state.take(intake.parse_body(body), who, key or None, body)

    @app.get("/v1/tickets/{ticket_id}", summary="A ticket's result: 200 done, 202 pending, 404 unknown")
    async def get_ticket(request: Request, ticket_id: str,
                         wait: float = Query(0, ge=0, le=MAX_WAIT_S)) -> JSONResponse:  # fmt: skip
        who = state.authorize(request)
        deadline, pause = time.monotonic() + wait, POLL_PAUSE_S[0]
        while True:
            status, body = await state.run(state.intake.lookup, ticket_id, who.tenant)
            remaining = deadline - time.monotonic()
            if status != 202 or remaining <= 0:
                return JSONResponse(body, status)
            await asyncio.sleep(min(pause, remaining))
            pause = min(pause * 2, POLL_PAUSE_S[1])

    @app.post("/v1/webhooks/{source}", status_code=202, summary="A helpdesk's signed ticket webhook "
              "(`source@tenant` for a tenant's own secret)")
    async def post_webhook(request: Request, source: str) -> JSONResponse:
        found = state.sources.get(source.partition("@")[0])  # `zendesk@acme`: the zendesk mapping, acme's secret
        if found is None:
            raise Refused(404, "unknown_source", f"no webhook source {source!r}; configured: "
                          f"{', '.join(sorted(state.sources)) or 'none'}")  # fmt: skip
        body = await state.body(request)
        secret = state.settings.gateway_webhook_secrets.get(source)
        if secret is None:
            raise Refused(401, "no_secret", f"source {source!r} has no secret (TICKETQ_GATEWAY_WEBHOOK_SECRETS)")
        try:
            webhooks.verify(found, secret.get_secret_value().encode(), request.headers, body,
                            state.settings.gateway_webhook_window_s)  # fmt: skip
        except webhooks.BadSignature as exc:
            raise Refused(401, "bad_signature", str(exc)) from None
        state.limit(f"webhook:{source}")
        payload = intake.parse_body(body)[0]
        if webhooks.is_ping(found, payload):  # a helpdesk checking the URL (Intercom's `ping`): nothing to take
            return JSONResponse({"status": "ok"}, 200)
        try:
            ticket = webhooks.ticket_of(found, payload, body, state.settings.max_ticket_bytes)
        except webhooks.Unmapped as exc:
            raise Refused(422, "unmapped_payload", str(exc)) from None
        return await state.take([ticket], Caller(f"webhook:{source}", tenant_of(source)), None, body)


def _ops_routes(app: FastAPI, state: _State) -> None:
    @app.get("/healthz", summary="The process answers")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", summary="Redis answers and takes writes: 200, else 503")
    async def readyz() -> JSONResponse:
        def check() -> str | None:
            return connections.write_problem(state.intake.producer.redis)

        try:
            problem = await state.run(check)
        except Exception as exc:
            problem = f"Redis is not reachable ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        if problem:
            return JSONResponse({"status": "not ready", "reason": problem}, 503,
                                headers={"Retry-After": str(state.settings.gateway_retry_after_s)})  # fmt: skip
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", summary="Prometheus metrics (an admin token: TICKETQ_GATEWAY_ADMIN_TOKENS)")
    async def metrics(request: Request) -> Response:
        state.authorize_admin(request)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> JSONResponse:
        state.authorize_admin(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        state.authorize_admin(request)
        return HTMLResponse(api_document.docs_page(app.openapi()))
