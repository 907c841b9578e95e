"""Each message's delivery count (its attempts key) and, read with it, the epoch marker: whether
Redis still holds its data. The outbox (`worker.redis.outbox.Outbox`) builds on it; keys and their
meaning: worker.redis.keys."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import redis

from ticketq.epoch import Epoch, Loss, whoami
from ticketq.lua import script
from ticketq.names import ATTEMPTS_KEY, EPOCH_KEY
from worker.health import Health
from worker.redis.writes import Writes

log = logging.getLogger(__name__)

COUNT_DELIVERIES = script(__package__, "count_deliveries")  # INCR + EXPIRE of each message's attempts key


class Attempts(Writes):
    """How often each message was delivered while unfinished, and the epoch check each job's first read carries."""

    def __init__(self, client: redis.Redis, health: Health, result_expires_s: int, worst_batch_s: float,
                 replica_acks: int = 0, replica_timeout_s: float = 1.0) -> None:  # fmt: skip
        """`health`: the process's (its refusals ride writes out, its data loss counts a lost epoch);
        `result_expires_s`: how long an attempts key lives (as long as a result)."""
        super().__init__(client, health.refusals, worst_batch_s, replica_acks, replica_timeout_s)
        self.data_loss = health.data_loss
        self.result_expires_s = result_expires_s
        self.epoch = Epoch(whoami("worker"))

    def attempts(self, task_ids: Sequence[str]) -> list[int | None]:
        """The delivery count of each message, None for a first delivery (one MGET, which reads the
        epoch marker too: every job checks that Redis still holds its data, at no extra round trip)."""
        if not task_ids:
            return []
        keys = [ATTEMPTS_KEY.format(task_id=task_id) for task_id in task_ids]
        *counts, marker = self.retrying(lambda: self.redis.mget([*keys, EPOCH_KEY]), write=False)
        self.judge_epoch(marker)
        return [None if count is None else int(count) for count in counts]

    def judge_epoch(self, marker: bytes | None) -> Loss | None:
        """Judge the epoch marker as just read (`ticketq.epoch.Epoch.seen`); a loss is logged and
        counted once (`Health.data_loss`). A Redis that refuses the fresh marker (full) or is cut off is
        judged again at the next check."""
        try:
            loss = self.epoch.seen(self.redis, marker)
        except redis.RedisError as exc:
            log.debug("epoch marker not checked (%s); checked again with the next job", exc)
            return None
        if loss is not None:
            self.data_loss.noticed(loss)
        return loss

    def count_deliveries(self, task_ids: Sequence[str]) -> int:
        """INCR each message's attempts key (with its expiry) in one script call; the first one's new count."""
        keys = [ATTEMPTS_KEY.format(task_id=task_id) for task_id in task_ids]
        return int(self.retrying(lambda: self.redis.eval(COUNT_DELIVERIES, len(keys), *keys, self.result_expires_s))[0])
