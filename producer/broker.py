"""The producer's hold on Redis: its Celery app, a redis-py client on the broker, the check of the
connection before the first send (waited for through an outage when asked), the epoch marker that
tells a Redis that lost its data, and the errors that name the Redis that failed and why."""

from __future__ import annotations

import logging

import redis
from celery import Celery

from producer.backend import BulkRedisBackend, make_app
from producer.errors import BATCH_ERRORS, CONNECTION_ERRORS, BrokerUnavailable, NotReplicated
from producer.messages import TicketResult
from producer.outage import Outage
from ticketq import connections
from ticketq.config import ClientSettings, is_redis_url
from ticketq.connections import SOCKET_TIMEOUT_S, connect, redis_client
from ticketq.epoch import AcrossEpochs, Epoch, Loss, whoami

log = logging.getLogger(__name__)

LOST = "Redis lost its data (restarted without persistence, or flushed)"  # how a loss is said


class Broker:
    """The Celery app and the Redis client of one producer, opened on first use."""

    def __init__(self, settings: ClientSettings, connect_timeout_s: float) -> None:
        self.settings, self.connect_timeout_s = settings, connect_timeout_s
        self.app: Celery = make_app(settings, connect_timeout_s)
        self._redis: redis.Redis | None = None
        self.checked = False  # the connection was checked, and nothing failed since
        self.epoch = Epoch(whoami("producer"))  # notices a Redis that came back without its data
        self.epochs = AcrossEpochs(settings.stream_maxlen)  # what results_stream yielded, per epoch

    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            timeouts = {"connect_timeout_s": self.connect_timeout_s,
                        "socket_timeout_s": max(self.connect_timeout_s, SOCKET_TIMEOUT_S)}  # fmt: skip
            self._redis = redis_client(self.settings.broker_url, **self.settings.sentinel, **timeouts)
        return self._redis

    def close(self) -> None:
        if self._redis is not None:
            connections.close(self._redis)
            self._redis = None
        if isinstance(self.app.backend, BulkRedisBackend):
            self.app.backend.stop_consumer()
        self.app.close()

    def check_connection(self, retry_for_s: float = 0.0) -> None:
        """PING the broker and the Redis result backend, and read the epoch marker (`check_epoch`);
        raise `BrokerUnavailable` if down. `retry_for_s` > 0: a Redis not reachable yet (down, a
        Sentinel promotion, loading its data) is asked again through an `Outage` for that long,
        said once in the log; refused credentials raise at once."""
        outage = Outage("connecting", None, retry_for_s, met="Redis not reachable")
        while True:
            try:
                self._ping_all()
                loss = self.check_epoch()
            except BrokerUnavailable as exc:
                if outage.ride_out(exc):
                    continue
                raise
            outage.over()
            if loss is not None:
                log.warning("%s: the messages sent before may be gone; a wait with resend_after (--resend-after) "
                            "sends them again", LOST)  # fmt: skip
            self.checked = True
            return

    def _ping_all(self) -> None:
        for url in dict.fromkeys((self.settings.broker_url, self.settings.backend_url)):
            if not is_redis_url(url):
                continue  # other transports (memory://, tests) have nothing to ping
            client = connect(url, **self.settings.sentinel, connect_timeout_s=self.connect_timeout_s,
                             error=BrokerUnavailable)  # fmt: skip
            connections.close(client)

    def check_epoch(self) -> Loss | None:
        """Read the broker's epoch marker (`ticketq.epoch`): the first read adopts it, so a loss after
        it (and before the first send) is noticed; a `Loss` is returned once, and counted in
        `epoch.losses` for the wait to re-send what it waits for. A lost connection raises
        `BrokerUnavailable`; a refused write (a full Redis setting a first marker) is left for the
        next check."""
        if not is_redis_url(self.settings.broker_url):
            return None
        try:
            loss = self.epoch.check(self.redis)
        except redis.exceptions.ResponseError as exc:  # OOM, READONLY, NOREPLICAS on the SET NX
            log.debug("epoch marker not checked (%s)", exc)
            return None
        except (redis.exceptions.RedisError, OSError) as exc:
            raise BrokerUnavailable(self.settings.broker_url, exc) from None
        return loss

    def ensure_checked(self) -> None:
        if not self.checked:
            self.check_connection()

    def acquire_producer(self):
        """A kombu producer from Celery's pool (a context manager)."""
        try:
            return self.app.producer_or_acquire()
        except CONNECTION_ERRORS as exc:
            self.checked = False
            raise self.unreachable(exc) from None

    def unreachable(self, exc: BaseException, sent: int | None = None) -> BaseException:
        """Name the Redis that failed and why (not reachable, credentials, a refused write);
        give back any other error unchanged. `sent`: messages of a bulk send before the failure."""
        if isinstance(exc, BrokerUnavailable):
            return exc  # said already (a check of the connection before a send)
        if isinstance(exc, RuntimeError):
            # The result backend's pub/sub gave up reconnecting; Celery wraps the connection error.
            if isinstance(exc.__cause__, CONNECTION_ERRORS):
                return BrokerUnavailable(self.settings.backend_url, exc.__cause__)
            return exc
        if isinstance(exc, BATCH_ERRORS) and exc.__cause__ is not None:
            exc = exc.__cause__  # what the pipeline met; some of its messages may be queued
        note = f"the {sent} message(s) sent before it may be queued" if sent else ""
        return BrokerUnavailable(self.settings.broker_url, exc, self._memory_detail(exc), note=note)

    def _memory_detail(self, exc: BaseException) -> str:
        """The server's maxmemory and policy, for an out-of-memory refusal; "" if not one, or unknown."""
        if connections.write_refusal(exc) != connections.OUT_OF_MEMORY:
            return ""
        try:
            return connections.describe_memory(connections.memory_state(self.redis))
        except (redis.exceptions.RedisError, OSError):
            return ""

    def confirm_replicas(self, results: list[TicketResult]) -> None:
        """With TICKETQ_REPLICA_ACKS: `NotReplicated` unless that many replicas hold every send so far.

        WAIT counts the replicas that hold the writes the master had taken when it ran (see
        `ticketq.connections.confirm_replicas`): one call covers every message sent before it.
        """
        wanted = self.settings.replica_acks
        if not wanted or not results or not is_redis_url(self.settings.broker_url):
            return
        try:
            acked = connections.replicated(self.redis, wanted, self.settings.replica_timeout_s)
        except (redis.exceptions.RedisError, OSError) as exc:  # sent, then the broker went away
            acked = 0
            log.warning("could not ask Redis how many replicas hold the sent tickets (%s)", exc)
        if acked < wanted:
            raise NotReplicated(self.settings.broker_url, results, acked, wanted,
                                self.settings.replica_timeout_s)  # fmt: skip
