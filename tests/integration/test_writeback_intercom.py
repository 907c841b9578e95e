"""The write-back to Intercom (gateway.writeback.intercom) against a local fake of its REST API
(tests/support/helpdesks.py `FakeIntercom`: Bearer token, Intercom-Version, the real paths and
body shapes, `429` with `X-RateLimit-Reset`), never the real service: first the requests of one
write, a repeat and a changed answer; then end to end from a signed Intercom webhook through a
real gateway and null-classifier worker to `ticketq-writeback`, through a rate-limited phase."""

from __future__ import annotations

import hmac
import json
from pathlib import Path

import httpx
import pytest
from gateways import running_gateway
from helpdesks import FakeIntercom
from test_helpdesks import LABELS, SECRETS, WEBHOOK_ENV, writing_back
from workers import null_classifier_service, wait_for

from gateway.writeback import intercom
from gateway.writeback.adapters import headers_for, write_for
from gateway.writeback.config import Target, load_targets

pytestmark = pytest.mark.integration

TOKEN = "IC-ACCESS-TOKEN"
ADMIN, TEAMS = "991267618", {label: str(5017690 + n) for n, label in enumerate(LABELS)}


def config(path: Path, url: str) -> Path:
    """An intercom target: each label a tag, a team and the attribute `ai_category`."""
    labels = "".join(f'[targets.intercom.labels.{label}]\ntags = ["ai-{label}"]\ngroup_id = {TEAMS[label]}\n'
                     f'custom_fields = {{ ai_category = "{label}" }}\n\n' for label in LABELS)  # fmt: skip
    path.write_text(f'[targets.intercom]\nkind = "intercom"\nurl = "{url}"\nadmin_id = "{ADMIN}"\n\n{labels}')
    return path


def requester(http: httpx.Client, target: Target, token: str) -> intercom.Request:
    """The write's requests as the consumer sends them (its headers), without its retries."""

    def request(method: str, url: str, body: dict | None) -> httpx.Response | str:
        answered = http.request(method, url, headers=headers_for(target, token),
                                content=None if body is None else json.dumps(body).encode())  # fmt: skip
        return answered if answered.is_success else f"{method} {url} answered {answered.status_code}"

    return request


def test_one_write_changes_what_differs_and_a_repeat_sends_only_its_read(tmp_path):
    """billing on a fresh conversation: its tag found by name, attached, the team assigned, the
    attribute set (the customer's own tag kept); the same again: one GET; technical after it: the
    billing tag detached, technical's attached, the team changed."""
    with FakeIntercom(TOKEN, [215], {ADMIN}, set(TEAMS.values())) as fake, httpx.Client(timeout=10) as http:
        target = load_targets(config(tmp_path / "writeback.toml", fake.url))["intercom"]
        tag_ids: dict[str, str] = {}

        def run(label: str) -> list[str]:
            before = len(fake.requests)
            write = write_for(target, "215", label)
            assert intercom.write(requester(http, target, TOKEN), target, write.url, write.payload, tag_ids) == ""
            return [path for _, path, _ in fake.requests[before:]]

        assert run("billing") == ["/conversations/215", "/tags", "/conversations/215/tags",
                                  "/conversations/215/parts", "/conversations/215"]  # fmt: skip
        conversation = fake.conversations["215"]
        assert set(conversation.tags.values()) == {"vip", "ai-billing"}
        assert (conversation.team_assignee_id, conversation.custom_attributes) == (TEAMS["billing"],
                                                                                  {"ai_category": "billing"})
        assert run("billing") == ["/conversations/215"]  # the state is there: nothing sent
        billing_tag = tag_ids["ai-billing"]
        assert run("technical")[:4] == ["/conversations/215", "/tags", "/conversations/215/tags",
                                        f"/conversations/215/tags/{billing_tag}"]  # fmt: skip
        assert set(conversation.tags.values()) == {"vip", "ai-technical"}
        assert conversation.team_assignee_id == TEAMS["technical"] and conversation.assignments == 2
        assert set(fake.statuses()) == {200}
        write = write_for(target, "215", "billing")
        refused = intercom.write(requester(http, target, "guess"), target, write.url, write.payload, {})
        assert refused == f"GET {fake.url}/conversations/215 answered 401"  # the token is checked


def test_intercom_write_back_end_to_end_through_its_rate_limit(tmp_path):
    """A signed Intercom webhook → gateway → a null-classifier worker → ticketq-writeback → the fake's
    conversation carries the label's tag, team and attribute. The fake answered 429 with
    X-RateLimit-Reset (and no Retry-After) to the first two requests: each next request came after
    the reset time it named; nothing was dead-lettered."""
    with null_classifier_service(tmp_path, "wbic") as (url, queue), \
            FakeIntercom(TOKEN, [215], {ADMIN}, set(TEAMS.values()), throttled=2) as fake, \
            running_gateway(tmp_path, url, queue, **WEBHOOK_ENV) as gateway:  # fmt: skip
        body = json.dumps({"type": "notification_event", "topic": "conversation.user.created", "id": "notif_1",
                           "app_id": "abc", "data": {"type": "notification_event_data", "item": {
                               "type": "conversation", "id": "215", "source": {"subject": "Refund",
                                                                              "body": "<p>I was charged twice</p>"}}}}
                          ).encode()  # fmt: skip
        signature = "sha1=" + hmac.new(SECRETS["intercom"].encode(), body, "sha1").hexdigest()
        answer = httpx.post(gateway.url + "/v1/webhooks/intercom", content=body, headers={"X-Hub-Signature": signature})
        assert answer.status_code == 202, answer.text
        toml = config(tmp_path / "writeback.toml", fake.url)
        with writing_back(tmp_path, url, queue, toml, f"intercom={TOKEN}") as writeback:
            wait_for(lambda: writeback.metric("ticketq_writeback_writes_total") == 1, 60, "the label written back")
            assert writeback.metric('ticketq_writeback_requests_total{outcome="http_429"}') == 2
            assert writeback.metric("ticketq_writeback_dead_letters_total") == 0
        conversation = fake.conversations["215"]
        label = conversation.custom_attributes["ai_category"]
        assert set(conversation.tags.values()) == {"vip", f"ai-{label}"}
        assert conversation.team_assignee_id == TEAMS[label]
        assert fake.statuses()[:2] == [429, 429] and set(fake.statuses()[2:]) == {200}
        for n, reset in enumerate(fake.resets):  # a correctness bound: X-RateLimit-Reset honoured
            assert fake.arrivals[n + 1] >= reset, (fake.arrivals, fake.resets)
