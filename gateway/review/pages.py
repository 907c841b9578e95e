"""The review page: server-rendered HTML (jinja2, autoescaped, no external assets) on the gateway.

    GET  /review                   log-in form, or the tenant's oldest undecided items
    POST /review/login             form `token` -> session cookie (`gateway.review.session`), 303 /review
    POST /review/logout            ends the session (CSRF-checked)
    POST /review/items/{entry id}  form `field:<name>` = label(s), `csrf` -> the decision, once

A caller is a token of TICKETQ_GATEWAY_TOKENS, by session cookie or `Authorization: Bearer` (a
script; no CSRF token needed without a cookie), and sees only its tenant's items. Statuses: 200
page · 303 after a login, a logout or a decision · 401 unknown token · 403 bad CSRF token · 404 page
off (no TICKETQ_GATEWAY_REVIEW_SECRET) or no such item of the tenant · 409 decided before (the page
names who and when) · 413 body too large · 422 a label that is not the field's · 429 rate limit.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import parse_qs, quote

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from prometheus_client import CollectorRegistry, Counter

from gateway import keys
from gateway.auth import caller, tenant_of
from gateway.review import session
from gateway.review.store import Decided, Item, ReviewStore
from gateway.settings import GatewaySettings

TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("gateway.review", "templates"), autoescape=True)
# No script, no frame, no external anything: the page is HTML, its inline style and forms to itself.
HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
           "frame-ancestors 'none'; base-uri 'none'", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}  # fmt: skip


class GatewayState(Protocol):
    """What the review page uses of the gateway's state (`gateway.app._State`)."""

    settings: GatewaySettings

    def run(self, call: Callable[..., Any], *args: Any) -> Awaitable[Any]: ...
    def limit(self, name: str) -> None: ...
    def body(self, request: Request) -> Awaitable[bytes]: ...


@dataclass
class ReviewMetrics:
    """Review throughput and the share of corrections: decisions by outcome (confirmed: every field as
    the model answered; corrected: at least one changed), and second decisions refused."""

    decisions: Counter
    conflicts: Counter

    @classmethod
    def build(cls, registry: CollectorRegistry, queue: str) -> ReviewMetrics:
        decisions = Counter(keys.REVIEW_DECISIONS, "Review decisions written, by outcome (confirmed, corrected)",
                            ["queue", "outcome"], registry=registry)  # fmt: skip
        conflicts = Counter(keys.REVIEW_CONFLICTS, "Review decisions refused: the item was decided before",
                            ["queue"], registry=registry)  # fmt: skip
        for outcome in ("confirmed", "corrected"):  # both series from the start: the share is never undefined
            decisions.labels(queue, outcome)
        conflicts.labels(queue)
        return cls(decisions, conflicts)


def html(template: str, status: int = 200, **values: Any) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(template).render(**values), status, headers=HEADERS)


def expected_of(item: Item, form: dict[str, list[str]]) -> dict[str, Any]:
    """The decision a form states for `item`: {field: label} or {field: [labels]}; ValueError naming
    what is wrong (a label that is not the field's, a single-label field without exactly one)."""
    expected: dict[str, Any] = {}
    for field in item.fields:
        chosen = form.get(f"field:{field.name}", [])
        unknown = [label for label in chosen if label not in field.probs]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a label of field {field.name!r}")
        if field.multi:
            expected[field.name] = sorted(set(chosen), key=list(field.probs).index)
        elif len(chosen) != 1:
            raise ValueError(f"choose exactly one label of field {field.name!r}")
        else:
            expected[field.name] = chosen[0]
    return expected


