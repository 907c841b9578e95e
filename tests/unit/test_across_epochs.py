"""A results-stream reader across a data loss (`ticketq.epoch.AcrossEpochs`): a ticket answered in
an earlier epoch and again in a later one is yielded once; nothing is filtered within an epoch."""

from __future__ import annotations

from ticketq.epoch import AcrossEpochs, marker_id


def result(task: str, ticket: str) -> dict:
    return {"task_id": task, "id": ticket, "status": "ok"}


def test_a_ticket_answered_in_an_earlier_epoch_is_a_repeat_after_the_loss():
    guard = AcrossEpochs(window=1000)
    before = [result(f"t{n}", f"k{n}") for n in range(5)]
    assert [guard.repeat(b"A", r) for r in before] == [False] * 5
    after = [result("t1", "k1"), result("t3", "k3"), result("t9", "k9")]
    assert [guard.repeat(b"B", r) for r in after] == [True, True, False]
    assert guard.skipped == 2
    assert not guard.repeat(b"B", result("t1", "k2")), "another ticket of the same task is its own result"
    assert guard.repeat(b"C", result("t9", "k9")), "every earlier epoch counts, not only the last"


def test_nothing_is_filtered_within_an_epoch_or_without_the_field():
    guard = AcrossEpochs(window=1000)
    assert not guard.repeat(b"A", result("t1", "k1"))
    assert not guard.repeat(b"A", result("t1", "k1")), "within an epoch publish-once rules, not the reader"
    assert not guard.repeat(None, result("t2", "k2")), "an entry without the field: the current epoch's"
    assert guard.repeat(b"B", result("t2", "k2"))


def test_the_memory_is_bounded_by_the_window():
    guard = AcrossEpochs(window=3)
    for n in range(5):
        guard.repeat(b"A", result(f"t{n}", f"k{n}"))
    assert len(guard.order) == 3 and len(guard.current) == 3
    assert not guard.repeat(b"B", result("t0", "k0")), "forgotten: older than the window"
    assert guard.repeat(b"B", result("t4", "k4"))


def test_the_marker_id():
    assert marker_id(b'{"id": "abc", "since": 1.0, "by": "worker h:1"}') == "abc"
    assert marker_id(None) is None and marker_id(b"not json") is None
