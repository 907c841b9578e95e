"""Every Redis client ticketq opens: plain or through Sentinel, with timeouts, the retry policy,
and one clear error; plus what Redis says about its memory and replicas.

`redis_client` is the one place a Redis URL becomes a redis-py client: `redis://`/`rediss://` as
redis-py reads them, `sentinel://h1:26379;sentinel://h2:26379` (kombu's and Celery's spelling)
through `redis.sentinel.Sentinel(...).master_for(master_name)`, a client that asks the sentinels
for the master again whenever its connection breaks or the node it reached answers READONLY (it
was demoted). `transport_options` gives kombu and Celery the same master name and sentinel
password, so their own clients find the same master.

`connect` turns "cannot use Redis" into a line a person can act on: where (the URL, password
masked), what went wrong (credentials refused, writes refused: out of memory or not enough
replicas, or not reachable), and what to set. Producers call it before their first send, workers
at start-up.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel, SentinelConnectionPool

from ticketq.config import is_sentinel_url, mask_url
from ticketq.errors import TicketqError

CONNECT_TIMEOUT_S = 3.0  # a Redis that does not accept a connection in this long is down for us
SOCKET_TIMEOUT_S = 10.0  # one command; blocking reads must stay well inside it
PROBE_TIMEOUT_S = 1.0  # a plain-text PING to a `rediss://` port whose TLS handshake timed out
SENTINEL_PORT = 26379
_AUTH_ERRORS = (redis.exceptions.AuthenticationError, redis.exceptions.AuthenticationWrongNumberOfArgsError)

# Why Redis refuses a write it would otherwise take: the server is full under `noeviction`, or
# `min-replicas-to-write` finds too few replicas. Both pass by themselves; neither is an outage.
OUT_OF_MEMORY = "out of memory"
NOT_ENOUGH_REPLICAS = "not enough replicas"
# A key ticketq never creates: LPUSHX on it is a write Redis checks (memory, replicas, read-only)
# and then does nothing, so it asks "would a write be accepted now?" without writing.
WRITE_PROBE_KEY = "ticketq:write-probe"
# WAIT counts the replicas holding this connection's last write: a PUBLISH (replicated, stored
# nowhere, allowed on a full server) makes that "now", whichever connection wrote before.
REPLICATION_MARK = "ticketq:replication-mark"


class RedisUnavailable(TicketqError, ConnectionError):
    """Redis cannot be used: it refused the credentials, refused the write, or is not reachable.

    `str()` is one line: what failed, the URL (password masked) and what to do. `fix` names the
    settings to change; a caller with options of its own (a CLI flag) subclasses it. `detail`
    adds what the server said about itself (its maxmemory and policy), `note` what the caller
    knows of the attempt (how much of a bulk send went before).
    """

    fix = "set TICKETQ_BROKER_URL"

    def __init__(self, url: str, reason: object, detail: str = "", note: str = "") -> None:
        self.url = mask_url(url)
        self.reason = mask_url(_short(reason)).rstrip(".")
        self.refused = _caused_by(reason, _AUTH_ERRORS)
        self.write_refused = write_refusal(reason)
        message = self._message(detail)
        super().__init__(f"{message.rstrip('.')} ({note})." if note and self.write_refused else message)

    def _message(self, detail: str) -> str:
        if self.refused:
            return (
                f"Redis at {self.url} refused the credentials ({self.reason}). Check the user and "
                f"password in the URL (redis://[user]:PASSWORD@host:6379/0); {self.fix}."
            )
        if self.write_refused == OUT_OF_MEMORY:
            return (
                f"Redis refused the write: out of memory ({detail or 'maxmemory reached'}) at {self.url}. What it "
                "refused was not stored: free memory (are workers consuming the queue?) or raise maxmemory "
                "(CONFIG SET maxmemory ...), then send again."
            )
        if self.write_refused == NOT_ENOUGH_REPLICAS:
            return (
                f"Redis refused the write: not enough replicas (min-replicas-to-write{'; ' + detail if detail else ''})"
                f" at {self.url}. What it refused was not stored: bring a replica back, then send again."
            )
        if tls := _tls_hint(self.reason):
            return f"Redis at {self.url} refused the TLS connection ({self.reason}): {tls}; {self.fix}."
        if self.url.startswith("rediss://") and "timeout" in self.reason.lower() and _answers_plain_redis(self.url):
            return (f"Redis at {self.url} does not speak TLS: the TLS handshake timed out and that port answers "
                    f"plain Redis; use redis:// (or the server's TLS port); {self.fix}.")  # fmt: skip
        if is_sentinel_url(self.url):
            return (
                f"Redis is not reachable at {self.url} ({self.reason}). Check that the sentinels run, that they "
                f"monitor the master named by TICKETQ_SENTINEL_MASTER and that it is up; {self.fix}."
            )
        return (
            f"Redis is not reachable at {self.url} ({self.reason}). Check that it is running "
            f"(redis-server --port {_port(self.url)}) and that the URL's host, port and db are right; {self.fix}."
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(url={self.url!r}, reason={self.reason!r})"


@dataclass(frozen=True)
class SentinelUrl:
    """A `sentinel://` list: the sentinels' addresses, and the db and credentials of the master.

    As kombu and Celery read it, the db, user and password come from the first URL of the list;
    the sentinels' own password is a setting of its own (TICKETQ_SENTINEL_PASSWORD).
    """

    sentinels: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None


def _port(url: str) -> int:
    """The port a Redis URL names (6379 when it names none, or cannot be read)."""
    try:
        return urlsplit(url).port or 6379
    except ValueError:
        return 6379


def parse_sentinel_url(url: str) -> SentinelUrl:
    """`sentinel://[[user]:password@]host[:port][/db];sentinel://host2[:port];...`, or ValueError."""
    parts = [part.strip() for part in url.split(";") if part.strip()]
    sentinels = []
    for part in parts:
        split = urlsplit(part)
        if split.scheme.lower() != "sentinel" or not split.hostname:
            raise ValueError(f"{mask_url(part)!r} is not sentinel://host:26379")
        sentinels.append((split.hostname, split.port or SENTINEL_PORT))
    if not sentinels:
        raise ValueError("names no sentinel: sentinel://host:26379;sentinel://host2:26379")
    first = urlsplit(parts[0])
    path = first.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"the db {path!r} is not a number (sentinel://host:26379/0)")
    return SentinelUrl(
        tuple(sentinels),
        db=int(path or 0),
        username=unquote(first.username) if first.username else None,
        password=unquote(first.password) if first.password is not None else None,
    )


def transport_options(url: str, master_name: str | None, sentinel_password: str | None = None,
                      socket_timeout_s: float = SOCKET_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
    """What kombu's SentinelChannel and Celery's SentinelBackend need besides a sentinel:// URL
    (`broker_transport_options`, `result_backend_transport_options`); nothing for another URL."""
    if not is_sentinel_url(url):
        return {}
    return {"master_name": master_name, "sentinel_kwargs": _sentinel_kwargs(sentinel_password, socket_timeout_s)}


def redis_client(
    url: str,
    *,
    master_name: str | None = None,
    sentinel_password: str | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    retries: int = 0,
) -> redis.Redis:
    """A redis-py client for a Celery-style Redis or Sentinel URL; nothing is sent yet.

    A sentinel:// URL needs `master_name`; its client asks the sentinels for the master on every
    new connection, so it follows a failover. `retries` > 0 retries a command that failed on a
    connection error or timeout that many times, with exponential backoff (8 ms doubling up to
    1 s): for a long-lived client that should ride out a Redis restart. 0, the default, fails at
    once, so the caller can report it.
    """
    retry = Retry(ExponentialBackoff(cap=1.0, base=0.008), retries) if retries else Retry(NoBackoff(), 0)
    timeouts = {"socket_connect_timeout": connect_timeout_s, "socket_timeout": socket_timeout_s}
    try:
        if is_sentinel_url(url):
            if not master_name:
                raise ValueError("a sentinel:// URL needs the master's name (TICKETQ_SENTINEL_MASTER)")
            target = parse_sentinel_url(url)
            return master_for(target.sentinels, master_name,
                              sentinel_kwargs=_sentinel_kwargs(sentinel_password, socket_timeout_s, connect_timeout_s),
                              db=target.db, username=target.username, password=target.password, retry=retry,
                              **timeouts)  # fmt: skip
        return redis.Redis.from_url(_redis_py_url(url), retry=retry, **timeouts)
    except ValueError as exc:
        raise ValueError(f"invalid Redis URL {mask_url(url)}: {exc}") from None


def master_for(
    sentinels: Sequence[tuple[str, int]],
    master_name: str,
    *,
    sentinel_kwargs: dict[str, Any] | None = None,
    redis_class: type[redis.Redis] = redis.Redis,
    **connection_kwargs: Any,
) -> redis.Redis:
    """A client on the master `sentinels` name `master_name`: redis-py's Sentinel-managed pool.

    Its connections ask the sentinels where the master is whenever they connect, and treat a
    READONLY answer (the node was demoted) as a broken connection. `close(client)` also closes
    the connections to the sentinels.
    """
    manager = Sentinel(list(sentinels), sentinel_kwargs=sentinel_kwargs, **connection_kwargs)
    return manager.master_for(master_name, redis_class=redis_class)


def close(client: redis.Redis) -> None:
    """Close `client`, its pool, and for a Sentinel-managed one its connections to the sentinels."""
    client.close()
    pool = client.connection_pool
    pool.disconnect()
    if isinstance(pool, SentinelConnectionPool):
        for sentinel in pool.sentinel_manager.sentinels:
            sentinel.close()


def connect(
    url: str,
    *,
    master_name: str | None = None,
    sentinel_password: str | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    socket_timeout_s: float = SOCKET_TIMEOUT_S,
    retries: int = 0,
    error: type[RedisUnavailable] = RedisUnavailable,
) -> redis.Redis:
    """A `redis_client` that answered one PING, or `error(url, cause)` raised (`RedisUnavailable`)."""
    client = redis_client(url, master_name=master_name, sentinel_password=sentinel_password,
                          connect_timeout_s=connect_timeout_s, socket_timeout_s=socket_timeout_s,
                          retries=retries)  # fmt: skip
    try:
        client.ping()
    except (redis.exceptions.RedisError, OSError) as exc:
        close(client)
        raise error(url, exc) from None
    return client


def _answers_plain_redis(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a plain-text PING to the URL's host and port gets a Redis reply (`+PONG`, `-NOAUTH ...`).

    A Redis without TLS reads a TLS ClientHello as the start of an inline command and waits for its
    end, so the handshake only times out and OpenSSL has nothing to name; this asks the port itself.
    """
    parts = urlsplit(url)
    try:
        address = (parts.hostname or "127.0.0.1", parts.port or 6379)
        with socket.create_connection(address, timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64)[:1] in (b"+", b"-")
    except (OSError, ValueError):
        return False


