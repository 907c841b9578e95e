"""What a producer reads on the broker besides its own results: the results stream (every
worker's answers, `Producer.results_stream`) and the queue's depth (`Producer.queue_depth`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis

from producer.errors import BrokerUnavailable
from ticketq import codec
from ticketq.epoch import AcrossEpochs
from ticketq.names import RESULTS_STREAM, queue_lists

log = logging.getLogger(__name__)


def results_stream(client: redis.Redis, url: str, since_id: str, follow: bool,
                   epochs: AcrossEpochs) -> Iterator[tuple[str, dict]]:  # fmt: skip
    """`(entry_id, result)` after `since_id`; with `follow`, new entries forever; a ticket `epochs`
    saw yielded before a data loss is not yielded again after it. `BrokerUnavailable` names `url`
    when Redis fails."""
    last = since_id
    while True:
        try:
            # Block in short reads: each must finish well inside the client's socket timeout.
            reply = client.xread({RESULTS_STREAM: last}, count=500, block=1000 if follow else None)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise BrokerUnavailable(url, exc) from None
        if not reply:
            if not follow:
                return
            continue
        for raw_id, fields in reply[0][1]:
            last = raw_id.decode()
            try:
                result = codec.loads(fields[b"data"])
            except (KeyError, ValueError):
                log.warning("skipping results stream entry %s without a JSON 'data' field", last)
                continue
            if epochs.repeat(fields.get(b"epoch"), result):
                log.info("skipping results stream entry %s: ticket %s was answered before Redis lost its data",
                         last, result.get("id"))  # fmt: skip
                continue
            yield last, result


def queue_depth(client: redis.Redis, url: str, queue: str) -> int:
    """Messages waiting in `queue`, over kombu's priority lists (one pipelined round trip)."""
    try:
        pipe = client.pipeline(transaction=False)
        for key in queue_lists(queue):
            pipe.llen(key)
        return sum(pipe.execute())
    except (redis.exceptions.RedisError, OSError) as exc:
        raise BrokerUnavailable(url, exc) from None
