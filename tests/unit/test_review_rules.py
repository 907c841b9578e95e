"""The review page's pure parts: the signed session cookie and CSRF tokens (`gateway.review.session`),
a form read as a decision (`pages.expected_of`), a review entry's tenant (`store.tenant_and_id`),
and the labelled record and its eval row (`ticketq.labelled`)."""

from __future__ import annotations

import pytest

from gateway.auth import token_digest
from gateway.review import session
from gateway.review.pages import expected_of
from gateway.review.store import Item, ReviewStore, tenant_and_id
from ticketq import labelled

SECRET = b"s" * 32
TOKENS = {"alice@acme": token_digest("alice-token"), "bob@beta": token_digest("bob-token")}


def test_a_session_names_its_token_until_it_expires():
    cookie = session.issue(SECRET, "alice@acme", TOKENS["alice@acme"], now=1000.0, ttl_s=60)
    assert session.holder(SECRET, cookie, TOKENS, now=1059.0) == "alice@acme"
    assert session.holder(SECRET, cookie, TOKENS, now=1060.0) is None  # expired


@pytest.mark.parametrize("change", ["forged", "other secret", "token removed", "token rotated", "garbage", "none"])
def test_a_session_is_refused_when_forged_or_its_token_is_gone(change):
    cookie = session.issue(SECRET, "alice@acme", TOKENS["alice@acme"], now=1000.0, ttl_s=60)
    secret, tokens = SECRET, dict(TOKENS)
    if change == "forged":  # the payload re-encoded for another token, the old signature kept
        other = session.issue(b"x" * 32, "bob@beta", TOKENS["bob@beta"], now=1000.0, ttl_s=60)
        cookie = other.split(".")[0] + "." + cookie.split(".")[1]
    elif change == "other secret":
        secret = b"t" * 32
    elif change == "token removed":
        del tokens["alice@acme"]
    elif change == "token rotated":
        tokens["alice@acme"] = token_digest("alice-new-token")
    elif change == "garbage":
        cookie = "not.a-cookie"
    else:
        cookie = None
    assert session.holder(secret, cookie, tokens, now=1001.0) is None


def test_csrf_tokens_belong_to_one_session():
    a = session.issue(SECRET, "alice@acme", TOKENS["alice@acme"], now=1000.0, ttl_s=60)
    b = session.issue(SECRET, "bob@beta", TOKENS["bob@beta"], now=1000.0, ttl_s=60)
    assert session.csrf_ok(SECRET, a, session.csrf_token(SECRET, a))
    assert not session.csrf_ok(SECRET, a, session.csrf_token(SECRET, b))
    assert not session.csrf_ok(SECRET, a, None) and not session.csrf_ok(SECRET, a, "")


def item(review_id: str = "1-0", text: str | None = "my invoice is wrong") -> Item:
    result = {"id": "acme:T-1", "schema": "support", "status": "ok", "review": True, "fields": {
        "category": {"label": "technical", "probs": {"billing": 0.4, "technical": 0.45, "account": 0.15},
                     "confidence": 0.05, "review": True},
        "topics": {"labels": ["refund"], "probs": {"refund": 0.7, "outage": 0.2}, "confidence": 0.4,
                   "review": False}}}  # fmt: skip
    return Item(review_id, "T-1", "acme", text, result)


def test_a_form_states_one_label_per_single_field_and_any_labels_of_a_multi_field():
    form = {"field:category": ["billing"], "field:topics": ["outage", "refund"], "csrf": ["x"]}
    assert expected_of(item(), form) == {"category": "billing", "topics": ["refund", "outage"]}
    assert expected_of(item(), {"field:category": ["technical"]}) == {"category": "technical", "topics": []}


@pytest.mark.parametrize(("form", "problem"), [
    ({"field:category": ["spam"]}, "'spam' is not a label of field 'category'"),
    ({"field:category": ["billing", "account"]}, "exactly one label of field 'category'"),
    ({"field:topics": ["refund"]}, "exactly one label of field 'category'"),
    ({"field:category": ["billing"], "field:topics": ["refund", "<script>"]}, "'<script>' is not a label"),
])  # fmt: skip
def test_a_form_with_a_label_that_is_not_the_fields_is_refused(form, problem):
    with pytest.raises(ValueError, match=problem):
        expected_of(item(), form)


@pytest.mark.parametrize(("wire", "multi", "expected"), [
    ("acme:T-1", True, ("acme", "T-1")),
    ("acme:T:1", True, ("acme", "T:1")),
    ("T-1", True, ("default", "T-1")),
    (":T-1", True, ("default", ":T-1")),
    ("acme:T-1", False, ("default", "acme:T-1")),  # one tenant: ids are sent as given
])  # fmt: skip
def test_a_review_entrys_tenant_is_the_gateways(wire, multi, expected):
    assert tenant_and_id(wire, multi) == expected


def test_a_decision_records_who_when_what_and_the_corrected_fields():
    expected = {"category": "billing", "topics": ["refund"]}
    record = labelled.decision(item().as_record_source(), expected, "alice@acme", at=1765000000.25)
    assert record["corrected"] == ["category"] and record["model"] == {"category": "technical", "topics": ["refund"]}
    assert record["reviewer"] == "alice@acme" and record["decided_at"] == "2025-12-06T05:46:40.250Z"
    assert labelled.eval_row(record) == {"id": "T-1", "text": "my invoice is wrong", "schema": "support",
                                         "expected": expected}  # fmt: skip
    assert labelled.parse(__import__("json").dumps(record)) == record
    assert labelled.parse(b"{not json") is None and labelled.parse(b'{"id": 1}') is None


def test_a_confirmed_multi_label_field_is_compared_as_a_set():
    assert labelled.corrected_fields({"topics": ["a", "b"]}, {"topics": ["b", "a"]}) == []
    assert labelled.corrected_fields({"topics": ["a"]}, {"topics": []}) == ["topics"]


def test_a_reviewed_result_carries_the_reviewers_labels_and_who_decided():
    expected = {"category": "billing", "topics": []}
    record = labelled.decision(item().as_record_source(), expected, "alice@acme", at=0.0)
    revised = ReviewStore.revised(item(), record)
    assert revised["fields"]["category"]["label"] == "billing" and revised["fields"]["topics"]["labels"] == []
    assert revised["fields"]["category"]["probs"] == item().result["fields"]["category"]["probs"]  # the model's
    assert revised["review"] is False and revised["reviewed"]["by"] == "alice@acme"
    assert revised["reviewed"]["corrected"] == ["category", "topics"]
