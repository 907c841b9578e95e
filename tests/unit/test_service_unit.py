"""The service's pipeline without Redis: `TicketService` on the in-memory outbox
(`worker.service.memory.MemoryOutbox`) with the null classifier or a scripted one.

The same input cases as the service's integration tests (tests/integration/test_service.py: packed messages,
bad input, the shadow check, the metrics a run leaves), and what those can only reach through
crashes and restarts: redeliveries run alone and are dead-lettered past max_retries, the engine
retry, re-executions, reused task ids, expiry, schema routing, and the order hooks are called in.
The integration tests keep checking the same behaviour on a real Redis and real workers.
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from worker.engine.batching import Batch, Plan
from worker.health import Progress
from worker.metrics import Metrics
from worker.nullclassifier import NullClassifier
from worker.redis.outbox import Outbox as RedisOutbox
from worker.service.core import TicketService
from worker.service.hooks import Hook
from worker.service.hooks.standard import standard_hooks
from worker.service.memory import MemoryOutbox
from worker.service.ports import Classifier as ClassifierPort
from worker.service.ports import Outbox as OutboxPort
from worker.settings import Settings

LABELS = ("billing", "technical", "account")
MAX_TICKET_BYTES = 1024
NO_REDIS = "redis://127.0.0.1:1/0"  # nothing listens there: a service that reached for Redis would fail
_ids = itertools.count()


def request(payload=None, *, args: tuple | None = None, task_id: str | None = None, expires: str | None = None):
    """What the service needs of a Celery request: an id, the arguments, the headers."""
    return SimpleNamespace(id=task_id or f"task-{next(_ids)}", args=(payload,) if args is None else args,
                           request_dict={"expires": expires} if expires else {})  # fmt: skip


def ticket(n: int, tag: str = "t") -> dict:
    return {"id": f"{tag}-{n}", "text": f"{tag} ticket {n}: my invoice is wrong", "submitted_at": 1.0}


class Run:
    """A service on a fresh outbox and registry; `value` reads a metric."""

    def __init__(self, classifier=None, hooks: Sequence[Hook] = (), outbox: MemoryOutbox | None = None,
                 **settings) -> None:  # fmt: skip
        self.settings = Settings(broker_url=NO_REDIS, metrics_port=0, max_retries=1, max_ticket_bytes=MAX_TICKET_BYTES,
                                 **settings)  # fmt: skip
        self.classifier = classifier or NullClassifier(LABELS)
        self.outbox, self.metrics = outbox or MemoryOutbox(), Metrics(CollectorRegistry())
        attached = [*standard_hooks(self.settings, self.classifier, self.metrics, Progress()), *hooks]
        self.service = TicketService(self.settings, self.classifier, self.outbox, attached)

    def process(self, *requests, feed=None) -> None:
        self.service.process(list(requests), None, feed)

    def stream(self, task_id: str) -> list[dict]:
        return [result for result in self.outbox.results if result["task_id"] == task_id]

    def letters(self, task_id: str) -> list[dict]:
        return [entry for entry in self.outbox.dead_letters if entry["task_id"] == task_id]

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def per_queue(self, name: str, **labels: str) -> float | None:
        """A metric of the series labelled with this worker's queue."""
        return self.value(name, queue=self.metrics.queue, **labels)


class Scripted(NullClassifier):
    """The null classifier, recording each forward's texts; a forward holding a text `fail` picks raises."""

    def __init__(self, fail=lambda text: False) -> None:
        super().__init__(LABELS)
        self.fail, self.calls = fail, []

    def forward_batch(self, tickets, width=None):
        self.calls.append(list(tickets))
        if any(self.fail(text) for text in tickets):
            raise RuntimeError("scripted engine fault")
        return super().forward_batch(tickets, width)


# --------------------------------------------------------------------------------------------
# the in-memory outbox stands for worker.redis.outbox.Outbox


def test_the_memory_outbox_has_every_method_the_service_uses_as_the_redis_one_does():
    methods = [name for name, _ in inspect.getmembers(OutboxPort, inspect.isfunction) if not name.startswith("_")]
    assert len(methods) == 10
    for name in methods:
        wanted = list(inspect.signature(getattr(OutboxPort, name)).parameters)
        for outbox in (MemoryOutbox, RedisOutbox):
            assert list(inspect.signature(getattr(outbox, name)).parameters) == wanted, (outbox, name)


