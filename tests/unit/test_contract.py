"""The ticket contract (ticketq/): one rule, the same verdict on every path, and the import direction.

Pure unit tests (no torch, no Redis, no worker process), plus two fresh interpreters: one proves
that the producer loads nothing from `worker/`, one runs `ticketq classify` on a ticket it must
refuse without loading a model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from producer.api import Producer
from producer.errors import BrokerUnavailable
from producer.ticketfile import read_tickets
from ticketq import contract
from ticketq.config import ClientSettings, SettingsError, mask_url
from ticketq.connections import RedisUnavailable, connect
from ticketq.contract import (
    DEAD_LETTER_REASONS,
    MAX_TICKET_BYTES,
    Reason,
    Ticket,
    TicketRejected,
    UniqueIds,
    check_text,
    validate_ticket,
)

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 64  # TICKETQ_MAX_TICKET_BYTES for these tests (its lowest allowed value)
DEAD_URL = "redis://:s3cret@127.0.0.1:1/0"  # nothing listens on port 1


def reason_of(raw: object, max_bytes: int = LIMIT) -> str | None:
    try:
        validate_ticket(raw, max_bytes)
    except TicketRejected as exc:
        return exc.reason
    return None


# --- the import direction ---


def test_producer_imports_nothing_from_worker_and_no_torch():
    code = (
        "import sys, producer.api, producer.cli, producer.ticketfile, producer.resultfile, producer.synthetic\n"
        "loaded = sorted(m for m in sys.modules if m == 'worker' or m.startswith('worker.'))\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not loaded, f'producer loaded worker modules: {loaded}'\n"
        "assert not heavy, f'producer loaded {heavy}'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# --- validate_ticket: every reason, and the id rule ---

REFUSED = {
    "not_an_object": (["a list"], Reason.BAD_PAYLOAD),
    "a_string": ("just text", Reason.BAD_PAYLOAD),
    "no_text": ({"id": "a"}, Reason.MISSING_FIELD),
    "text_null": ({"text": None}, Reason.WRONG_TYPE),
    "text_a_number": ({"text": 42}, Reason.WRONG_TYPE),
    "id_a_float": ({"id": 1.5, "text": "hi"}, Reason.WRONG_TYPE),
    "id_a_bool": ({"id": True, "text": "hi"}, Reason.WRONG_TYPE),
    "id_a_list": ({"id": ["x"], "text": "hi"}, Reason.WRONG_TYPE),
    "id_empty": ({"id": "", "text": "hi"}, Reason.EMPTY_ID),
    "id_whitespace": ({"id": " \t", "text": "hi"}, Reason.EMPTY_ID),
    "id_slash": ({"id": "a/b", "text": "hi"}, Reason.INVALID_ID),  # a path segment: GET /v1/tickets/{id}
    "id_control": ({"id": "a\nb", "text": "hi"}, Reason.INVALID_ID),
    "id_too_long": ({"id": "x" * 257, "text": "hi"}, Reason.INVALID_ID),
    "id_int_too_long": ({"id": 10**300, "text": "hi"}, Reason.INVALID_ID),
    "lone_surrogate": ({"text": "broken \udcff"}, Reason.INVALID_UTF8),
    "one_byte_over": ({"text": "a" * (LIMIT + 1)}, Reason.OVERSIZE),
    "bytes_not_characters": ({"text": "é" * (LIMIT // 2 + 1)}, Reason.OVERSIZE),  # 33 characters, 66 bytes
    "blank_and_oversize": ({"text": " " * (LIMIT + 1)}, Reason.OVERSIZE),  # size is checked before content
    "empty": ({"text": ""}, Reason.EMPTY_TEXT),
    "whitespace": ({"text": "\n\t \u2028\u3000"}, Reason.EMPTY_TEXT),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_each_refusal_names_its_reason(case):
    raw, reason = REFUSED[case]
    with pytest.raises(TicketRejected) as info:
        validate_ticket(raw, LIMIT)
    assert info.value.reason == reason and type(info.value.reason) is str
    assert str(info.value).startswith(f"{reason.value}: ")


def test_the_id_rule():
    assert validate_ticket({"text": "hi"}).id == ""  # none given: the receiver names it
    assert validate_ticket({"id": None, "text": "hi"}).id == ""
    assert validate_ticket({"id": 7, "text": "hi"}).id == "7"  # an integer is its decimal string
    assert validate_ticket({"id": -12, "text": "hi"}).id == "-12"
    assert validate_ticket({"id": " T-1 ", "text": "hi"}).id == " T-1 "  # a string id is kept as sent


def test_accepted_text_is_kept_whole_and_the_limit_is_inclusive():
    text = "  é" + "a" * (LIMIT - 4)  # exactly LIMIT bytes, surrounding whitespace included
    assert validate_ticket({"text": text, "submitted_at": 1.5}, LIMIT) == Ticket("", text, 1.5)
    assert validate_ticket({"text": "hi", "submitted_at": float("nan")}).submitted_at is None
    assert validate_ticket({"text": "hi", "submitted_at": "yesterday"}).submitted_at is None
    assert validate_ticket({"text": "x" * MAX_TICKET_BYTES}).text == "x" * MAX_TICKET_BYTES


def test_duplicate_ids_are_refused_within_one_input():
    ids = UniqueIds()
    ids.add("a", "on line 1")
    ids.add("b", "on line 2")
    with pytest.raises(TicketRejected, match=r"^duplicate_id: duplicate id 'a' \(first seen on line 1\)$"):
        ids.add("a", "on line 3")


def test_ticket_rejected_round_trips_through_its_message():
    rejected = TicketRejected(Reason.OVERSIZE, "text is 99 bytes")
    assert isinstance(rejected, ValueError) and rejected.reason == "oversize" and type(rejected.reason) is str
    rebuilt = TicketRejected(str(rejected))  # what a Celery client does with the stored message
    assert (rebuilt.reason, rebuilt.detail, str(rebuilt)) == ("oversize", "text is 99 bytes", str(rejected))
    assert repr(rebuilt) == "TicketRejected('oversize', 'text is 99 bytes')"


def test_reasons_are_the_stored_strings():
    assert str(Reason.EMPTY_TEXT) == f"{Reason.EMPTY_TEXT}" == "empty_text"
    assert json.dumps({"reason": Reason.OVERSIZE}) == '{"reason": "oversize"}'
    assert len({reason.value for reason in Reason}) == len(Reason)
    assert set(DEAD_LETTER_REASONS) <= set(Reason)


@pytest.mark.parametrize("text", [None, 42, b"bytes", "", "  \n", "lone \ud800"])
def test_the_engine_refuses_exactly_what_the_contract_refuses(text):
    from worker.engine.prompt import InvalidTicket, canonical_text  # plain Python: no torch

    with pytest.raises(TicketRejected) as expected:
        check_text(text)
    with pytest.raises(InvalidTicket) as engine:
        canonical_text(text)
    assert (engine.value.reason, str(engine.value)) == (expected.value.reason, str(expected.value))
    assert reason_of({"text": text}) == expected.value.reason


def test_the_engine_strips_what_the_contract_keeps():
    from worker.engine.prompt import canonical_text

    assert canonical_text("  refund please \n") == "refund please"


# --- the same verdict from the producer API, a ticket file and the worker ---

VERDICT_CASES = {  # the ticket, and the one verdict every path must give: ("ok", id) or (reason, "")
    "oversize": ({"id": "big", "text": "x" * (LIMIT + 1)}, ("oversize", "")),
    "integer_id": ({"id": 7, "text": "my invoice is wrong"}, ("ok", "7")),
    "empty_text": ({"id": "blank", "text": " \n\t"}, ("empty_text", "")),
    "empty_id": ({"id": "", "text": "my invoice is wrong"}, ("empty_id", "")),
    "bool_id": ({"id": False, "text": "my invoice is wrong"}, ("wrong_type", "")),
    "missing_text": ({"id": "m"}, ("missing_field", "")),
    "text_not_a_string": ({"id": "n", "text": 12345}, ("wrong_type", "")),
    "lone_surrogate": ({"id": "s", "text": "broken \udcff byte"}, ("invalid_utf8", "")),
    "at_the_limit": ({"id": "fits", "text": "é" * (LIMIT // 2)}, ("ok", "fits")),
}


def producer_verdict(raw: dict) -> tuple[str, str]:
    """`("ok", id)` or `(reason, "")` from `Producer.submit_many` (the broker is dead: nothing is sent)."""
    with Producer(ClientSettings(max_ticket_bytes=LIMIT), broker_url=DEAD_URL) as producer:
        try:
            producer.submit_many([raw])
        except BrokerUnavailable:  # validation passed, then the send failed
            return "ok", producer.validate(raw["text"], raw.get("id"))[0]
        except ValueError as exc:
            return re.search(r"#0: (\w+): ", str(exc)).group(1), ""
    raise AssertionError("a dead broker accepted a message")


def file_verdict(raw: dict, tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(raw) + "\n", encoding="utf-8")
    parsed = read_tickets(path, max_bytes=LIMIT)
    return ("ok", parsed.tickets[0]["id"]) if parsed.tickets else (parsed.errors[0].reason, "")


def worker_verdict(raw: dict) -> tuple[str, str]:
    """What the worker decides for the ticket as it arrives off the queue (a JSON round trip)."""
    from worker.service.admission import validate_ticket as worker_validate

    assert worker_validate is validate_ticket, "the worker must use the contract's validator"
    try:
        return "ok", worker_validate(json.loads(json.dumps(raw)), LIMIT).id
    except TicketRejected as exc:
        return exc.reason, ""


@pytest.mark.parametrize("case", list(VERDICT_CASES))
def test_producer_file_and_worker_agree(case, tmp_path):
    raw, expected = VERDICT_CASES[case]
    verdicts = {"producer": producer_verdict(raw), "file": file_verdict(raw, tmp_path), "worker": worker_verdict(raw)}
    assert verdicts == dict.fromkeys(verdicts, expected)


def test_duplicate_ids_are_refused_by_the_file_and_by_submit_many(tmp_path):
    """The worker sees one message at a time, so the duplicate rule belongs to whoever holds the whole input."""
    rows = [{"id": 7, "text": "first"}, {"id": "7", "text": "the same id as a string"}, {"id": "8", "text": "ok"}]
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    parsed = read_tickets(path)
    assert [ticket["id"] for ticket in parsed.tickets] == ["7", "8"]
    assert [(error.line, error.reason, error.message) for error in parsed.errors] == [
        (2, "duplicate_id", "duplicate id '7' (first seen on line 1)")
    ]
    refused = r"1 of 3 tickets are invalid, none sent: #1: duplicate_id: duplicate id '7' \(first seen at #0\)"
    with Producer(ClientSettings(), broker_url=DEAD_URL) as producer, pytest.raises(ValueError, match=refused):
        producer.submit_many(rows)


def test_offline_classify_refuses_an_oversize_ticket_like_the_queue(tmp_path):
    """A 100,000-character ticket used to be truncated and classified offline; now it is `oversize` everywhere."""
    (tmp_path / "t.jsonl").write_text(json.dumps({"id": "long", "text": "refund " * 14_286}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TICKETQ_")}
    done = subprocess.run([sys.executable, "-m", "ticketq_cli.cli", "classify", "t.jsonl", "-o", "r.jsonl",
                           "--no-progress"],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [(row["id"], row["status"], row["reason"]) for row in rows] == [("long", "failed", "oversize")], done.stderr
    assert done.returncode == 3 and "Loading weights" not in done.stderr  # nothing to classify: no model loaded


# --- client settings and connections ---


def test_worker_settings_extend_the_client_settings():
    from worker.settings import Settings

    assert issubclass(Settings, ClientSettings)
    assert set(ClientSettings.model_fields) <= set(Settings.model_fields)
    assert Settings().max_ticket_bytes == ClientSettings().max_ticket_bytes == MAX_TICKET_BYTES


def test_client_settings_errors_are_one_line_each(monkeypatch):
    monkeypatch.setenv("TICKETQ_MAX_TICKET_BYTES", "1")
    monkeypatch.setenv("TICKETQ_MAX_BATCH_TOKENS", "-1")  # a worker setting: not the client's to check
    with pytest.raises(SettingsError) as info:
        ClientSettings.from_env({"broker_url": "--broker-url"}, broker_url="http://:pw@x")
    assert str(info.value).splitlines() == [
        "TICKETQ_MAX_TICKET_BYTES=1: must be >= 64",
        "--broker-url http://:**@x: must be a Redis URL: redis://[:password@]host:6379/0, rediss://… (TLS) or "
        "sentinel://host:26379;sentinel://host2:26379, not http://",
    ]


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("redis://user:pw@h:6379/0", "redis://user:**@h:6379/0"),
        ("rediss://:p@ss@h:6380/0?ssl_cert_reqs=required", "rediss://:**@h:6380/0?ssl_cert_reqs=required"),
        ("redis://h:6379/0?db=1&password=pw", "redis://h:6379/0?db=1&password=**"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://h:notaport/0", "redis://h:notaport/0"),  # never raises: it is used on bad input too
        ("billing,technical", "billing,technical"),
        ("redis://:pa#ss@h:6379/0", "redis://:**@h:6379/0"),  # '#', '/' and '?' typed unencoded
        ("redis://u:p/a?s#s@h:6379/0", "redis://u:**@h:6379/0"),
        ("redis://h:6379/0?password=a#b&db=1", "redis://h:6379/0?password=**&db=1"),
        ("sentinel://:pw@h1:26379;sentinel://:pw2@h2:26379", "sentinel://:**@h1:26379;sentinel://:**@h2:26379"),
    ],
)
def test_mask_url(text, masked):
    assert mask_url(text) == masked


def test_a_password_with_an_unencoded_hash_is_refused_without_showing_it(monkeypatch):
    monkeypatch.setenv("TICKETQ_BROKER_URL", "redis://:s3c#ret@h:6379/0")
    with pytest.raises(SettingsError) as info:
        ClientSettings.from_env()
    message = str(info.value)
    assert "s3c" not in message and "%23" in message and message.startswith("TICKETQ_BROKER_URL=redis://:**@"), message
    assert "port" not in message, "not taken for a port that is no number"


def test_a_bare_rediss_url_verifies_the_server_against_the_system_store():
    settings = ClientSettings(broker_url="rediss://:pw@h:6380/0", result_backend="rediss://h:6380/1?ssl_ca_certs=/c")
    assert settings.broker_url == "rediss://:pw@h:6380/0?ssl_cert_reqs=CERT_REQUIRED"
    assert settings.backend_url == "rediss://h:6380/1?ssl_ca_certs=/c&ssl_cert_reqs=CERT_REQUIRED"
    for kept in ("rediss://h:6380/0?ssl_cert_reqs=CERT_NONE", "redis://h:6379/0"):
        assert ClientSettings(broker_url=kept).broker_url == kept


def test_a_failed_tls_handshake_gets_a_tls_hint_not_is_it_running():
    reason = redis.ConnectionError("Error 1 connecting to h:6380. [SSL: CERTIFICATE_VERIFY_FAILED] certificate "
                                   "verify failed: self-signed certificate in certificate chain (_ssl.c:1006).")
    message = str(RedisUnavailable("rediss://:pw@h:6380/0", reason))
    assert "refused the TLS connection" in message and "ssl_ca_certs=" in message, message
    assert "Check that it is running" not in message and "pw" not in message
    wrong = redis.ConnectionError("Error 1 connecting to h:6379. [SSL: WRONG_VERSION_NUMBER] wrong version number")
    assert "does not speak TLS" in str(RedisUnavailable("rediss://h:6379/0", wrong))


def test_an_empty_pack_is_named_not_a_nonetype():
    with pytest.raises(TicketRejected, match=r"bad_payload: .*got null \(or an empty pack `\[\]`"):
        validate_ticket(None)


def test_redis_errors_say_what_to_do_without_the_password():
    refused = RedisUnavailable("redis://:s3cret@h:6379/0", redis.AuthenticationError("invalid password."))
    assert refused.refused and "refused the credentials" in str(refused) and "TICKETQ_BROKER_URL" in str(refused)
    with pytest.raises(BrokerUnavailable) as info:
        connect(DEAD_URL, connect_timeout_s=1.0, error=BrokerUnavailable)
    message = str(info.value)
    assert "Redis is not reachable at redis://:**@127.0.0.1:1/0" in message and "TICKETQ_BROKER_URL" in message
    assert "redis-server --port 1)" in message  # the port the URL names, not the default
    assert "--broker-url" not in message  # the Python API has no such option; ticketq-produce adds it
    assert "s3cret" not in message + repr(info.value) + str(refused) + repr(refused)
    assert not info.value.refused and isinstance(info.value, ConnectionError)


def test_contract_module_imports_nothing_heavy():
    source = Path(contract.__file__).read_text(encoding="utf-8")
    assert not re.search(r"^\s*(from|import) (torch|celery|kombu|redis|pydantic|worker|producer)", source, re.M)


def test_one_rule_names_a_result_whatever_its_outcome():
    """ok, failed and expired results of a ticket without an id carry the same id: the task id for
    a single-ticket message, `<task>:<slot>` for each ticket of a packed one (slot 0 included)."""
    from ticketq.contract import result_id

    assert result_id(None, "t", 0, packed=False) == "t"
    assert result_id("", "t", 0, packed=False) == "t"
    assert [result_id(None, "t", slot, packed=True) for slot in (0, 1)] == ["t:0", "t:1"]
    assert result_id("T-9", "t", 3, packed=True) == "T-9"
    assert result_id(42, "t", 0, packed=False) == "42"
    assert result_id(True, "t", 0, packed=False) == "t"  # not an id: JSON true is no integer here


@pytest.mark.parametrize("schema", [5, "", "two words", "x" * 200, ["support"]])
def test_a_schema_that_is_no_name_is_refused(schema):
    with pytest.raises(TicketRejected) as caught:
        validate_ticket({"text": "hello", "schema": schema})
    assert caught.value.reason == Reason.WRONG_TYPE and "'schema'" in str(caught.value)


def test_a_ticket_names_its_schema_and_a_file_row_keeps_it(tmp_path):
    assert validate_ticket({"text": "hello", "schema": "support-topics.v2"}).schema == "support-topics.v2"
    assert validate_ticket({"text": "hello", "schema": None}).schema is None
    path = tmp_path / "named.jsonl"
    rows = [{"id": "a", "text": "hi", "schema": "support"}, {"text": "x"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert [ticket.get("schema") for ticket in read_tickets(path).tickets] == ["support", None]
