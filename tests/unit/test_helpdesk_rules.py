"""Helpdesks as they are, without Redis: each signature kind signed right and wrong, real-shaped
payloads of each helpdesk made tickets (HTML made text, long texts cut by the truncation rule,
pings, a ticket per event), and the write-back's config and requests."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time

import httpx
import pytest

from gateway import webhooks
from gateway.signatures import BadSignature
from gateway.writeback.adapters import auth_header, headers_for, merge_tags, write_for
from gateway.writeback.config import load_targets
from gateway.writeback.consumer import label_of, rate_limit_wait_s, retry_after_s
from ticketq.schema import truncate

SOURCES = webhooks.DEFAULT_SOURCES


def helpscout_headers(secret: str, body: bytes) -> dict[str, str]:
    signature = base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha1).digest()).decode()
    return {"x-helpscout-signature": signature, "x-helpscout-event": "convo.created"}


def basic(user: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(user.encode()).decode()}


# Real-shaped payloads (fields as the helpdesks send them, trimmed to what matters).
HELPSCOUT = {"id": 2391938111, "number": 349, "subject": "Invoice charged twice", "status": "active",
             "mailboxId": 85, "preview": "Hello, my card was charged twice...",
             "_embedded": {"threads": [{"id": 88171881, "type": "customer", "status": "active",
                                        "body": "<div>Hello,<br>my card was charged <b>twice</b> &amp; I want a "
                                                "refund.</div><div><br></div><p>Thanks</p>"}]}}  # fmt: skip
FRESHDESK = {"freshdesk_webhook": {"ticket_id": 1042, "ticket_subject": "Cannot log in",
                                   "ticket_description": "<div>My password reset mail never arrives.<br>Please"
                                                         " help &lt;urgent&gt;</div><script>track()</script>"
                                                         "<style>div{color:red}</style>",
                                   "ticket_status": "Open", "ticket_priority": "Medium"}}  # fmt: skip
INTERCOM = {"type": "notification_event", "app_id": "abc123", "id": "notif_ccd8a4d0", "topic":
            "conversation.user.created", "delivery_attempts": 1, "created_at": 1733400000,
            "data": {"type": "notification_event_data", "item": {"type": "conversation", "id": "147",
                     "source": {"type": "conversation", "subject": "", "body": "<p>Hi there,</p><p>the app "
                                "crashes on start &mdash; version 4.2</p>"}}}}  # fmt: skip
ZENDESK = {"account_id": 22129848, "id": "cbe4028c-7239-495d-b020-f22348516046", "subject": "zen:ticket:35",
           "time": "2026-12-06T04:00:00Z", "type": "zen:event-type:ticket.created",
           "zendesk_event_version": "2022-11-06", "event": {},
           "detail": {"id": "35", "subject": "Refund", "description": "charged twice", "status": "NEW",
                      "tags": ["vip"], "via": {"channel": "email"}}}  # fmt: skip


def test_helpscout_signature_right_and_wrong():
    body = json.dumps(HELPSCOUT).encode()
    webhooks.verify(SOURCES["helpscout"], b"hs", helpscout_headers("hs", body), body, 300)
    with pytest.raises(BadSignature, match="does not match"):
        webhooks.verify(SOURCES["helpscout"], b"hs", helpscout_headers("other", body), body, 300)
    with pytest.raises(BadSignature, match="does not match"):
        webhooks.verify(SOURCES["helpscout"], b"hs", helpscout_headers("hs", body), body + b" ", 300)
    with pytest.raises(BadSignature, match="missing X-HelpScout-Signature"):
        webhooks.verify(SOURCES["helpscout"], b"hs", {}, body, 300)


def test_freshdesk_basic_auth_or_its_shared_header():
    source, body = SOURCES["freshdesk"], json.dumps(FRESHDESK).encode()
    webhooks.verify(source, b"fd-user:fd-pass", basic("fd-user:fd-pass"), body, 300)
    webhooks.verify(source, b"APIKEY:X", basic("APIKEY:X"), body, 300)  # its API-key option
    webhooks.verify(source, b"s3cret", {"x-ticketq-webhook-secret": "s3cret"}, body, 300)
    for headers, message in [(basic("fd-user:wrong"), "does not match"), ({"authorization": "Basic %%%"},
                             "not base64"), ({"x-ticketq-webhook-secret": "nope"}, "does not match"),
                             ({}, "missing Authorization")]:  # fmt: skip
        with pytest.raises(BadSignature, match=message):
            webhooks.verify(source, b"fd-user:fd-pass", headers, body, 300)


def test_each_helpdesk_payload_becomes_a_plain_text_ticket():
    assert webhooks.ticket_of(SOURCES["helpscout"], HELPSCOUT)["text"] == (
        "Invoice charged twice\n\nHello,\nmy card was charged twice & I want a refund.\n\nThanks"
    )
    freshdesk = webhooks.ticket_of(SOURCES["freshdesk"], FRESHDESK)
    assert freshdesk["id"] == "freshdesk:1042"
    assert freshdesk["text"] == "Cannot log in\n\nMy password reset mail never arrives.\nPlease help <urgent>"
    intercom = webhooks.ticket_of(SOURCES["intercom"], INTERCOM)
    assert intercom["text"] == "Hi there,\n\nthe app crashes on start \u2014 version 4.2"
    zendesk = webhooks.ticket_of(SOURCES["zendesk"], ZENDESK)
    assert zendesk == {"id": "zendesk:35", "text": "Refund\n\ncharged twice",
                       "metadata": {"source": "zendesk", "source_id": "35"}}  # fmt: skip


def test_intercom_ping_is_recognised():
    ping = {"type": "notification_event", "topic": "ping", "id": "notif_1", "data": {"item": {"message": "hi"}}}
    assert webhooks.is_ping(SOURCES["intercom"], ping)
    assert not webhooks.is_ping(SOURCES["intercom"], INTERCOM)
    assert not webhooks.is_ping(SOURCES["zendesk"], ping)


def test_a_long_description_is_cut_by_the_truncation_rule_not_refused():
    thread = "".join(f"> reply {n}: sorry for the delay, about the invoice\u2026\n" for n in range(2000))
    payload = {**ZENDESK, "detail": {**ZENDESK["detail"], "description": "FIRST " + thread + " LAST"}}
    ticket = webhooks.ticket_of(SOURCES["zendesk"], payload, max_bytes=65536)
    whole = ("Refund\n\nFIRST " + thread + " LAST").encode()
    assert len(whole) > 65536 and ticket["metadata"]["text_bytes"] == len(whole)
    cut = ticket["text"].encode()
    assert len(cut) <= 65536 and len(cut) >= 65536 - 3  # at most a split character dropped at each cut
    assert ticket["text"].startswith("Refund\n\nFIRST") and ticket["text"].endswith(" LAST")  # head+tail
    assert cut == bytes(truncate(whole, 65536, "head+tail")).decode("utf-8", "ignore").encode()
    tail = webhooks.Source("z", "zendesk", "detail.id", None, "detail.description", truncation="tail")
    assert webhooks.ticket_of(tail, payload, max_bytes=1000)["text"].endswith(" LAST")
    assert webhooks.ticket_of(SOURCES["zendesk"], ZENDESK, max_bytes=65536)["metadata"].keys() == {
        "source", "source_id"}  # fmt: skip


def test_reclassify_makes_a_ticket_per_event_and_one_per_repeated_event():
    source = webhooks.Source("zendesk", "zendesk", "detail.id", "detail.subject", "detail.description",
                             comment="event.comment.body", event="id", reclassify=True)  # fmt: skip
    comment = {**ZENDESK, "id": "5e1b2f0a-0000-4000-8000-000000000001", "type": "zen:event-type:ticket.comment_added",
               "event": {"comment": {"id": 9, "body": "Also my login fails", "is_public": True}}}  # fmt: skip
    first, again = webhooks.ticket_of(source, ZENDESK), webhooks.ticket_of(source, ZENDESK)
    later = webhooks.ticket_of(source, comment)
    assert first["id"] == again["id"] == "zendesk:35:cbe4028c-7239-495d-b020-f22348516046"
    assert later["id"] != first["id"] and later["text"].endswith("\n\nAlso my login fails")
    assert later["metadata"]["source_id"] == "35"
    no_event = webhooks.Source("desk", "hub", "t.id", None, "t.body", reclassify=True)
    body_a, body_b = b'{"t": {"id": 1, "body": "a"}}', b'{"t": {"id": 1, "body": "b"}}'
    ids = [webhooks.ticket_of(no_event, json.loads(b), b)["id"] for b in (body_a, body_a, body_b)]
    assert ids[0] == ids[1] != ids[2]  # without an event id, the body names the event
    assert webhooks.ticket_of(SOURCES["zendesk"], comment)["id"] == "zendesk:35"  # off: a later event is a no-op


def test_mapping_file_takes_the_new_keys_and_refuses_unknown_ones(tmp_path):
    mapping = tmp_path / "sources.toml"
    mapping.write_text('[sources.fd]\nkind = "freshdesk"\nid = "t.id"\nbody = "t.html"\nhtml = true\n'
                       'secret_header = "X-Desk-Token"\nreclassify = true\n')  # fmt: skip
    source = webhooks.load_sources(str(mapping))["fd"]
    assert (source.html, source.reclassify, source.secret_header) == (True, True, "X-Desk-Token")
    webhooks.verify(source, b"tok", {"x-desk-token": "tok"}, b"{}", 300)
    mapping.write_text('[sources.fd]\nkind = "freshdesk"\nid = "t.id"\nbody = "t.b"\nhtlm = true\n')
    with pytest.raises(ValueError, match="unknown key"):
        webhooks.load_sources(str(mapping))
    mapping.write_text('[sources.fd]\nkind = "basic"\nid = "t.id"\nbody = "t.b"\n')
    with pytest.raises(ValueError, match="kind must be one of"):
        webhooks.load_sources(str(mapping))


WRITEBACK = """
[targets.zendesk]
kind = "zendesk"
url = "https://acme.zendesk.com/"
email = "bot@acme.example"

