"""The answer cache's stage (`worker.service.answer_cache`) in the service, without Redis: a dict
stands for `worker.redis.answer_cache.AnswerCache` (its two calls); the store itself, its bound and
its TTL are tested on a real Redis (tests/integration/test_answer_cache.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from test_service_unit import NO_REDIS, Scripted, request, ticket

from ticketq.schema import Field, FieldResult, TicketFields
from worker.health import Progress
from worker.metrics import Metrics
from worker.results import Prediction
from worker.service.answer_cache import decode, encode
from worker.service.core import TicketService
from worker.service.hooks.standard import standard_hooks
from worker.service.memory import MemoryOutbox
from worker.settings import Settings


class DictCache:
    """AnswerCache's interface over a dict."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}

    def get_many(self, digests):
        return [self.entries.get(d) for d in digests]

    def put_many(self, answers):
        self.entries.update(answers)
        return 0


def service(cache, **settings):
    settings = Settings(broker_url=NO_REDIS, metrics_port=0, **settings)
    classifier, metrics = Scripted(), Metrics(CollectorRegistry())
    hooks = standard_hooks(settings, classifier, metrics, Progress())
    return TicketService(settings, classifier, MemoryOutbox(), hooks, cache=cache), classifier, metrics


def test_a_resent_ticket_is_answered_from_the_cache_not_computed():
    cache = DictCache()
    svc, classifier, metrics = service(cache)
    first = [ticket(n, "c") for n in range(5)]
    svc.process([request(t) for t in first], None)
    assert len(cache.entries) == 5 and sum(map(len, classifier.calls)) == 5
    again = [{**t, "id": f"again-{t['id']}", "text": f"  {t['text']}\n"} for t in first]  # canonical text: the same
    svc.process([request(t) for t in again] + [request(ticket(9, "new"))], None)
    assert classifier.calls[-1] == [ticket(9, "new")["text"]]  # only the new ticket was computed
    results = {r["id"]: r for r in svc.outbox.results}
    for old, new in zip(first, again, strict=True):
        assert results[new["id"]]["label"] == results[old["id"]]["label"]
    assert metrics.registry.get_sample_value("ticketq_answer_cache_lookups_total", {"result": "hit"}) == 5
    assert metrics.registry.get_sample_value("ticketq_answer_cache_lookups_total", {"result": "miss"}) == 6


def test_another_model_or_label_set_never_shares_an_entry():
    cache = DictCache()
    svc, _, _ = service(cache)
    svc.process([request(ticket(1, "x"))], None)
    other, classifier, _ = service(cache, labels="billing,technical,sales")
    other.process([request(ticket(1, "x"))], None)
    assert classifier.calls and len(cache.entries) == 2


def test_answers_come_back_as_they_went_in():
    prediction = Prediction("billing", {"billing": 0.7, "technical": 0.3}, 0.4, False, 12, "int8", False)
    assert decode(encode(prediction)) == prediction
    spec = Field("tags", ("refund", "outage"), multi=True)
    fields = TicketFields("s", {"tags": FieldResult.several(spec, {"refund": 0.9, "outage": 0.2})}, 3, 3, None,
                          precision="float32", rechecked=True)  # fmt: skip
    assert decode(encode(fields)) == fields


def test_without_a_cache_nothing_is_looked_up():
    svc, classifier, metrics = service(None)
    svc.process([request(ticket(1, "n"))], None)
    svc.process([request({**ticket(1, "n"), "id": "again"})], None)
    assert len(classifier.calls) == 2 and svc.cached is None
    for result in ("hit", "miss"):  # never counted (the worker pre-creates both series at 0)
        assert not metrics.registry.get_sample_value("ticketq_answer_cache_lookups_total", {"result": result})
