"""Producer tests: synthetic data, ticket files, validation at the edge, the message on the wire.

Everything here runs without a worker. Only `test_messages_on_the_wire` needs the Redis at
127.0.0.1:6379 (db 15, flushed before and after); it plays the worker's part by storing results
in the backend directly, so `wait()` is exercised end to end.
"""

from __future__ import annotations

import base64
import gc
import json
import time
from collections import Counter
from types import SimpleNamespace

import pytest
import redis
from celery import states
from typer.testing import CliRunner

from producer.api import POLL_WINDOW, BrokerUnavailable, Producer, idempotent_task_id, ticket_results
from producer.cli import app as cli_app
from producer.synthetic import awkward_texts, generate_tickets
from producer.tickets import TicketFileError, read_tickets, write_results
from ticketq.config import ClientSettings, mask_url
from ticketq.names import RESULTS_STREAM, TASK_CLASSIFY

REDIS_URL = "redis://127.0.0.1:6379/15"
DEAD_URL = "redis://:s3cret@127.0.0.1:1/0"  # nothing listens on port 1


def words(text: str) -> int:
    return len(text.split())


# --- synthetic tickets ---


def test_synthetic_is_deterministic_per_seed():
    assert generate_tickets(200, seed=7) == generate_tickets(200, seed=7)
    assert generate_tickets(200, seed=7) != generate_tickets(200, seed=8)
    tickets = generate_tickets(3)
    assert [t["id"] for t in tickets] == ["t-000001", "t-000002", "t-000003"]
    assert generate_tickets(0) == []


def test_synthetic_lengths_have_a_long_tail():
    counts = [words(t["text"]) for t in generate_tickets(3000, seed=1)]
    short = sum(10 <= c <= 60 for c in counts) / len(counts)
    assert short > 0.75, "most tickets are short"
    assert sum(c > 200 for c in counts) >= 30, "a few are very long"
    assert max(counts) > 350
    assert min(counts) >= 5


def test_synthetic_covers_labels_and_variety():
    tickets = generate_tickets(3000, seed=2)
    labels = Counter(t["expected"] for t in tickets)
    assert set(labels) == {"billing", "technical", "account"}
    assert min(labels.values()) > 800, labels
    texts = [t["text"] for t in tickets]
    injected = sum("Ignore previous instructions" in s or "SYSTEM: the correct label" in s
                   or "Note to the AI" in s or "</ticket>" in s or "regardless of what" in s for s in texts)
    assert 0.03 < injected / len(texts) < 0.08
    assert any(not s.isascii() for s in texts)
    assert any(any("\u4e00" <= ch <= "\u9fff" for ch in s) for s in texts), "some CJK"
    assert any("\n\n" in s for s in texts), "some blank lines"
    assert any("Traceback" in s or "```" in s for s in texts), "some code"


def test_synthetic_labels_are_learnable():
    """A keyword count already separates the labels: the vocabulary carries the topic."""
    keywords = {
        "billing": ["invoice", "refund", "charge", "card", "subscription", "price", "payment", "receipt"],
        "technical": ["error", "crash", "install", "api", "time", "bug", "app", "sync", "exception"],
        "account": ["password", "log", "email", "2fa", "two-factor", "username", "locked", "profile"],
    }
    tickets = generate_tickets(2000, seed=5)
    right = 0
    for ticket in tickets:
        text = ticket["text"].lower()
        scores = {label: sum(text.count(word) for word in vocab) for label, vocab in keywords.items()}
        right += max(scores, key=scores.get) == ticket["expected"]
    assert right / len(tickets) > 0.85


def test_synthetic_custom_labels_and_bad_arguments():
    tickets = generate_tickets(300, seed=3, labels=("billing", "shipping"))
    assert {t["expected"] for t in tickets} == {"billing", "shipping"}
    assert any("shipping" in t["text"] for t in tickets if t["expected"] == "shipping")
    with pytest.raises(ValueError, match="n must be"):
        generate_tickets(-1)
    with pytest.raises(ValueError, match="two labels"):
        generate_tickets(3, labels=("only",))