def write_refusal(reason: object) -> str | None:
    """OUT_OF_MEMORY or NOT_ENOUGH_REPLICAS when `reason` (or what it was raised from) is Redis
    refusing a write for that reason, else None. In a MULTI or a script the error is the same."""
    for _ in range(8):  # exception chains are short; the bound only guards against a cycle
        if isinstance(reason, redis.exceptions.OutOfMemoryError):
            return OUT_OF_MEMORY
        if isinstance(reason, redis.exceptions.ResponseError) and "NOREPLICAS" in str(reason):
            return NOT_ENOUGH_REPLICAS  # redis-py has no class of its own for it
        if not isinstance(reason, BaseException):
            return None
        reason = reason.__cause__ or reason.__context__
    return None


def write_problem(client: redis.Redis) -> str | None:
    """Why Redis would refuse a write right now (OUT_OF_MEMORY, NOT_ENOUGH_REPLICAS, or READONLY:
    a replica), or None; nothing is written. Connection errors propagate."""
    try:
        client.lpushx(WRITE_PROBE_KEY, "")
    except redis.exceptions.ReadOnlyError:
        return "read-only replica"
    except redis.exceptions.NoPermissionError:  # an ACL that denies the probe: nothing to tell
        return None
    except redis.exceptions.ResponseError as exc:
        refusal = write_refusal(exc)
        if refusal is None:
            raise
        return refusal
    return None


