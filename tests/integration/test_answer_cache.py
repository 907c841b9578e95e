"""The answer cache's store on a real Redis (`worker.redis.answer_cache`): entries expire with their
TTL, the cache never holds more than its bound (the oldest go first), and a Redis that refuses is
skipped, never in the way. The worker-level hit is in test_checked_worker.py."""

from __future__ import annotations

import time
import uuid

import pytest
from workers import RedisServer, redis_or_skip

from worker.redis.answer_cache import AnswerCache
from worker.redis.keys import ANSWER_KEY, ANSWERS_INDEX

pytestmark = pytest.mark.integration


@pytest.fixture
def client():
    client = redis_or_skip("redis://127.0.0.1:6379/5")
    client.delete(ANSWERS_INDEX)
    yield client
    for key in client.zrange(ANSWERS_INDEX, 0, -1):
        client.delete(key)
    client.delete(ANSWERS_INDEX)
    client.close()


def test_entries_come_back_and_expire_with_their_ttl(client):
    cache = AnswerCache(client, ttl_s=0.5, max_entries=100)
    digest = uuid.uuid4().hex
    cache.put_many({digest: b'{"label": "billing"}'})
    assert cache.get_many([digest, "absent"]) == [b'{"label": "billing"}', None]
    assert 0 < client.pttl(ANSWER_KEY.format(digest=digest)) <= 500
    time.sleep(0.6)
    assert cache.get_many([digest]) == [None]
    cache.put_many({uuid.uuid4().hex: b"{}"})  # the next write drops the expired one from the index
    assert client.zcard(ANSWERS_INDEX) == 1


def test_the_cache_never_holds_more_than_its_bound_and_the_oldest_go_first(client):
    cache = AnswerCache(client, ttl_s=60, max_entries=50)
    digests = [f"d{i:04d}" for i in range(130)]
    evicted = 0
    for start in range(0, len(digests), 20):  # a forward's answers at a time
        evicted += cache.put_many({d: d.encode() for d in digests[start : start + 20]})
        time.sleep(0.002)  # write times in order
    assert evicted == 80 and client.zcard(ANSWERS_INDEX) == 50
    found = cache.get_many(digests)
    assert found[:80] == [None] * 80 and found[80:] == [d.encode() for d in digests[80:]]


def test_a_redis_that_refuses_costs_a_miss_not_an_error(tmp_path, caplog):
    server = RedisServer(tmp_path, aof=False).start()
    try:
        cache = AnswerCache(server.client(), ttl_s=60, max_entries=10)
        server.client().config_set("maxmemory", "1")  # full: every write refused (noeviction)
        assert cache.put_many({"a": b"1"}) == 0
        assert cache.put_many({"b": b"2"}) == 0
        assert caplog.text.count("answer cache: Redis refused") == 1  # once per episode
        server.kill()
        assert cache.get_many(["a"]) == [None]
    finally:
        server.stop()
