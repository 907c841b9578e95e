"""The gateway's OpenAPI document, as the routes really answer (each status with its body schema:
refusals with `Error`, a replayed Idempotency-Key with the 202 it gets), a bearer security scheme,
and /docs as a page rendered here from that document: no script or stylesheet from a CDN.

The routes read their bodies raw (the contract's rule checks tickets, not a pydantic model), so
FastAPI cannot infer these answers; `ANSWERS` lists them, and tests/integration/test_gateway_errors.py
compares each with a real response.
"""

from __future__ import annotations

import html
import json
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

ERROR = {"type": "object", "required": ["error", "message"], "properties": {
    "error": {"type": "string", "description": "the reason, one word (docs/gateway.md, Statuses)"},
    "message": {"type": "string", "description": "what was wrong, one line"},
    "errors": {"type": "array", "description": "422: one entry per bad ticket", "items": {"type": "object",
               "required": ["index", "reason", "message"], "properties": {
                   "index": {"type": "integer"}, "field": {"type": ["string", "null"]},
                   "reason": {"type": "string"}, "message": {"type": "string"}}}}}}  # fmt: skip
ACCEPTED = {"type": "object", "required": ["tickets"], "properties": {"tickets": {"type": "array", "items": {
    "type": "object", "required": ["id", "task_id", "status"], "properties": {
        "id": {"type": "string"}, "task_id": {"type": "string"},
        "status": {"type": "string", "enum": ["accepted", "duplicate"]}}}}}}  # fmt: skip
PENDING = {"type": "object", "required": ["id", "task_id", "status"], "properties": {
    "id": {"type": "string"}, "task_id": {"type": "string"},
    "status": {"type": "string", "enum": ["pending"]}}}  # fmt: skip
RESULT = {"type": "object", "required": ["id", "status"], "description": "the ticket's result (docs/usage.md, Results)",
          "properties": {"id": {"type": "string"}, "status": {"type": "string"}}}  # fmt: skip
READY = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"},
                                                                  "reason": {"type": "string"}}}  # fmt: skip
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before sending again", "schema": {"type": "integer"}}}
REPLAYED = {"Idempotent-Replayed": {"description": "`true` on a retry under an answered Idempotency-Key: the "
                                    "first POST's answer", "schema": {"type": "string"}}}  # fmt: skip
WHY = {
    400: "not JSON, nested too deep, a non-finite number, not a ticket or a list, or a bad query parameter",
    401: "no or wrong token (`WWW-Authenticate: Bearer`), or a bad webhook signature",
    404: "no such ticket in the caller's tenant, source or route; admin endpoints off",
    405: "the route does not take this method (`Allow` lists those it does)",
    408: "the body was not received within TICKETQ_GATEWAY_BODY_TIMEOUT_S",
    409: "an Idempotency-Key whose first POST is still being answered",
    413: "the body or the number of tickets is above its limit",
    422: "a ticket breaks the contract (`errors` names each), or an Idempotency-Key reused with another body",
    429: "the token's rate, or the queue-depth bound (counting this request's tickets)",
    503: "Redis unreachable or refusing writes, or more than TICKETQ_GATEWAY_MAX_CONNECTIONS connections at once",
}
TICKETS = ["400", "401", "405", "408", "409", "413", "422", "429", "503"]
# (path, method) -> {status: (description, schema name or None, headers)}; statuses in TICKETS-like
# lists are refusals in the Error shape.
ANSWERS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/tickets", "post"): {"202": ("every ticket is in Redis; also the answer to a retry under an answered "
                                      "Idempotency-Key (with Idempotent-Replayed: true)", "Accepted", REPLAYED),
                              "errors": TICKETS},
    ("/v1/tickets/{ticket_id}", "get"): {"200": ("the result", "Result", {}),
                                         "202": ("accepted, not classified yet", "Pending", {}),
                                         "errors": ["400", "401", "404", "405", "429", "503"]},
    ("/v1/webhooks/{source}", "post"): {"202": ("the webhook's ticket is in Redis", "Accepted", {}),
                                        "errors": ["400", "401", "404", "405", "408", "413", "422", "429", "503"]},
    ("/healthz", "get"): {"200": ("the process answers", "Ready", {}), "errors": ["405"]},
    ("/readyz", "get"): {"200": ("Redis answers and takes writes", "Ready", {}),
                         "503": ("Redis unreachable or refusing writes", "Ready", RETRY_AFTER), "errors": ["405"]},
    ("/metrics", "get"): {"200": ("Prometheus text format", None, {}), "errors": ["401", "404", "405"]},
}  # fmt: skip
SCHEMAS = {"Error": ERROR, "Accepted": ACCEPTED, "Pending": PENDING, "Result": RESULT, "Ready": READY}
BEARER = {"type": "http", "scheme": "bearer",
          "description": "a token of TICKETQ_GATEWAY_TOKENS (/metrics: TICKETQ_GATEWAY_ADMIN_TOKENS)"}
SECURED = {("/v1/tickets", "post"), ("/v1/tickets/{ticket_id}", "get"), ("/metrics", "get")}


def document(app: FastAPI, models: tuple[type[BaseModel], ...]) -> None:
    """Make `app.openapi()` the document described above, with `models` (read raw by the routes) in its components."""
    original = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = original()
            components = schema.setdefault("components", {})
            found = components.setdefault("schemas", {})
            found.pop("HTTPValidationError", None), found.pop("ValidationError", None)
            for model in models:
                found[model.__name__] = json.loads(json.dumps(model.model_json_schema(
                    by_alias=True, ref_template="#/components/schemas/{model}")))  # fmt: skip
            found.update(SCHEMAS)
            components["securitySchemes"] = {"bearer": BEARER}
            for (path, method), answers in ANSWERS.items():
                operation = schema["paths"][path][method]
                operation["responses"] = _responses(answers)
                if (path, method) in SECURED:
                    operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _responses(answers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status, answer in answers.items():
        if status == "errors":
            continue
        description, name, headers = answer
        content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}} if name else {
            "text/plain": {"schema": {"type": "string"}}}  # fmt: skip
        out[status] = {"description": description, "content": content, **({"headers": headers} if headers else {})}
    for status in answers["errors"]:
        headers = RETRY_AFTER if status in ("409", "429", "503") else {}
        out.setdefault(status, {"description": WHY[int(status)], **({"headers": headers} if headers else {}),
                                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
    return out


def docs_page(schema: dict) -> str:
    """/docs: every route, its statuses and their schemas, as one HTML page with no outside assets."""
    rows = []
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            answers = "".join(f"<li><b>{status}</b> {html.escape(answer.get('description', ''))}</li>"
                              for status, answer in operation.get("responses", {}).items())  # fmt: skip
            lock = " (bearer token)" if operation.get("security") else ""
            rows.append(f"<h2><code>{method.upper()} {html.escape(path)}</code>{lock}</h2>"
                        f"<p>{html.escape(operation.get('summary', ''))}</p><ul>{answers}</ul>")  # fmt: skip
    schemas = html.escape(json.dumps(schema.get("components", {}).get("schemas", {}), indent=2))
    title = html.escape(schema["info"]["title"])
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
            f"<h1>{title}</h1><p>The full document: <a href='/openapi.json'>/openapi.json</a> (the same admin "
            f"token).</p>{''.join(rows)}<h2>Schemas</h2><pre>{schemas}</pre></body></html>")  # fmt: skip
