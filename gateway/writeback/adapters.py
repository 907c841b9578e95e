"""The helpdesks' REST APIs: the one request that writes a label to a ticket, and its auth.

- Zendesk: `PUT {url}/api/v2/tickets/{id}.json` with `{"ticket": {"additional_tags", "remove_tags",
  "group_id", "custom_fields": [{"id", "value"}]}}`; Basic auth `{email}/token:{api token}`. Tags are
  added and the other labels' tags removed (`additional_tags`/`remove_tags`), so the ticket's other
  tags stay and a changed answer replaces the old one's.
- Freshdesk: `PUT {url}/api/v2/tickets/{id}` with `{"tags", "group_id", "custom_fields": {name:
  value}}`; Basic auth `{api key}:X`. Freshdesk's update sets `tags` whole (it has no add/remove),
  so where a label maps tags the ticket is read first (`GET` the same URL) and `merge_tags` keeps
  its other tags.
- Intercom: `{url}/conversations/{id}`, the state wanted `{"tags": [names], "remove_tags": [the
  other labels' names], "team_assignee_id", "custom_attributes": {name: value}}`, written by the
  few requests that change what differs (gateway.writeback.intercom); Bearer auth with the access
  token, `Intercom-Version` and `Accept: application/json` headers.

Zendesk and Freshdesk answer `429` with `Retry-After` (seconds), Intercom with `X-RateLimit-Reset`
(the unix time its window resets), when the account's rate limit is reached.
The same label written twice is the same request: re-running a write leaves the same state.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from gateway.writeback.config import Target


@dataclass(frozen=True)
class Write:
    """One label written to one helpdesk ticket: the request, and the digest of the state it sets."""

    target: str
    ticket: str  # the helpdesk's own ticket id
    label: str
    method: str
    url: str
    payload: dict[str, Any]

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.url, self.payload], sort_keys=True).encode()).hexdigest()


def write_for(target: Target, ticket: str, label: str) -> Write | None:
    """The request that writes `label` to `ticket`, or None when the label has no entry in the config."""
    action = target.labels.get(label)
    if action is None:
        return None
    if target.kind == "intercom":
        url = f"{target.url}/conversations/{ticket}"
        return Write(target.name, ticket, label, "POST", url, _intercom(target, label))
    if target.kind == "zendesk":
        body: dict[str, Any] = {"additional_tags": list(action.tags), "remove_tags": list(target.other_tags(label))}
        if action.custom_fields:
            body["custom_fields"] = [{"id": _field_id(key), "value": value} for key, value in action.custom_fields]
        if action.group_id is not None:
            body["group_id"] = action.group_id
        return Write(target.name, ticket, label, "PUT", f"{target.url}/api/v2/tickets/{ticket}.json", {"ticket": body})
    body = {}
    if action.tags:
        body["tags"] = list(action.tags)
    if action.custom_fields:
        body["custom_fields"] = dict(action.custom_fields)
    if action.group_id is not None:
        body["group_id"] = action.group_id
    return Write(target.name, ticket, label, "PUT", f"{target.url}/api/v2/tickets/{ticket}", body)


def _intercom(target: Target, label: str) -> dict[str, Any]:
    """The state an Intercom conversation is brought to (gateway.writeback.intercom reads it)."""
    action = target.labels[label]
    wanted: dict[str, Any] = {"tags": list(action.tags), "remove_tags": list(target.other_tags(label))}
    if action.group_id is not None:
        wanted["team_assignee_id"] = str(action.group_id)
    if action.custom_fields:
        wanted["custom_attributes"] = dict(action.custom_fields)
    return wanted


def merge_tags(target: Target, current: list[str], wanted: list[str]) -> list[str]:
    """A ticket's tags with every label's tags replaced by `wanted` (its other tags kept), sorted."""
    ours = {tag for action in target.labels.values() for tag in action.tags}
    return sorted((set(current) - ours) | set(wanted))


def auth_header(target: Target, secret: str) -> str:
    """The Authorization header of `target`'s API with its secret (Zendesk's API token, Freshdesk's API key,
    Intercom's access token)."""
    if target.kind == "intercom":
        return f"Bearer {secret}"
    user = f"{target.email}/token:{secret}" if target.kind == "zendesk" else f"{secret}:X"
    return "Basic " + base64.b64encode(user.encode()).decode()


def headers_for(target: Target, secret: str) -> dict[str, str]:
    """Every request's headers: JSON, the auth, and Intercom's version header."""
    auth = auth_header(target, secret)
    headers = {"Content-Type": "application/json", "Accept": "application/json", "Authorization": auth}
    if target.kind == "intercom":
        headers["Intercom-Version"] = target.version
    return headers


def _field_id(key: str) -> int | str:
    """Zendesk's custom field ids are integers (a TOML key is a string)."""
    return int(key) if str(key).isdigit() else key