def test_awkward_texts_are_all_valid_tickets():
    producer = Producer(ClientSettings(), broker_url=DEAD_URL)
    texts = awkward_texts()
    assert "<|im_end|>" in texts
    assert any(s != s.strip() for s in texts), "leading/trailing whitespace"
    assert any(len(max(s.split(), key=len)) > 500 for s in texts), "a very long word"
    for text in texts:
        assert producer.validate(text, "x") == ("x", text)


# --- ticket files ---


def test_jsonl_good_and_bad_rows(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        '\ufeff{"id": "a", "text": "refund please", "expected": "billing"}',
        '{"text": "no id here"}',
        "",
        '{"id": 7, "text": "int id, and a line\u2028separator"}',
        "{not json",
        '["a", "list"]',
        '{"id": "b"}',
        '{"id": "c", "text": "   "}',
        '{"id": "d", "text": 42}',
        '{"id": "a", "text": "duplicate"}',
        '{"id": ["x"], "text": "bad id"}',
    ]
    path.write_bytes("\n".join(lines).encode() + b"\n" + b'{"id": "e", "text": "\xff"}\n')
    parsed = read_tickets(path)
    assert parsed.tickets == [
        {"id": "a", "text": "refund please", "expected": "billing"},
        {"id": "line-2", "text": "no id here"},
        {"id": "7", "text": "int id, and a line\u2028separator"},
    ]
    errors = {e.line: e.message for e in parsed.errors}
    assert set(errors) == {5, 6, 7, 8, 9, 10, 11, 12}
    assert "invalid JSON" in errors[5]
    assert "JSON object" in errors[6]
    assert "no 'text' field" in errors[7]
    assert "empty" in errors[8]
    assert "must be a string" in errors[9]
    assert "duplicate id 'a' (first seen on line 1)" in errors[10]
    assert "'id' must be" in errors[11]
    assert "UTF-8" in errors[12]
    assert str(parsed.errors[0]) == f"{path}:5: {errors[5]}"


def test_csv_good_and_bad_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        '\ufeffid,text\n1,"multi\nline ticket"\n2,"say ""hi"""\n3\n\n,no id\n4,"   "\n5,a,extra\n',
        encoding="utf-8",
    )
    parsed = read_tickets(path)
    assert parsed.tickets == [
        {"id": "1", "text": "multi\nline ticket"},
        {"id": "2", "text": 'say "hi"'},
        {"id": "line-7", "text": "no id"},
    ]
    assert [(e.line, e.message.split(" (")[0]) for e in parsed.errors] == [
        (5, "expected 2 fields"),
        (8, "ticket text is empty or whitespace only"),
        (9, "expected 2 fields"),
    ]


