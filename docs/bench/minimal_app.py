"""The speed baseline of docs/bench/gateway_load.py: the least a FastAPI + uvicorn front door can do,
one Redis LPUSH of the body per POST (no auth, no checks, no idempotency, no Celery message).

    TICKETQ_BENCH_REDIS=redis://127.0.0.1:6379/0 uvicorn --app-dir docs/bench minimal_app:app --http h11
"""

from __future__ import annotations

import os

import redis.asyncio as aioredis
from fastapi import FastAPI, Request, Response

app = FastAPI()
client = aioredis.Redis.from_url(os.environ.get("TICKETQ_BENCH_REDIS", "redis://127.0.0.1:6379/0"))
QUEUE = os.environ.get("TICKETQ_BENCH_LIST", "minimal-app")


@app.post("/v1/tickets", status_code=202)
async def post_tickets(request: Request) -> Response:
    await client.lpush(QUEUE, await request.body())
    return Response(b'{"status":"accepted"}', 202, media_type="application/json")


@app.get("/readyz")
async def readyz() -> dict:
    return {"status": "ready"}
