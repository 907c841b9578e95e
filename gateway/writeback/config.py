"""The write-back config: which helpdesk account a result is written to, and what each label
becomes there (tags, a group, custom field values). A TOML file, TICKETQ_WRITEBACK_CONFIG:

    [targets.zendesk]                    # tickets that came in by the webhook source `zendesk`
    kind = "zendesk"                     # zendesk, freshdesk or intercom
    url = "https://acme.zendesk.com"     # intercom: https://api.intercom.io (or api.eu. / api.au.)
    email = "triage-bot@acme.example"    # zendesk only: the API token's agent
    field = "label"                      # optional: the answer's field to map (a schema's field name)

    [targets.zendesk.labels.billing]
    tags = ["billing"]                   # optional: tags the label adds (intercom: tag names)
    group_id = 360001                    # optional: the group the ticket goes to (intercom: the team assigned)
    custom_fields = { 360002 = "billing" }   # optional: field id (Freshdesk: name; Intercom: attribute) -> value

An intercom target also names `admin_id`, the admin its token acts as (Intercom requires one on
each tag and assignment), and may name `version`, the `Intercom-Version` header (INTERCOM_VERSION).

A target's name is the webhook source its tickets came in by (`gateway.webhooks`), or
`<source>@<tenant>` for a tenant's own (`zendesk@acme`, as in TICKETQ_GATEWAY_WEBHOOK_SECRETS); its
API secret is in TICKETQ_WRITEBACK_SECRETS (`zendesk=API_TOKEN`). A label without an entry is not
written back.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

KINDS = ("zendesk", "freshdesk", "intercom")
TARGET_KEYS = {"kind", "url", "email", "admin_id", "version", "field", "labels"}
INTERCOM_VERSION = "2.11"  # the Intercom-Version whose request shapes gateway.writeback.intercom sends
ACTION_KEYS = {"tags", "group_id", "custom_fields"}


@dataclass(frozen=True)
class Action:
    """What one label becomes on the helpdesk's ticket."""

    tags: tuple[str, ...] = ()
    group_id: int | None = None
    custom_fields: tuple[tuple[str, Any], ...] = ()  # (field id or name, value), in the file's order


@dataclass(frozen=True)
class Target:
    """One helpdesk account results are written to."""

    name: str
    kind: str
    url: str  # https://acme.zendesk.com, without a trailing slash
    labels: Mapping[str, Action]
    email: str | None = None  # zendesk: the API token's agent
    field: str = "label"
    admin_id: str | None = None  # intercom: the admin the token acts as
    version: str = INTERCOM_VERSION  # intercom: the Intercom-Version header

    def other_tags(self, label: str) -> tuple[str, ...]:
        """The tags of every other label, less this one's: removed when `label` is written (a new answer
        replaces the old one's tags)."""
        mine = set(self.labels[label].tags) if label in self.labels else set()
        others = {tag for name, action in self.labels.items() if name != label for tag in action.tags}
        return tuple(sorted(others - mine))


def load_targets(path: str | Path) -> dict[str, Target]:
    """Every target of a config file, or `ValueError` naming the file, the target and what is wrong."""
    data = tomllib.loads(Path(path).read_text())
    targets = {}
    for name, entry in data.get("targets", {}).items():
        try:
            targets[name] = _target(name, entry)
        except ValueError as exc:
            raise ValueError(f"{path}: write-back target {name!r}: {exc}") from None
    if not targets:
        raise ValueError(f"{path}: no [targets.<name>] table")
    return targets


def _target(name: str, entry: Mapping[str, Any]) -> Target:
    unknown = sorted(set(entry) - TARGET_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; a target has {', '.join(sorted(TARGET_KEYS))}")
    kind, url = entry.get("kind"), entry.get("url")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(url, str) or not url.startswith(("https://", "http://")):
        raise ValueError(f"url must be the helpdesk's https:// address, got {url!r}")
    if kind == "zendesk" and not entry.get("email"):
        raise ValueError("a zendesk target needs `email`, the API token's agent (auth is email/token:TOKEN)")
    admin = entry.get("admin_id")
    if kind == "intercom" and (isinstance(admin, bool) or not isinstance(admin, str | int) or not str(admin).strip()):
        raise ValueError("an intercom target needs `admin_id`, the admin its access token acts as")
    labels = {label: _action(label, action) for label, action in entry.get("labels", {}).items()}
    return Target(name, kind, url.rstrip("/"), labels, entry.get("email"), entry.get("field", "label"),
                  str(admin) if admin is not None else None, str(entry.get("version", INTERCOM_VERSION)))  # fmt: skip


def _action(label: str, entry: Mapping[str, Any]) -> Action:
    unknown = sorted(set(entry) - ACTION_KEYS)
    if unknown:
        raise ValueError(f"label {label!r}: unknown key(s) {', '.join(unknown)}; use {', '.join(sorted(ACTION_KEYS))}")
    tags, group = entry.get("tags", []), entry.get("group_id")
    if not isinstance(tags, list) or not all(isinstance(tag, str) and tag.strip() for tag in tags):
        raise ValueError(f"label {label!r}: tags must be a list of strings")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise ValueError(f"label {label!r}: group_id must be an integer")
    fields = entry.get("custom_fields", {})
    if not isinstance(fields, Mapping):
        raise ValueError(f"label {label!r}: custom_fields must be a table (field -> value)")
    if not (tags or group is not None or fields):
        raise ValueError(f"label {label!r} writes nothing: give tags, group_id or custom_fields")
    return Action(tuple(tags), group, tuple(fields.items()))
