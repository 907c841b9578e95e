"""Local fakes of the helpdesks' REST APIs, for the write-back tests: a real HTTP server (a thread of
the test process) that checks each request as the real API would (method, path, Basic auth, JSON
shape, keys it knows), applies it to its own tickets, and can answer `429` + `Retry-After` to the
first N requests. Never the real service.

- Zendesk: `PUT /api/v2/tickets/{id}.json`, auth `email/token:TOKEN`, body `{"ticket": {...}}` with
  `additional_tags`, `remove_tags`, `tags`, `group_id`, `custom_fields: [{"id": int, "value"}]`.
- Freshdesk: `GET` and `PUT /api/v2/tickets/{id}`, auth `API_KEY:X`, body with `tags` (set whole),
  `group_id`, `custom_fields: {name: value}`.
"""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ZENDESK_PATH = re.compile(r"/api/v2/tickets/(\d+)\.json")
FRESHDESK_PATH = re.compile(r"/api/v2/tickets/(\d+)")
ZENDESK_KEYS = {"additional_tags", "remove_tags", "tags", "group_id", "custom_fields", "status", "comment"}
FRESHDESK_KEYS = {"tags", "group_id", "custom_fields", "status", "priority", "type"}


@dataclass
class FakeTicket:
    tags: set[str] = field(default_factory=set)
    group_id: int | None = None
    custom_fields: dict[Any, Any] = field(default_factory=dict)


class FakeHelpdesk:
    """`kind` (zendesk or freshdesk) at `url`, accepting `user:password` as Basic auth; tickets `ids`."""

    def __init__(self, kind: str, user: str, ids: list[int], throttled: int = 0, retry_after: str = "1") -> None:
        self.kind, self.user = kind, user
        self.tickets = {str(ticket_id): FakeTicket(tags={"vip"}) for ticket_id in ids}
        self.throttled = throttled  # the first this many requests are answered 429
        self.retry_after = retry_after
        self.requests: list[tuple[int, str, bytes]] = []  # (status answered, path, raw body)
        self.times: list[float] = []  # time.monotonic() of each request
        self.changed = threading.Condition()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHelpdesk:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def statuses(self) -> list[int]:
        with self.changed:
            return [status for status, _, _ in self.requests]

    def answer(self, method: str, path: str, headers: Any, raw: bytes) -> tuple[int, dict[str, str], Any]:
        """(status, headers, JSON body) of one request, as the real API would answer it."""
        expected = "Basic " + base64.b64encode(self.user.encode()).decode()
        if headers.get("Authorization") != expected:
            return 401, {}, {"error": "Couldn't authenticate you"}
        if self.throttled > 0:
            self.throttled -= 1
            return 429, {"Retry-After": self.retry_after}, {"error": "APIRateLimitExceeded"}
        match = (ZENDESK_PATH if self.kind == "zendesk" else FRESHDESK_PATH).fullmatch(path)
        if method not in ("GET", "PUT") or match is None:
            return 404, {}, {"error": "InvalidEndpoint"}
        if method == "GET":
            found = self.tickets.get(match.group(1))
            if found is None:
                return 404, {}, {"error": "RecordNotFound"}
            return 200, {}, {"id": int(match.group(1)), "tags": sorted(found.tags), "group_id": found.group_id}
        if not headers.get("Content-Type", "").startswith("application/json"):
            return 415, {}, {"error": "Content-Type must be application/json"}
        ticket = self.tickets.get(match.group(1))
        if ticket is None:
            return 404, {}, {"error": "RecordNotFound"}
        try:
            body = json.loads(raw)
            self._apply(ticket, body)
        except (ValueError, KeyError, TypeError) as exc:
            return 400, {}, {"error": "RecordInvalid", "description": str(exc)}
        return 200, {}, {"ticket": {"id": int(match.group(1)), "tags": sorted(ticket.tags),
                                    "group_id": ticket.group_id}}  # fmt: skip

    def _apply(self, ticket: FakeTicket, body: dict) -> None:
        if self.kind == "zendesk":
            fields = body["ticket"]
            if set(fields) - ZENDESK_KEYS:
                raise ValueError(f"unknown ticket keys {sorted(set(fields) - ZENDESK_KEYS)}")
            for item in fields.get("custom_fields", []):
                if not isinstance(item["id"], int):
                    raise TypeError("custom field ids are integers")
                ticket.custom_fields[item["id"]] = item["value"]
            if "tags" in fields:
                ticket.tags = set(fields["tags"])
            ticket.tags = (ticket.tags | set(fields.get("additional_tags", []))) - set(fields.get("remove_tags", []))
        else:
            if set(body) - FRESHDESK_KEYS:
                raise ValueError(f"unknown ticket keys {sorted(set(body) - FRESHDESK_KEYS)}")
            if not isinstance(body.get("custom_fields", {}), dict):
                raise TypeError("custom_fields is an object")
            ticket.custom_fields.update(body.get("custom_fields", {}))
            if "tags" in body:
                ticket.tags = set(body["tags"])
        if "group_id" in (body["ticket"] if self.kind == "zendesk" else body):
            ticket.group_id = (body["ticket"] if self.kind == "zendesk" else body)["group_id"]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with fake.changed:
                    status, headers, body = fake.answer(method, self.path, self.headers, raw)
                    fake.requests.append((status, self.path, raw))
                    fake.times.append(time.monotonic())
                    fake.changed.notify_all()
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in {**headers, "Content-Type": "application/json"}.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                self._serve("PUT")

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, *args: object) -> None:
                pass

        return Handler
