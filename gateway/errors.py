"""One error shape for every refusal the gateway answers: `{"error": reason, "message": one line}`.

`gateway.intake.Refused` carries the gateway's own refusals; this module gives the same shape to
what the framework answers by itself (an unknown route 404, a wrong method 405 with `Allow`, a bad
query parameter 400), to an unexpected failure (500, logged by uvicorn with its traceback) and, in
`gateway.server`, to the 400 that uvicorn's h11 protocol answers for a request it cannot parse (a
head above TICKETQ_GATEWAY_MAX_HEADER_BYTES, a malformed request line).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

HTTP_REASONS = {404: "not_found", 405: "method_not_allowed"}


def body(reason: str, message: str) -> bytes:
    """The error shape, serialised (for answers written below the ASGI app)."""
    return json.dumps({"error": reason, "message": message}).encode()


def install(app: FastAPI) -> None:
    """Answer the framework's own errors and unexpected failures in the error shape."""
    app.exception_handler(HTTPException)(_http_error)
    app.exception_handler(RequestValidationError)(_invalid_request)
    app.exception_handler(Exception)(_internal_error)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"no such route: {where}"
    elif exc.status_code == 405:
        message = f"{where} is not allowed; allowed: {(exc.headers or {}).get('Allow', 'none')}"
    else:
        message = str(exc.detail)
    reason = HTTP_REASONS.get(exc.status_code, "http_error")
    return JSONResponse({"error": reason, "message": message}, exc.status_code, headers=exc.headers)


async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in exc.errors())
    return JSONResponse({"error": "invalid_request", "message": problems or "invalid request"}, 400)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"error": "internal_error", "message": f"the gateway failed on this request "
                         f"({type(exc).__name__}); it is logged, and nothing may have been queued"}, 500)  # fmt: skip
