"""Local fakes of the helpdesks' REST APIs, for the write-back tests: a real HTTP server (a thread of
the test process) that checks each request as the real API would (method, path, Basic auth, JSON
shape, keys it knows), applies it to its own tickets, and can answer `429` + `Retry-After` to the
first N requests. Never the real service.

- Zendesk: `PUT /api/v2/tickets/{id}.json`, auth `email/token:TOKEN`, body `{"ticket": {...}}` with
  `additional_tags`, `remove_tags`, `tags`, `group_id`, `custom_fields: [{"id": int, "value"}]`.
- Freshdesk: `GET` and `PUT /api/v2/tickets/{id}`, auth `API_KEY:X`, body with `tags` (set whole),
  `group_id`, `custom_fields: {name: value}`.
- Intercom (`FakeIntercom`): `GET`/`PUT /conversations/{id}`, `POST /conversations/{id}/tags`,
  `DELETE /conversations/{id}/tags/{tag id}`, `POST /conversations/{id}/parts` (assignment),
  `POST /tags` (create or find by name); `Authorization: Bearer TOKEN`, `Intercom-Version` and
  `Accept: application/json` required; ids are strings, `admin_id` a known admin; a throttled
  request is answered `429` with `X-RateLimit-Reset` (unix seconds) and no Retry-After.
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

            def do_DELETE(self) -> None:
                self._serve("DELETE")

            def log_message(self, *args: object) -> None:
                pass

        return Handler


INTERCOM_VERSIONS = {"2.9", "2.10", "2.11", "2.12", "2.13", "2.14"}
CONVERSATION_PATH = re.compile(r"/conversations/(\d+)(/tags|/tags/(\d+)|/parts)?")


@dataclass
class FakeConversation:
    tags: dict[str, str] = field(default_factory=dict)  # tag id -> name
    team_assignee_id: str | None = None
    custom_attributes: dict[str, Any] = field(default_factory=dict)
    assignments: int = 0  # conversation parts of type assignment added


def _error(code: str, message: str) -> dict:
    return {"type": "error.list", "request_id": "fake", "errors": [{"code": code, "message": message}]}


class FakeIntercom(FakeHelpdesk):
    """Intercom's REST API (module docstring) for access token `token`: conversations `ids` (each with
    the customer's tag `vip`), admins `admins`, teams `teams`; the first `throttled` requests 429."""

    def __init__(self, token: str, ids: list[int], admins: set[str], teams: set[str], throttled: int = 0) -> None:
        super().__init__("intercom", token, [], throttled)
        self.tag_names = {"900": "vip"}  # the workspace's tags: id -> name
        self.conversations = {str(i): FakeConversation(tags={"900": "vip"}) for i in ids}
        self.admins, self.teams = admins, teams
        self.resets: list[int] = []  # X-RateLimit-Reset of each 429
        self.arrivals: list[float] = []  # time.time() of each request

    def answer(self, method: str, path: str, headers: Any, raw: bytes) -> tuple[int, dict[str, str], Any]:
        self.arrivals.append(time.time())
        if headers.get("Authorization") != f"Bearer {self.user}":
            return 401, {}, _error("unauthorized", "Access Token Invalid")
        if headers.get("Intercom-Version") not in INTERCOM_VERSIONS:
            return 400, {}, _error("intercom_version_invalid", "Requested Intercom Version is invalid")
        if "application/json" not in headers.get("Accept", ""):
            return 406, {}, _error("media_type_not_acceptable", "The Accept header should send application/json")
        if self.throttled > 0:
            self.throttled -= 1
            self.resets.append(int(time.time()) + 2)
            reset = str(self.resets[-1])
            limits = {"X-RateLimit-Limit": "167", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": reset}
            return 429, limits, _error("rate_limit_exceeded", "Exceeded rate limit of 167 in 10_seconds")
        if raw and not headers.get("Content-Type", "").startswith("application/json"):
            return 415, {}, _error("unsupported_media_type", "Content-Type must be application/json")
        try:
            body = json.loads(raw) if raw else {}
            return self._route(method, path, body)
        except (ValueError, KeyError, TypeError) as exc:
            return 400, {}, _error("parameter_invalid", str(exc))

    def _route(self, method: str, path: str, body: dict) -> tuple[int, dict[str, str], Any]:
        if path == "/tags" and method == "POST":
            return 200, {}, self._tag_named(body)
        match = CONVERSATION_PATH.fullmatch(path)
        conversation = self.conversations.get(match.group(1)) if match else None
        if conversation is None:
            return 404, {}, _error("not_found", "Resource Not Found" if match is None else "Conversation Not Found")
        where = (method, match.group(2) and match.group(2).split("/")[1])
        if where == ("GET", None):
            return 200, {}, self._conversation(match.group(1))
        if where == ("PUT", None):
            if set(body) - {"read", "title", "custom_attributes"} or not isinstance(body.get("custom_attributes", {}),
                                                                                    dict):  # fmt: skip
                raise ValueError(f"unknown or malformed keys {sorted(body)}")
            conversation.custom_attributes.update(body.get("custom_attributes", {}))
            return 200, {}, self._conversation(match.group(1))
        if where == ("POST", "tags"):
            self._check(body, {"id", "admin_id"})
            if body["id"] not in self.tag_names:
                return 404, {}, _error("tag_not_found", "Tag not found")
            conversation.tags[body["id"]] = self.tag_names[body["id"]]
            return 200, {}, {"type": "tag", "id": body["id"], "name": self.tag_names[body["id"]]}
        if where == ("DELETE", "tags"):
            self._check(body, {"admin_id"})
            if conversation.tags.pop(match.group(3), None) is None:
                return 404, {}, _error("not_found", "Tag not found on the conversation")
            return 200, {}, {"type": "tag", "id": match.group(3), "name": self.tag_names[match.group(3)]}
        if where == ("POST", "parts"):
            return self._assign(conversation, match.group(1), body)
        return 404, {}, _error("not_found", "Resource Not Found")

    def _check(self, body: dict, keys: set[str]) -> None:
        if set(body) != keys or not all(isinstance(body[key], str) for key in keys):
            raise TypeError(f"the body must be {sorted(keys)}, strings: got {body}")
        if body["admin_id"] not in self.admins:
            raise ValueError(f"admin_id {body['admin_id']!r} is not an admin of this workspace")

    def _tag_named(self, body: dict) -> dict:
        if set(body) != {"name"} or not isinstance(body["name"], str):
            raise TypeError(f"create a tag with its name alone: got {body}")
        found = next((i for i, name in self.tag_names.items() if name.lower() == body["name"].lower()), None)
        if found is None:
            found = str(1000 + len(self.tag_names))
            self.tag_names[found] = body["name"]
        return {"type": "tag", "id": found, "name": self.tag_names[found]}

    def _assign(self, conversation: FakeConversation, conversation_id: str, body: dict) -> tuple[int, dict, Any]:
        self._check({k: body.get(k) for k in ("admin_id", "assignee_id")}, {"admin_id", "assignee_id"})
        if set(body) - {"message_type", "type", "admin_id", "assignee_id", "body"} or body.get("message_type") != \
                "assignment" or body.get("type") not in ("admin", "team"):  # fmt: skip
            raise ValueError(f"not an assignment: {body}")
        if body["type"] == "team" and body["assignee_id"] not in self.teams:
            return 404, {}, _error("team_not_found", "Team Not Found")
        if body["type"] == "team":
            conversation.team_assignee_id = body["assignee_id"]
        conversation.assignments += 1
        return 200, {}, self._conversation(conversation_id)

    def _conversation(self, conversation_id: str) -> dict:
        found = self.conversations[conversation_id]
        tags = [{"type": "tag", "id": i, "name": name} for i, name in sorted(found.tags.items())]
        team = int(found.team_assignee_id) if found.team_assignee_id else None  # a number, as Intercom answers it
        return {"type": "conversation", "id": conversation_id, "state": "open", "admin_assignee_id": None,
                "team_assignee_id": team, "tags": {"type": "tag.list", "tags": tags},
                "custom_attributes": dict(found.custom_attributes)}  # fmt: skip
