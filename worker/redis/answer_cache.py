"""The answer cache in Redis (TICKETQ_ANSWER_CACHE_S, off by default): a re-sent duplicate costs a lookup.

Entries are `ticketq:answer:<digest>` strings (the answer's JSON, TTL TICKETQ_ANSWER_CACHE_S),
indexed by `ticketq:answers` (a sorted set by write time) so the cache never holds more than
TICKETQ_ANSWER_CACHE_ENTRIES: a write past the bound deletes the oldest (answer_cache.lua). Its
memory is at most that many answers (a few hundred bytes each, more for a schema's). The digest
is the service's (`worker.service.answer_cache`): the canonical text, the schema and the model.

Never in the way: a lookup or a write that Redis refuses (down, full) is skipped and logged once
per episode, and the tickets are computed as without a cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import redis

from ticketq.lua import script
from worker.redis.keys import ANSWER_KEY, ANSWERS_INDEX

log = logging.getLogger(__name__)

STORE = script(__package__, "answer_cache")


class AnswerCache:
    def __init__(self, client: redis.Redis, ttl_s: float, max_entries: int) -> None:
        self.redis, self.ttl_ms, self.max_entries = client, max(1, round(ttl_s * 1000)), max_entries
        self._failing = False  # a refusal was logged; the next success ends the episode

    def get_many(self, digests: Sequence[str]) -> list[bytes | None]:
        """The cached answer JSON for each digest (None: not cached, or the cache unreachable)."""
        if not digests:
            return []
        try:
            found = self.redis.mget([ANSWER_KEY.format(digest=d) for d in digests])
        except redis.RedisError as exc:
            self._refused("read", exc)
            return [None] * len(digests)
        self._failing = False
        return found

    def put_many(self, answers: Mapping[str, bytes]) -> int:
        """Cache each digest's answer JSON (one script call); the entries evicted by the bound."""
        if not answers:
            return 0
        args = [item for digest, data in answers.items() for item in (ANSWER_KEY.format(digest=digest), data)]
        try:
            evicted = self.redis.eval(STORE, 1, ANSWERS_INDEX, self.ttl_ms, self.max_entries,
                                      int(time.time() * 1000), *args)  # fmt: skip
        except redis.RedisError as exc:
            self._refused("write", exc)
            return 0
        self._failing = False
        return int(evicted)

    def _refused(self, what: str, exc: Exception) -> None:
        if not self._failing:
            log.warning("answer cache: Redis refused a %s (%s); computing without it until it answers", what, exc)
        self._failing = True
