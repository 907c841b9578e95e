"""The operator's writes (ticketq_cli.dead_letters: `ticketq dead requeue` and its bookkeeping): what a
requeue clears and keeps of a message's publish-once marks, and the requeue records of dead letters.
Keys: worker.redis.keys."""

from __future__ import annotations

import redis

from ticketq.names import ATTEMPTS_KEY, DEAD_LETTER_STREAM
from worker.redis.keys import DIGEST_KEY, DONE_KEY, FAILED_KEY, REQUEUED_KEY


def forget_message(client: redis.Redis, task_id: str, digest: bool = True) -> None:
    """Drop a message's attempts key (or its redelivery would be refused), and with `digest` the
    hash of its arguments (a requeue re-sends one ticket of them under the same id). Its done bits
    stay: what was streamed is never streamed again, except as `keep_failure` allows."""
    keys = [ATTEMPTS_KEY.format(task_id=task_id)]
    if digest:
        keys.append(DIGEST_KEY.format(task_id=task_id))
    client.delete(*keys)


def keep_failure(client: redis.Redis, task_id: str, slot: int, reason: str, expires_s: int) -> None:
    """Mark (task, slot) as having streamed a failure for `reason` (its done bit, and the reason in
    its failed key), before a requeue re-sends it: the same failure again is a repeat, not a second
    stream entry; an answer or another failure is streamed once (`Outbox.publish`)."""
    done, failed = DONE_KEY.format(task_id=task_id), FAILED_KEY.format(task_id=task_id)
    pipe = client.pipeline(transaction=True)
    pipe.setbit(done, slot, 1)
    pipe.expire(done, expires_s)
    pipe.hset(failed, str(slot), reason)
    pipe.expire(failed, expires_s)
    pipe.execute()


def done_count(client: redis.Redis, task_id: str) -> int:
    """How many of a message's tickets have a result in the stream (its publish-once marks)."""
    return int(client.bitcount(DONE_KEY.format(task_id=task_id)))


def mark_requeued(client: redis.Redis, entry_id: str, task_id: str) -> None:
    """Remember that a dead letter was re-sent as `task_id`; it stays until that task is answered."""
    client.hset(REQUEUED_KEY, entry_id, task_id)


def requeued(client: redis.Redis) -> dict[str, str]:
    """Dead-letter entry id -> the task id it was re-sent as, for entries awaiting that answer."""
    return {k.decode(): v.decode() for k, v in client.hgetall(REQUEUED_KEY).items()}


def drop_dead_letter(client: redis.Redis, entry_id: str) -> None:
    """Remove one dead-letter entry (its re-sent message is answered) and its requeue record."""
    pipe = client.pipeline(transaction=True)
    pipe.xdel(DEAD_LETTER_STREAM, entry_id)
    pipe.hdel(REQUEUED_KEY, entry_id)
    pipe.execute()