def test_the_null_classifier_implements_the_whole_classifier_port():
    wanted = set()
    for port in ClassifierPort.__mro__:
        if port.__module__.startswith("worker."):  # the port and the BatchEngine it extends
            wanted |= {name for name in vars(port) if not name.startswith("_")} | set(port.__annotations__)
    assert {"forward_batch", "plan", "encode", "deferred", "info", "schema", "dedup", "cost"} <= wanted
    null = NullClassifier(LABELS)
    assert [name for name in sorted(wanted) if not hasattr(null, name)] == []


def test_no_getattr_reads_a_port_member_in_the_service_or_the_scheduler():
    """The service and the scheduler read their ports through declared members only (Celery's
    requests, which are not ports, may lack `request_dict` or `ignore_result`)."""
    root = Path(__file__).resolve().parents[2]
    sources = [*sorted((root / "worker" / "service").rglob("*.py")), root / "worker" / "engine" / "scheduler.py"]
    reads = [(path.name, call) for path in sources for call in re.findall(r"getattr\((\w+)", path.read_text())]
    assert {name for _, name in reads} <= {"request"}, reads


# --------------------------------------------------------------------------------------------
# what the integration tests check on real workers, here in process


def test_packed_messages_give_one_result_per_ticket():
    run = Run()
    tickets = [ticket(n, "pack") for n in range(120)]
    packs = [request(tickets[i:i + 50]) for i in range(0, 120, 50)]
    run.process(*packs)
    for pack, size in zip(packs, (50, 50, 20), strict=True):
        state, rows = run.outbox.stored[pack.id]
        assert state == "SUCCESS" and [row["id"] for row in rows] == [t["id"] for t in pack.args[0]]
        assert len(rows) == size and [r["id"] for r in run.stream(pack.id)] == [row["id"] for row in rows]
    assert run.per_queue("ticketq_tickets_total", label=LABELS[0], outcome="ok") is not None
    assert sum(run.per_queue("ticketq_tickets_total", label=label, outcome="ok") or 0 for label in LABELS) == 120


def test_a_bad_ticket_inside_a_pack_fails_alone():
    run = Run()
    good = [ticket(n, "inpack") for n in range(4)]
    bad = {"id": "bad-in-pack", "text": 12345}
    pack = request([*good[:2], bad, *good[2:]])
    run.process(pack)
    state, rows = run.outbox.stored[pack.id]
    assert state == "SUCCESS" and [row["status"] for row in rows] == ["ok", "ok", "failed", "ok", "ok"]
    assert rows[2]["id"] == "bad-in-pack" and rows[2]["reason"] == "wrong_type"
    (letter,) = run.letters(pack.id)
    assert letter["slot"] == "2" and letter["reason"] == "wrong_type" and json.loads(letter["payload"]) == bad