[targets.zendesk.labels.billing]
tags = ["billing"]
group_id = 360001
custom_fields = { 360002 = "billing" }

[targets.zendesk.labels.technical]
tags = ["technical", "eng"]

[targets.freshdesk]
kind = "freshdesk"
url = "https://acme.freshdesk.com"
field = "category"

[targets.freshdesk.labels.account]
custom_fields = { cf_category = "Account" }
group_id = 7

[targets.intercom]
kind = "intercom"
url = "https://api.intercom.io"
admin_id = 991267618

[targets.intercom.labels.billing]
tags = ["ai-billing"]
group_id = 5017691
custom_fields = { ai_category = "billing" }

[targets.intercom.labels.technical]
tags = ["ai-technical"]
"""


def test_writeback_requests_have_the_apis_shapes(tmp_path):
    path = tmp_path / "writeback.toml"
    path.write_text(WRITEBACK)
    targets = load_targets(path)
    write = write_for(targets["zendesk"], "35", "billing")
    assert (write.method, write.url) == ("PUT", "https://acme.zendesk.com/api/v2/tickets/35.json")
    assert write.payload == {
        "ticket": {
            "additional_tags": ["billing"],
            "remove_tags": ["eng", "technical"],
            "custom_fields": [{"id": 360002, "value": "billing"}],
            "group_id": 360001,
        }
    }
    assert write.digest == write_for(targets["zendesk"], "35", "billing").digest  # the same write, the same state
    assert write.digest != write_for(targets["zendesk"], "35", "technical").digest
    assert write_for(targets["zendesk"], "35", "account") is None  # a label without an entry: nothing written
    fresh = write_for(targets["freshdesk"], "1042", "account")
    assert (fresh.url, fresh.payload) == (
        "https://acme.freshdesk.com/api/v2/tickets/1042",
        {"custom_fields": {"cf_category": "Account"}, "group_id": 7},
    )
    assert merge_tags(targets["zendesk"], ["vip", "technical", "eng"], ["billing"]) == ["billing", "vip"]
    zendesk_auth = base64.b64decode(auth_header(targets["zendesk"], "TOK").split()[1]).decode()
    assert zendesk_auth == "bot@acme.example/token:TOK"
    assert base64.b64decode(auth_header(targets["freshdesk"], "KEY").split()[1]).decode() == "KEY:X"


def test_intercom_writes_name_the_state_wanted_with_bearer_auth_and_the_version(tmp_path):
    path = tmp_path / "writeback.toml"
    path.write_text(WRITEBACK)
    target = load_targets(path)["intercom"]
    assert (target.admin_id, target.version) == ("991267618", "2.11")  # an integer id read as Intercom's string
    write = write_for(target, "64619700005694", "billing")
    assert (write.method, write.url) == ("POST", "https://api.intercom.io/conversations/64619700005694")
    assert write.payload == {"tags": ["ai-billing"], "remove_tags": ["ai-technical"], "team_assignee_id": "5017691",
                             "custom_attributes": {"ai_category": "billing"}}  # fmt: skip
    assert write_for(target, "1", "technical").payload == {"tags": ["ai-technical"], "remove_tags": ["ai-billing"]}
    assert headers_for(target, "TOK") == {"Content-Type": "application/json", "Accept": "application/json",
                                          "Authorization": "Bearer TOK", "Intercom-Version": "2.11"}  # fmt: skip


def test_a_429_waits_its_retry_after_else_intercoms_reset_time():
    assert rate_limit_wait_s(httpx.Headers({"Retry-After": "3", "X-RateLimit-Reset": "0"})) == 3.0
    assert 29 < rate_limit_wait_s(httpx.Headers({"X-RateLimit-Reset": str(int(time.time()) + 30)})) <= 30
    assert rate_limit_wait_s(httpx.Headers({"X-RateLimit-Reset": "1487332520"})) == 0.0  # past: no wait
    assert rate_limit_wait_s(httpx.Headers({"X-RateLimit-Reset": "soon"})) == 0.0


@pytest.mark.parametrize("text, message", [
    ('[targets.z]\nkind = "zendesk"\nurl = "https://z"\n', "needs `email`"),
    ('[targets.z]\nkind = "jira"\nurl = "https://z"\n', "kind must be one of"),
    ('[targets.z]\nkind = "freshdesk"\nurl = "z.example"\n', "url must be"),
    ('[targets.z]\nkind = "freshdesk"\nurl = "https://z"\n[targets.z.labels.billing]\n', "writes nothing"),
    ('[targets.z]\nkind = "freshdesk"\nurl = "https://z"\n[targets.z.labels.billing]\ntag = ["x"]\n', "unknown key"),
    ('[targets.i]\nkind = "intercom"\nurl = "https://api.intercom.io"\n', "needs `admin_id`"),
    ("", "no \\[targets"),
])  # fmt: skip
def test_writeback_config_errors_name_the_problem(tmp_path, text, message):
    path = tmp_path / "writeback.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_targets(path)


def test_retry_after_and_labels():
    assert retry_after_s("3") == 3.0 and retry_after_s(None) == 0.0 and retry_after_s("soon") == 0.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: no wait
    assert label_of({"label": "billing"}, "label") == "billing"
    assert label_of({"fields": {"category": {"label": "account"}}}, "category") == "account"
    assert label_of({"fields": {"tags": {"labels": ["a"]}}}, "tags") is None


def test_writeback_refuses_to_start_without_targets_or_secrets(tmp_path, monkeypatch):
    from gateway.writeback.cli import main

    for name in [name for name in os.environ if name.startswith("TICKETQ_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit, match="no write-back targets: set TICKETQ_WRITEBACK_CONFIG"):
        main([])
    path = tmp_path / "writeback.toml"
    path.write_text(WRITEBACK)
    monkeypatch.setenv("TICKETQ_WRITEBACK_SECRETS", "zendesk=TOK")
    missing = r"no API secret for target\(s\) freshdesk, intercom in TICKETQ_WRITEBACK_SECRETS"
    with pytest.raises(SystemExit, match=missing):
        main(["--config", str(path)])
    with pytest.raises(SystemExit, match="No such file"):
        main(["--config", str(tmp_path / "missing.toml")])