def confirm_replicas(pipe: Any, replicas: int, timeout_s: float) -> None:
    """Queue on `pipe` (a pipeline, so one connection) what makes its last reply the number of
    replicas that hold every write the master had taken when the WAIT ran."""
    pipe.publish(REPLICATION_MARK, b"")
    pipe.execute_command("WAIT", replicas, max(1, round(timeout_s * 1000)))


def replicated(client: redis.Redis, replicas: int, timeout_s: float) -> int:
    """How many replicas hold everything this master has taken so far (WAIT, at most `timeout_s`)."""
    pipe = client.pipeline(transaction=False)
    confirm_replicas(pipe, replicas, timeout_s)
    return int(pipe.execute()[-1])


def memory_policy(client: redis.Redis) -> str:
    """The server's `maxmemory-policy`: CONFIG GET, or INFO memory where CONFIG is disabled (managed Redis)."""
    try:
        policy = client.config_get("maxmemory-policy").get("maxmemory-policy")
    except redis.exceptions.ResponseError:  # CONFIG renamed or denied: INFO says it too
        policy = None
    if not policy:
        try:
            policy = client.info("memory").get("maxmemory_policy")
        except redis.exceptions.ResponseError:  # INFO denied as well
            policy = None
    return str(policy or "unknown")


def memory_state(client: redis.Redis) -> dict[str, Any]:
    """What INFO says about the server's memory and replicas: policy, limit, use (human-readable), replicas."""
    memory = client.info("memory")
    replication = client.info("replication")
    return {
        "maxmemory_policy": str(memory.get("maxmemory_policy", "unknown")),
        "maxmemory": memory.get("maxmemory_human", "?") if memory.get("maxmemory") else "0 (no limit)",
        "used_memory": memory.get("used_memory_human", "?"),
        "role": replication.get("role", "?"),
        "replicas": int(replication.get("connected_slaves", 0)),
    }


