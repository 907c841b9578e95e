"""Producer tests: synthetic data, ticket files, validation at the edge, results mapped to tickets.

Everything here runs without Redis and without a worker (the broker URL is a dead port); the
message on the wire, against the real Redis: tests/integration/test_producer_wire.py.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from types import SimpleNamespace

import pytest
from celery import states
from typer.testing import CliRunner

from producer.api import Producer
from producer.cli import app as cli_app
from producer.errors import BrokerUnavailable
from producer.messages import ticket_results
from producer.resultfile import write_results
from producer.synthetic import awkward_texts, generate_tickets
from producer.ticketfile import read_tickets
from producer.ticketrows import TicketFileError
from ticketq.config import ClientSettings, mask_url

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


# --- the CLI without Redis (import hygiene: tests/unit/test_contract.py) ---


def test_cli_reports_unusable_input_and_dead_broker(tmp_path):
    runner = CliRunner()
    assert runner.invoke(cli_app, ["--help"]).exit_code == 0
    missing = runner.invoke(cli_app, ["file", str(tmp_path / "nope.csv")])
    assert missing.exit_code == 2
    assert "cannot read ticket file" in missing.output
    dead = runner.invoke(cli_app, ["synthetic", "3", "--no-progress", "--retry-for", "0", "--broker-url", DEAD_URL])
    assert dead.exit_code == 2
    assert "Redis is not reachable" in dead.output and "s3cret" not in dead.output


# --- waiting on a Redis that is gone ---


def test_wait_asks_an_unreachable_redis_again_until_its_timeout():
    """A lost connection is not the end of a wait: it asks again (with backoff) until its timeout."""
    with Producer(ClientSettings(), broker_url=DEAD_URL, connect_timeout_s=0.2) as producer:
        started = time.monotonic()
        [row] = producer.wait([producer.app.AsyncResult("never-answered")], timeout=0.6)
        took = time.monotonic() - started
    assert row["status"] == "timeout" and row["task_id"] == "never-answered"
    assert 0.6 <= took < 5


class _ResultsInMemory:
    """What `poll_ready` reads of a Redis result backend (`mget` of result keys), over a dict that
    a `finish` callback fills between reads."""

    def __init__(self, finish) -> None:
        self.stored: dict[str, bytes] = {}
        self.reads = 0
        self.finish = finish

    def get_key_for_task(self, task_id: str) -> str:
        return f"celery-task-meta-{task_id}"

    def mget(self, keys: list[str]) -> list[bytes | None]:
        self.reads += 1
        self.finish(self.reads, self.stored)
        return [self.stored.get(key) for key in keys]

    def decode_result(self, raw: bytes) -> dict:
        return json.loads(raw)


def test_poll_ready_reports_each_result_once_however_the_windows_move():
    """The oldest window finishing while the rotating one stood further on moved the rotating
    window into the oldest: one MGET read some keys twice and a result was reported twice."""
    from types import SimpleNamespace

    from producer.backend import POLL_WINDOW, poll_ready

    n = 3 * POLL_WINDOW
    ids = [f"t-{i}" for i in range(n)]
    done = json.dumps({"status": "SUCCESS", "result": "x"}).encode()

    def finish(read: int, stored: dict) -> None:
        # reads 1-3 find nothing (the rotating window goes round); 4 and 5 find most of the oldest
        # window, 6 nothing (the rotating window starts again, from where it stood); 7 finds all
        half = POLL_WINDOW // 2
        batches = {4: ids[:half], 5: ids[half: POLL_WINDOW + half // 2], 7: ids}
        for task_id in batches.get(read, []):
            stored[f"celery-task-meta-{task_id}"] = done

    backend = _ResultsInMemory(finish)
    seen = [task_id for task_id, _, _ in poll_ready(backend, [SimpleNamespace(id=i) for i in ids], timeout=60)]
    assert sorted(seen) == sorted(ids) and len(seen) == len(set(seen)), Counter(seen).most_common(3)
