"""Intercom's REST API as the write-back uses it: one label written to one conversation by the few
requests that change what differs (Intercom has no single update for tags, assignment and
attributes). The state wanted is `adapters.write_for`'s payload.

- `GET {url}/conversations/{id}`: its tags (`tags.tags[].{id, name}`), `team_assignee_id` and
  `custom_attributes`.
- A label's tag it lacks: the tag's id by name, `POST {url}/tags {"name"}` (Intercom's
  create-or-find: one tag per name, names case-insensitive; remembered per process), then
  `POST {url}/conversations/{id}/tags {"id", "admin_id"}`.
- Another label's tag it has: `DELETE {url}/conversations/{id}/tags/{tag id} {"admin_id"}`.
- Another team: `POST {url}/conversations/{id}/parts {"message_type": "assignment", "type": "team",
  "admin_id", "assignee_id"}`.
- Other attribute values: `PUT {url}/conversations/{id} {"custom_attributes": {...}}`.

Idempotent: the state is read first, so re-running a write that was done sends its GET alone, and
one cut short (a `429`, a failure) is re-run whole by the dispatcher's schedule, doing what is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from gateway.writeback.config import Target

# (method, URL, JSON body or None) -> the 2xx response, or what went wrong (the consumer's `_request`)
Request = Callable[[str, str, "dict[str, Any] | None"], "httpx.Response | str"]


class Failed(Exception):
    """A request of the write was not answered 2xx: the message says which and how."""


def write(request: Request, target: Target, url: str, wanted: dict[str, Any], tag_ids: dict[str, str]) -> str:
    """Bring the conversation at `url` to `wanted`: "" when it is, else what failed. `tag_ids` (lower-case
    name -> id) is the target's, kept across writes."""
    def send(method: str, where: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        answered = request(method, where, body)
        if isinstance(answered, str):
            raise Failed(answered)
        return answered.json() if answered.content else {}

    try:
        conversation = send("GET", url)
        _tags(send, target, url, conversation, wanted, tag_ids)
        team = wanted.get("team_assignee_id")
        if team is not None and str(conversation.get("team_assignee_id")) != team:
            send("POST", f"{url}/parts", {"message_type": "assignment", "type": "team", "admin_id": target.admin_id,
                                          "assignee_id": team})  # fmt: skip
        attributes, current = wanted.get("custom_attributes") or {}, conversation.get("custom_attributes") or {}
        if any(current.get(name) != value for name, value in attributes.items()):
            send("PUT", url, {"custom_attributes": attributes})
    except Failed as exc:
        return str(exc)
    return ""


def _tags(send: Callable[..., dict[str, Any]], target: Target, url: str, conversation: dict[str, Any],
          wanted: dict[str, Any], tag_ids: dict[str, str]) -> None:  # fmt: skip
    """Attach the label's tags the conversation lacks; detach the other labels' it has."""
    have = {str(tag["name"]).lower(): str(tag["id"]) for tag in (conversation.get("tags") or {}).get("tags", [])}
    for name in wanted.get("tags", []):
        if name.lower() in have:
            continue
        if name.lower() not in tag_ids:
            tag_ids[name.lower()] = str(send("POST", f"{target.url}/tags", {"name": name})["id"])
        try:
            send("POST", f"{url}/tags", {"id": tag_ids[name.lower()], "admin_id": target.admin_id})
        except Failed:
            tag_ids.pop(name.lower(), None)  # a tag deleted since it was found: found again on the retry
            raise
    for name in wanted.get("remove_tags", []):
        if name.lower() in have:
            send("DELETE", f"{url}/tags/{have[name.lower()]}", {"admin_id": target.admin_id})