class ReviewPages:
    """The routes' handlers, on the gateway's state (see the module's docstring)."""

    def __init__(self, state: GatewayState, metrics: ReviewMetrics, client: Callable[[], Any]) -> None:
        """`client()`: a Redis client for the calling thread (the gateway's per-thread producer's)."""
        self.state, self.metrics, self.settings, self.client = state, metrics, state.settings, client

    @property
    def secret(self) -> bytes | None:
        secret = self.settings.gateway_review_secret
        return secret.get_secret_value().encode() if secret is not None else None

    def store(self) -> ReviewStore:
        """The review store on this thread's client: call it in a worker thread (`state.run`)."""
        s = self.settings
        return ReviewStore(self.client(), s.multi_tenant, s.result_expires_s, s.stream_maxlen,
                           s.gateway_review_deliver)  # fmt: skip

    def who(self, request: Request) -> tuple[str, str | None] | None:
        """(token name, session cookie or None for a Bearer header) of the caller, or None."""
        tokens = self.settings.gateway_tokens
        if request.headers.get("authorization"):
            name = caller(request.headers["authorization"], tokens)
            return (name, None) if name else None
        cookie = request.cookies.get(keys.REVIEW_COOKIE)
        name = session.holder(self.secret, cookie, tokens, time.time()) if self.secret else None
        return (name, cookie) if name else None

    async def form(self, request: Request) -> dict[str, list[str]]:
        return parse_qs((await self.state.body(request)).decode("utf-8", "replace"), keep_blank_values=True)

    def off(self) -> JSONResponse | None:
        if self.secret is None:
            return JSONResponse({"error": "review_off", "message": "the review page is off: set "
                                 "TICKETQ_GATEWAY_REVIEW_SECRET to open it"}, 404)  # fmt: skip
        return None

    async def page(self, request: Request) -> Response:
        if (closed := self.off()) is not None:
            return closed
        found = self.who(request)
        if found is None:
            return html("login.html")
        name, cookie = found
        self.state.limit(name)
        tenant = tenant_of(name)
        items = await self.state.run(self._pending, tenant)
        decided = request.query_params.get("decided")
        message = f"Saved your decision on ticket {decided}." if decided else None
        return html("items.html", items=items, tenant=tenant, who=name, message=message,
                    csrf=session.csrf_token(self.secret, cookie) if cookie else "")  # fmt: skip

    def _pending(self, tenant: str) -> list[Item]:
        return self.store().pending(tenant, self.settings.gateway_review_page_size)

    async def login(self, request: Request) -> Response:
        if (closed := self.off()) is not None:
            return closed
        self.state.limit(f"review-login:{request.client.host if request.client else '-'}")
        token = (await self.form(request)).get("token", [""])[0].strip()
        name = caller(f"Bearer {token}", self.settings.gateway_tokens) if token else None
        if name is None:
            return html("login.html", 401, message="Unknown token: use one of TICKETQ_GATEWAY_TOKENS.")
        ttl = self.settings.gateway_review_session_s
        value = session.issue(self.secret, name, self.settings.gateway_tokens[name], time.time(), ttl)
        response = RedirectResponse("/review", 303, headers=HEADERS)
        response.set_cookie(keys.REVIEW_COOKIE, value, max_age=ttl, path="/review", httponly=True, samesite="strict",
                            secure=not self.settings.gateway_review_insecure_cookie)  # fmt: skip
        return response

    async def logout(self, request: Request) -> Response:
        if (closed := self.off()) is not None:
            return closed
        found = self.who(request)
        cookie = found[1] if found is not None else None
        if cookie is not None and not session.csrf_ok(
            self.secret, cookie, (await self.form(request)).get("csrf", [None])[0]
        ):
            return html("message.html", 403, heading="Refused", message="The form is stale: reload the page.")
        response = RedirectResponse("/review", 303, headers=HEADERS)
        response.delete_cookie(keys.REVIEW_COOKIE, path="/review", httponly=True, samesite="strict")
        return response

    async def decide(self, request: Request, review_id: str) -> Response:
        if (closed := self.off()) is not None:
            return closed
        found = self.who(request)
        if found is None:
            return html("login.html", 401, message="Log in to decide review items.")
        name, cookie = found
        self.state.limit(name)
        form = await self.form(request)
        if cookie is not None and not session.csrf_ok(self.secret, cookie, form.get("csrf", [None])[0]):
            return html("message.html", 403, heading="Refused", message="The form is stale: reload the page.")
        item = await self.state.run(lambda: self.store().item(tenant_of(name), review_id))
        if item is None:
            return html("message.html", 404, heading="Not found", message=f"No review item {review_id} of "
                        f"{tenant_of(name)} (decided long ago and trimmed, or never one of yours).")  # fmt: skip
        try:
            expected = expected_of(item, form)
        except ValueError as exc:
            return html("message.html", 422, heading="Not saved", message=f"Not saved: {exc}.")
        decided = await self.state.run(lambda: self.store().decide(item, expected, name, time.time()))
        return self.answer(item, decided)

    def answer(self, item: Item, decided: Decided) -> Response:
        queue = self.settings.queue
        if decided.written:
            outcome = "corrected" if decided.record and decided.record["corrected"] else "confirmed"
            self.metrics.decisions.labels(queue, outcome).inc()
            return RedirectResponse(f"/review?decided={quote(item.id)}", 303, headers=HEADERS)
        self.metrics.conflicts.labels(queue).inc()
        first = decided.record
        message = (f"Ticket {item.id} was already decided by {first['reviewer']} at {first['decided_at']}; "
                   "your decision was not saved." if first else
                   f"Ticket {item.id} is no longer waiting for review; your decision was not saved.")  # fmt: skip
        return html("message.html", 409, heading="Already decided", message=message)


def install(app: FastAPI, state: GatewayState, registry: CollectorRegistry, client: Callable[[], Any]) -> None:
    """Add the review routes to the gateway's app (off, 404, without TICKETQ_GATEWAY_REVIEW_SECRET);
    its metrics go to `registry`, its Redis calls to `client()` (called in worker threads)."""
    pages = ReviewPages(state, ReviewMetrics.build(registry, state.settings.queue), client)
    app.get("/review", include_in_schema=False)(pages.page)
    app.post("/review/login", include_in_schema=False)(pages.login)
    app.post("/review/logout", include_in_schema=False)(pages.logout)
    app.post("/review/items/{review_id}", include_in_schema=False)(pages.decide)