BAD_INPUTS = {
    "missing_text": ((({"id": "m1"}),), "missing_field"),
    "text_not_a_string": (({"id": "m2", "text": ["not", "a", "string"]},), "wrong_type"),
    "empty_text": (({"id": "m3", "text": ""},), "empty_text"),
    "whitespace_text": (({"id": "m4", "text": " \n\t "},), "empty_text"),
    "oversize_text": (({"id": "m5", "text": "x" * (MAX_TICKET_BYTES + 1)},), "oversize"),
    "bad_id_type": (({"id": {"nested": 1}, "text": "my invoice is wrong"},), "wrong_type"),
    "lone_surrogate": (({"id": "m7", "text": "broken \udcff byte"},), "invalid_utf8"),
    "payload_not_an_object": (("just a string",), "bad_payload"),
    "payload_a_number": ((42,), "bad_payload"),
    "two_arguments": (({"text": "a"}, {"text": "b"}), "bad_payload"),
    "no_arguments": ((), "bad_payload"),
    "arguments_not_a_list": ("a hand-built message", "bad_payload"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_with_its_reason_and_a_dead_letter_and_spares_its_neighbours(case):
    args, reason = BAD_INPUTS[case]
    run = Run()
    before, after = request(ticket(0, case)), request(ticket(1, case))
    bad = request(args=args)
    run.process(before, bad, after)
    state, error = run.outbox.stored[bad.id]
    assert state == "FAILURE" and error.reason == reason, error
    (letter,) = run.letters(bad.id)
    assert letter["reason"] == reason and letter["error"].startswith(f"{reason}: ")
    (entry,) = run.stream(bad.id)
    assert entry["status"] == "failed" and entry["reason"] == reason
    assert [run.outbox.stored[r.id][0] for r in (before, after)] == ["SUCCESS", "SUCCESS"]
    assert not run.letters(before.id) and not run.letters(after.id)
    assert run.per_queue("ticketq_dead_letters_total", reason=reason) == 1


def test_the_shadow_check_sees_every_answer_and_agrees():
    run = Run(shadow_rate=1.0)
    run.process(*(request(ticket(n, "shadow")) for n in range(30)))
    (shadow,) = [hook for hook in run.service.hooks.hooks if type(hook).__name__ == "ShadowHook"]
    shadow.checker.join()
    assert run.value("ticketq_shadow_checked_total") + run.value("ticketq_shadow_dropped_total") == 30
    assert run.value("ticketq_shadow_agreed_total") == run.value("ticketq_shadow_checked_total")


def test_a_run_leaves_its_metrics():
    run = Run()
    run.process(*(request(ticket(n, "metrics")) for n in range(20)))
    assert run.value("ticketq_flushes_total") == 1
    assert run.per_queue("ticketq_latency_seconds_count") == 20
    assert run.value("ticketq_batch_size_sum") == 20
    assert run.value("ticketq_time_to_first_result_seconds_count") == 1


# --------------------------------------------------------------------------------------------
# redeliveries, retries, repeats


def test_a_redelivered_message_runs_alone_after_the_fresh_ones_and_is_dead_lettered_past_max_retries():
    classifier = Scripted()
    run = Run(classifier)
    crashed = request(ticket(0, "crash"))
    run.outbox.count_deliveries([crashed.id])  # its first delivery's batch never finished
    fresh = [request(ticket(n, "fresh")) for n in range(1, 4)]
    run.process(crashed, *fresh)
    assert classifier.calls == [[r.args[0]["text"] for r in fresh], [crashed.args[0]["text"]]]
    assert run.outbox.stored[crashed.id][0] == "SUCCESS"

    again = request(ticket(9, "again"))
    run.outbox.count_deliveries([again.id, again.id])  # delivered twice, unfinished: max_retries is 1
    run.process(again)
    state, error = run.outbox.stored[again.id]
    assert state == "FAILURE" and error.reason == "too_many_deliveries"
    assert [letter["reason"] for letter in run.letters(again.id)] == ["too_many_deliveries"]


def test_an_engine_error_is_retried_in_halves_and_the_bad_ticket_dead_lettered_alone():
    poison = "poison"
    classifier = Scripted(fail=lambda text: poison in text)
    run = Run(classifier)
    requests = [request(ticket(n, "retry")) for n in range(7)] + [request({"id": "p", "text": f"{poison} pill"})]
    run.process(*requests)
    assert [run.outbox.stored[r.id][0] for r in requests] == ["SUCCESS"] * 7 + ["FAILURE"]
    (letter,) = run.letters(requests[-1].id)
    assert letter["reason"] == "engine_error" and "after 2 attempts" in letter["error"]
    assert len(classifier.calls) <= 2 * 3 + 1 + 1, "halves down to the bad ticket, then max_retries alone"


def test_an_engine_error_retries_only_the_forward_that_failed():
    """The halves retry applies to one failed forward: the job's other forwards run once each."""

    class Pairs(Scripted):  # two tickets a forward, in order
        def plan(self, encoded):
            lengths = [len(text) // 4 + 1 for text in encoded]
            return Plan(tuple(Batch(tuple(range(i, min(i + 2, len(encoded)))), tuple(lengths[i:i + 2]),
                                    max(lengths[i:i + 2])) for i in range(0, len(encoded), 2)))  # fmt: skip

    poison = "poison"
    classifier = Pairs(fail=lambda text: poison in text)
    run = Run(classifier)
    tickets = [ticket(n, "pairs") for n in range(6)]
    tickets[3]["text"] = f"{poison} pill"
    requests = [request(t) for t in tickets]
    run.process(*requests)
    assert [run.outbox.stored[r.id][0] for r in requests] == ["SUCCESS"] * 3 + ["FAILURE"] + ["SUCCESS"] * 2
    texts = [t["text"] for t in tickets]
    computed = [text for call in classifier.calls for text in call]
    assert [computed.count(text) for text in texts] == [1, 1, 2, 3, 1, 1], "the failed pair alone, then the pill"
    assert [letter["reason"] for letter in run.letters(requests[3].id)] == ["engine_error"]


def test_a_re_execution_publishes_nothing_twice_and_a_reused_task_id_is_answered():
    run = Run()
    first = ticket(0, "twice")
    run.process(request(first, task_id="twice"))
    run.process(request(dict(first), task_id="twice"))
    assert len(run.stream("twice")) == 1 and run.value("ticketq_duplicate_results_total") == 1
    run.process(request(ticket(1, "other"), task_id="twice"))
    assert [(r["id"], r["status"], r.get("reason")) for r in run.stream("twice")] == [
        ("twice-0", "ok", None), ("other-1", "failed", "duplicate_task_id")]  # fmt: skip
    assert [letter["reason"] for letter in run.letters("twice")] == ["duplicate_task_id"]
    assert run.outbox.stored["twice"][1]["id"] == "twice-0", "the first answer is kept"


def test_an_expired_message_is_answered_without_being_computed():
    classifier = Scripted()
    run = Run(classifier)
    past = (datetime.now(timezone.utc) - timedelta(seconds=5)).isoformat()
    late, timely = request(ticket(0, "late"), expires=past), request(ticket(1, "timely"))
    run.process(late, timely)
    assert classifier.calls == [[timely.args[0]["text"]]]
    assert run.stream(late.id)[0]["reason"] == "expired" and not run.letters(late.id)
    assert run.per_queue("ticketq_tickets_total", label="none", outcome="expired") == 1


def test_a_ticket_naming_a_schema_not_served_is_refused():
    run = Run()
    bad = request({"id": "s", "text": "refund please", "schema": "nope"})
    run.process(bad)
    assert run.outbox.stored[bad.id][1].reason == "unknown_schema"


# --------------------------------------------------------------------------------------------
# hooks


class Recording(Hook):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_job_start(self) -> None:
        self.calls.append("start")

    def on_job_end(self) -> None:
        self.calls.append("end")

    def on_forward(self, report) -> None:
        self.calls.append(f"forward {report.rows}")

    def on_answer(self, slot, answer) -> None:
        self.calls.append("answer")

    def on_results(self, slots) -> None:
        self.calls.append(f"results {len(slots)}")

    def on_dead_letter(self, entry, rejection) -> None:
        self.calls.append(f"dead {rejection.reason}")


def test_hooks_hear_the_job_its_forwards_answers_results_and_dead_letters_in_order():
    recording = Recording()
    run = Run(hooks=[recording])
    run.process(request(ticket(0)), request({"id": "x"}), request(ticket(1)))
    assert recording.calls == ["start", "dead missing_field", "results 1", "forward 2", "answer", "answer",
                               "results 2", "end"]  # fmt: skip


def test_a_hook_that_raises_is_logged_and_counted_and_the_job_carries_on(caplog):
    class Broken(Hook):
        def on_answer(self, slot, answer) -> None:
            raise RuntimeError("a hook that breaks")

    recording = Recording()
    run = Run(hooks=[Broken(), recording])
    requests = [request(ticket(n, "broken")) for n in range(3)]
    run.process(*requests)
    assert recording.calls[-1] == "end" and recording.calls.count("answer") == 3  # the hooks after it still hear
    assert {run.outbox.stored[r.id][0] for r in requests} == {"SUCCESS"} and not run.outbox.dead_letters
    assert run.service.hooks.errors == {("Broken", "on_answer"): 3} and run.service.hooks.error_count == 3
    assert "hook Broken failed in on_answer" in caplog.text

    metrics = Metrics()
    metrics.watch_hook_errors(lambda: run.service.hooks.errors)
    value = metrics.registry.get_sample_value("ticketq_hook_errors_total", {"hook": "Broken", "point": "on_answer"})
    assert value == 3, "exported on /metrics"


def test_a_failing_job_still_ends_and_fails_what_it_left_open():
    class Broken(MemoryOutbox):
        def count_deliveries(self, task_ids):
            raise RuntimeError("a bug outside the engine")

    recording = Recording()
    run = Run(hooks=[recording], outbox=Broken())
    requests = [request(ticket(n, "broken")) for n in range(3)]
    run.process(*requests)
    assert recording.calls[-1] == "end"
    assert {run.outbox.stored[r.id][0] for r in requests} == {"FAILURE"}
    assert {letter["reason"] for letter in run.outbox.dead_letters} == {"worker_error"}