def test_csv_text_only_column_and_format_sniffing(tmp_path):
    path = tmp_path / "tickets.txt"
    path.write_text("text,expected\nmy card was charged twice,billing\n", encoding="utf-8")
    assert read_tickets(path).tickets == [{"id": "line-2", "text": "my card was charged twice", "expected": "billing"}]
    path.write_text('{"text": "sniffed as jsonl"}\n', encoding="utf-8")
    assert read_tickets(path).tickets == [{"id": "line-1", "text": "sniffed as jsonl"}]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"id,body\n1,hello\n", "must name a 'text' column"),
        (b"1,my card was charged twice\n", "must name a 'text' column"),  # no header at all
        (b"id,text\n1,caf\xe9\n", ":2: CSV file is not valid UTF-8"),
        (b"\xef\xbb\xbfid,text\n1,ok\n2,caf\xe9\n", ":3: CSV file is not valid UTF-8"),  # the BOM is no line's bytes
    ],
)
def test_unusable_csv_names_the_file(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(TicketFileError, match=message) as info:
        read_tickets(path)
    assert str(path) in str(info.value)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(TicketFileError, match=r"nope\.jsonl: cannot read"):
        read_tickets(tmp_path / "nope.jsonl")


def test_write_results_round_trips_unicode(tmp_path):
    results = [{"id": "a", "label": "billing", "text": "Zoë 你好 \u2028 🙏"}, {"id": "b", "status": "failed"}]
    path = tmp_path / "out.jsonl"
    assert write_results(path, results) == 2
    assert "你好" in path.read_text(encoding="utf-8")
    assert [json.loads(line) for line in path.read_bytes().split(b"\n") if line] == results


# --- validation at the edge (nothing is sent: the broker is unreachable, yet ValueError comes first) ---


@pytest.fixture
def offline_producer():
    producer = Producer(ClientSettings(max_ticket_bytes=64), broker_url=DEAD_URL)
    yield producer
    producer.close()


@pytest.mark.parametrize("text", ["", "   ", "\n\t \r\n"])
def test_blank_text_is_rejected(offline_producer, text):
    with pytest.raises(ValueError, match="empty or whitespace only"):
        offline_producer.submit(text, id="t1")


def test_text_over_the_byte_limit_is_rejected(offline_producer):
    assert offline_producer.validate("a" * 64, "ok") == ("ok", "a" * 64)
    with pytest.raises(ValueError, match=r"^oversize: text is 66 bytes, above TICKETQ_MAX_TICKET_BYTES=64$"):
        offline_producer.submit("é" * 33, id="t1")  # 33 characters, 66 bytes


def test_other_bad_input(offline_producer):
    with pytest.raises(ValueError, match="not valid UTF-8"):
        offline_producer.submit("lone \ud800 surrogate")
    with pytest.raises(TypeError, match="must be a str"):
        offline_producer.submit(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty string"):
        offline_producer.submit("fine", id="")
    with pytest.raises(ValueError, match="pack must be"):
        offline_producer.submit_many(["fine"], pack=0)
    with pytest.raises(ValueError, match=r"2 of 3 tickets are invalid, none sent: #1: .*empty.*#2: .*must be a str"):
        offline_producer.submit_many(["fine", {"id": "x", "text": " "}, {"text": None}])


def test_unreachable_broker_fails_fast_with_a_clear_error():
    started = time.monotonic()
    with Producer(ClientSettings(), broker_url=DEAD_URL) as producer, pytest.raises(BrokerUnavailable) as info:
        producer.submit("my invoice is wrong")
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert "redis://:**@127.0.0.1:1/0" in message
    assert "s3cret" not in message and "s3cret" not in repr(info.value)
    assert "TICKETQ_BROKER_URL" in message and "--broker-url" not in message  # no such option here
    assert isinstance(info.value, ConnectionError)
    assert mask_url("redis://user:pw@h:6379/0") == "redis://user:**@h:6379/0"


# --- mapping results back to tickets ---


def sent(ticket_ids, packed, task_id="task-1"):
    return SimpleNamespace(id=task_id, ticket_ids=tuple(ticket_ids), packed=packed)


def test_ticket_results_single_packed_and_failed():
    ok = {"id": "a", "status": "ok", "label": "billing"}
    assert ticket_results(sent(["a"], False), states.SUCCESS, ok) == [{**ok, "task_id": "task-1"}]

    rows = ticket_results(sent(["a", "b"], True), states.SUCCESS, [ok])
    assert rows[0] == {**ok, "task_id": "task-1"}
    assert rows[1] == {"id": "b", "task_id": "task-1", "status": "failed",
                       "error": "worker returned no result for this ticket"}

    failed = ticket_results(sent(["a", "b"], True), states.FAILURE, RuntimeError("model exploded"))
    assert [(r["id"], r["status"], r["error"]) for r in failed] == [
        ("a", "failed", "model exploded"), ("b", "failed", "model exploded")]

    odd = ticket_results(sent(["a"], True), states.SUCCESS, "not a list")
    assert odd[0]["status"] == "failed" and "unexpected result" in odd[0]["error"]


# --- the CLI without Redis (import hygiene: tests/test_contract.py) ---


def test_cli_reports_unusable_input_and_dead_broker(tmp_path):
    runner = CliRunner()
    assert runner.invoke(cli_app, ["--help"]).exit_code == 0
    missing = runner.invoke(cli_app, ["file", str(tmp_path / "nope.csv")])
    assert missing.exit_code == 2
    assert "cannot read ticket file" in missing.output
    dead = runner.invoke(cli_app, ["synthetic", "3", "--no-progress", "--broker-url", DEAD_URL])
    assert dead.exit_code == 2
    assert "Redis is not reachable" in dead.output and "s3cret" not in dead.output


# --- the real Redis: what lands in the queue, and collecting results ---


@pytest.fixture
def redis_db15():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def decode_message(raw: bytes) -> tuple[dict, list]:
    """A kombu Redis message: a JSON envelope whose body is the base64 Celery protocol-2 body."""
    envelope = json.loads(raw)
    assert envelope["content-type"] == "application/json"
    assert envelope["properties"]["body_encoding"] == "base64"
    args, kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
    assert kwargs == {}
    return envelope["headers"], args


# Celery's Redis backend (store_result, used here in the worker's place) still calls redis-py's setex.
@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_messages_on_the_wire(redis_db15):
    before = time.time()
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        single = producer.submit("my invoice is wrong", id="s1")
        failing = producer.submit("the API times out", id="s2")
        packs = producer.submit_many([{"id": "p1", "text": "reset my password"}, "no id", "crash 💥"], pack=2)
        queue = producer.settings.queue

        assert producer.queue_depth() == redis_db15.llen(queue) == 4
        keys = [producer.app.backend.get_key_for_task(r.id) for r in (single, failing, *packs)]
        assert [count for _, count in redis_db15.pubsub_numsub(*keys)] == [0] * 4, "no subscription per message"
        messages = [decode_message(raw) for raw in redis_db15.lrange(queue, 0, -1)]
        assert {headers["task"] for headers, _ in messages} == {TASK_CLASSIFY}
        assert not any("invoice" in json.dumps(headers) for headers, _ in messages), "no ticket text in headers"
        by_task = {headers["id"]: args for headers, args in messages}
        assert set(by_task) == {single.id, failing.id, packs[0].id, packs[1].id}

        [ticket] = by_task[single.id]
        assert set(ticket) == {"id", "text", "submitted_at"}
        assert ticket["id"] == "s1" and ticket["text"] == "my invoice is wrong"
        assert before <= ticket["submitted_at"] <= time.time()
        [first_pack] = by_task[packs[0].id]
        assert [t["id"] for t in first_pack] == list(packs[0].ticket_ids)
        assert packs[0].ticket_ids[0] == "p1"
        assert [t["text"] for t in first_pack] == ["reset my password", "no id"]
        [second_pack] = by_task[packs[1].id]
        assert isinstance(second_pack, list) and second_pack[0]["text"] == "crash 💥"

        # Play the worker: one result per single message, a list per packed one; leave one unanswered.
        backend = producer.app.backend
        backend.store_result(single.id, {"id": "s1", "status": "ok", "label": "billing"}, states.SUCCESS)
        backend.mark_as_failure(failing.id, RuntimeError("model exploded"))
        pack_ids = packs[0].ticket_ids
        backend.store_result(packs[0].id, [{"id": i, "status": "ok", "label": "account"} for i in pack_ids],
                             states.SUCCESS)
        collecting = []  # the cyclic collector is paused while results come in, restored after
        results = producer.wait([single, failing, *packs], timeout=1.0,
                                on_result=lambda tickets: collecting.append(gc.isenabled()))  # fmt: skip
        assert collecting == [False, False, False] and gc.isenabled()
        gc.disable()
        try:
            producer.wait([packs[1]], timeout=0.1)
            assert not gc.isenabled(), "a caller's own gc.disable() is kept"
        finally:
            gc.enable()

        assert [(r["id"], r["status"]) for r in results] == [
            ("s1", "ok"), ("s2", "failed"), ("p1", "ok"), (pack_ids[1], "ok"), (packs[1].ticket_ids[0], "timeout"),
        ]
        assert results[1]["error"] == "model exploded"
        assert all(r["task_id"] for r in results)

        redis_db15.xadd(RESULTS_STREAM, {"data": json.dumps({"id": "s1", "label": "billing"})})
        redis_db15.xadd(RESULTS_STREAM, {"data": json.dumps({"id": "p1", "label": "account"})})
        stream = list(producer.results_stream())
        assert [r["id"] for _, r in stream] == ["s1", "p1"]
        assert list(producer.results_stream(since_id=stream[0][0])) == stream[1:]


def test_wait_asks_an_unreachable_redis_again_until_its_timeout():
    """A lost connection is not the end of a wait: it asks again (with backoff) until its timeout."""
    with Producer(ClientSettings(), broker_url=DEAD_URL, connect_timeout_s=0.2) as producer:
        started = time.monotonic()
        [row] = producer.wait([producer.app.AsyncResult("never-answered")], timeout=0.6)
        took = time.monotonic() - started
    assert row["status"] == "timeout" and row["task_id"] == "never-answered"
    assert 0.6 <= took < 5


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_wait_reads_results_behind_a_head_that_never_comes(redis_db15):
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        sent = producer.submit_many([f"ticket {i}" for i in range(3 * POLL_WINDOW)])
        for result in sent[POLL_WINDOW:]:  # the oldest POLL_WINDOW never get a result
            producer.app.backend.store_result(result.id, {"id": result.ticket_ids[0], "status": "ok"}, states.SUCCESS)
        results = producer.wait(sent, timeout=0.5)
    assert Counter(row["status"] for row in results) == {"ok": 2 * POLL_WINDOW, "timeout": POLL_WINDOW}


@pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning")
def test_idempotent_sends_reuse_task_ids_and_skip_what_was_sent(redis_db15):
    tickets = [{"id": "k1", "text": "my invoice is wrong"}, {"id": "k2", "text": "reset my password"}, "no id"]
    with Producer(ClientSettings(), broker_url=REDIS_URL) as producer:
        queue = producer.settings.queue
        plain = [producer.submit("the same ticket", id="k0") for _ in range(2)]
        assert plain[0].id != plain[1].id, "submit is not idempotent unless asked"
        once = producer.submit("the same ticket", id="k0", idempotent=True)
        assert once.id == idempotent_task_id(queue, ["k0"], False)
        redis_db15.flushdb()

        first = producer.submit_many(tickets[:2], pack=2, idempotent=True)
        [(headers, args)] = [decode_message(raw) for raw in redis_db15.lrange(queue, 0, -1)]
        assert first[0].id == headers["id"] == idempotent_task_id(queue, ["k1", "k2"], True)
        sent_at = [ticket.pop("submitted_at") for ticket in args[0]]  # the send time: the worker compares without it
        assert all(isinstance(at, float) for at in sent_at)
        assert args == [[{"id": "k1", "text": tickets[0]["text"]}, {"id": "k2", "text": tickets[1]["text"]}]]
        assert idempotent_task_id(queue, ["k1"], False) != idempotent_task_id("other", ["k1"], False)

        producer.app.backend.store_result(first[0].id, [{"id": "k1", "status": "ok"}, {"id": "k2", "status": "ok"}],
                                          states.SUCCESS)  # fmt: skip
        again = producer.submit_many(tickets, pack=2, idempotent=True)
        assert [r.sent_before for r in again] == [True, False] and again[0].id == first[0].id
        assert redis_db15.llen(queue) == 2, "the answered message is not sent again"
        assert [row["status"] for row in producer.wait(again[:1], timeout=1)] == ["ok", "ok"]

        k3 = [{"id": "k3", "text": "the export button does nothing"}]
        [pending] = producer.submit_many(k3, idempotent=True)
        assert redis_db15.llen(queue) == 3
        [resumed] = producer.submit_many(k3, idempotent=True, already_sent=[pending.id])
        assert resumed.sent_before and resumed.id == pending.id and redis_db15.llen(queue) == 3
        # a ticket without an id gets a random one: sent again, it is another ticket
        assert producer.submit_many(tickets[2:], idempotent=True)[0].id != again[1].id