def describe_memory(state: dict[str, Any]) -> str:
    """`memory_state` as the words an error or a status line uses."""
    return f"maxmemory {state['maxmemory']}, used {state['used_memory']}, maxmemory-policy {state['maxmemory_policy']}"


def _sentinel_kwargs(password: str | None, socket_timeout_s: float,
                     connect_timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:  # fmt: skip
    # Given sentinel_kwargs, redis-py no longer copies the socket timeouts to the sentinels'
    # connections: without them a sentinel that stops answering would hang every rediscovery.
    kwargs: dict[str, Any] = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": connect_timeout_s}
    if password:
        kwargs["password"] = password
    return kwargs


def _redis_py_url(url: str) -> str:
    """The URL as redis-py wants it: Celery and kombu spell `ssl_cert_reqs=CERT_REQUIRED`, redis-py `required`."""
    parts = urlsplit(url)
    query = [(key, value.lower().removeprefix("cert_") if key == "ssl_cert_reqs" else value)
             for key, value in parse_qsl(parts.query)]  # fmt: skip
    return urlunsplit(parts._replace(query=urlencode(query)))


# What OpenSSL says (in redis-py's message) -> what to set. The URL's TLS parameters, as Celery,
# kombu and redis-py read them: ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs.
_TLS_HINTS = (
    ("CERTIFICATE_VERIFY_FAILED", "the server's certificate could not be verified; name the CA that signed it "
     "(rediss://host:6380/0?ssl_ca_certs=/path/ca.pem; without it the system's CA store is used) and connect by "
     "the host name the certificate is for"),
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS on that port; use redis:// or the server's TLS port"),
    ("CERTIFICATE_REQUIRED", "the server wants a client certificate: add ssl_certfile=/path/client.crt&"
     "ssl_keyfile=/path/client.key to the URL"),
)  # fmt: skip


def _tls_hint(reason: str) -> str | None:
    """What to do about a TLS handshake that failed, from the reason's words; None for anything else."""
    upper = reason.upper().replace(" ", "_")
    return next((hint for words, hint in _TLS_HINTS if words in upper), None)


def _short(reason: object) -> str:
    """The reason in words; redis-py's MasterNotFoundError also lists the repr of every sentinel client."""
    if isinstance(reason, MasterNotFoundError):
        return str(reason).split(" : ", 1)[0]
    return str(reason)


def _caused_by(reason: object, kinds: tuple[type[BaseException], ...]) -> bool:
    """`reason` is one of `kinds`, or was raised from one (kombu and Celery wrap redis-py's errors)."""
    for _ in range(8):  # exception chains are short; the bound only guards against a cycle
        if isinstance(reason, kinds):
            return True
        if not isinstance(reason, BaseException):
            return False
        reason = reason.__cause__ or reason.__context__
    return False
