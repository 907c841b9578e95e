"""Private Redis servers for the integration tests that break Redis on purpose: a primary with its
replica and three sentinels (`SentinelSet`), and the check that redis-server is installed.

Every server is a `workers.RedisServer` (a plain redis-server, or one started with `--sentinel`)
on a free port in the test's tmp dir, which the test may kill, pause or restart. Waits poll a
condition with a deadline (`wait_for`), never sleep a fixed time.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
from workers import RedisServer, free_port, skip_or_fail, wait_for

MASTER_NAME = "ticketq"  # the name the sentinels monitor: TICKETQ_SENTINEL_MASTER
DOWN_AFTER_MS = 2000  # a master silent this long is down for a sentinel


def require_redis_server() -> None:
    """Skip without redis-server; under CI (CI=true) a missing redis-server fails instead."""
    if shutil.which("redis-server") is None:
        skip_or_fail("redis-server is not installed (apt-get install redis-server)")


class SentinelServer(RedisServer):
    """`redis-server CONF --sentinel`, monitoring `master_name` at `master_port` (quorum 2).

    A sentinel rewrites its configuration file as it learns (peers, replicas, failovers), so each
    gets a file of its own in its own directory.
    """

    def __init__(self, workdir: Path, master_port: int, port: int, master_name: str = MASTER_NAME) -> None:
        super().__init__(workdir, port=port, aof=False)
        self.master_port, self.master_name = master_port, master_name
        self.master_host = "127.0.0.1"  # where it finds the master
        self.listen = "bind 127.0.0.1\n"  # configuration lines: where it listens, who may connect

    def start(self) -> SentinelServer:
        config = self.workdir / "sentinel.conf"
        config.write_text(
            f"port {self.port}\n{self.listen}dir {self.workdir}\n"
            f"sentinel monitor {self.master_name} {self.master_host} {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {self.master_name} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {self.master_name} 10000\n"
        )
        self.proc = subprocess.Popen(["redis-server", str(config), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        wait_for(self._pings, 10, f"sentinel on port {self.port}")
        return self

    def master(self) -> dict:
        return self.client().sentinel_master(self.master_name)

    def master_address(self) -> tuple[str, int]:
        host, port = self.client().sentinel_get_master_addr_by_name(self.master_name)
        return host.decode() if isinstance(host, bytes) else host, int(port)


class SentinelSet:
    """A primary, one replica and three sentinels, all on 127.0.0.1; `url` is the sentinel:// list.

    `start()` returns once every sentinel knows the other two and the replica, and the replica is
    in sync: only then can a failover happen. `kill_primary()`, `wait_promoted()` and `rejoin()`
    play a failover through. `cut_replication()` makes the replica fall behind: stopped (SIGSTOP)
    and its link dropped by the primary, so that writes from then on reach the primary alone (a
    stopped replica still gets what was already on its socket), until `resume()`.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        primary, replica, *sentinels = free_ports(5)  # chosen together: no two servers pick the same one
        self.primary = RedisServer(self._dir("primary"), port=primary, aof=False)
        self.replica = RedisServer(self._dir("replica"), port=replica, aof=False,
                                   args=["--replicaof", "127.0.0.1", str(primary)])  # fmt: skip
        self.sentinels = [SentinelServer(self._dir(f"sentinel-{n}"), primary, port)
                          for n, port in enumerate(sentinels)]  # fmt: skip

    def _dir(self, name: str) -> Path:
        path = self.workdir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)

    def start(self, timeout: float = 75) -> SentinelSet:
        # A sentinel whose timer is held up for over 2 s (a loaded machine) enters TILT mode for 30 s
        # (SENTINEL_TILT_PERIOD); the wait allows one TILT plus Sentinel's 10 s INFO period, twice.
        self.primary.start()
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.start()
        try:
            wait_for(self._in_sync, timeout, "the replica in sync and each sentinel knowing its peers", interval=0.1)
        except TimeoutError as exc:  # say which part never came, for whoever meets this
            raise TimeoutError(f"{exc}: {self._sync_state()}") from None
        return self

    def _sync_state(self) -> str:
        try:
            link = self.replica.client().info("replication").get("master_link_status")
            seen = [(sentinel.port, int(m["num-other-sentinels"]), int(m["num-slaves"]), m.get("flags"),
                     sentinel.client().info("sentinel").get("sentinel_tilt"))
                    for sentinel in self.sentinels for m in [sentinel.master()]]  # fmt: skip
        except (redis.RedisError, KeyError, ValueError) as error:
            return f"state unreadable ({error!r})"
        return f"replica link {link}; per sentinel (port, other sentinels, replicas, flags, tilt): {seen}"

    def _in_sync(self) -> bool:
        link = self.replica.client().info("replication")
        masters = [sentinel.master() for sentinel in self.sentinels]
        return link.get("master_link_status") == "up" and all(
            int(m["num-other-sentinels"]) == 2 and int(m["num-slaves"]) == 1 for m in masters
        )

    def master_address(self) -> tuple[str, int]:
        """Where the sentinels say the master is (the first that answers)."""
        for sentinel in self.sentinels:
            try:
                return sentinel.master_address()
            except redis.RedisError:
                continue
        raise RuntimeError("no sentinel answers")

    def master_client(self) -> redis.Redis:
        host, port = self.master_address()
        return redis.Redis(host=host, port=port)

    def kill_primary(self) -> int:
        """kill -9 of the current master; its port."""
        _, port = self.master_address()
        server = self.server_on(port)
        server.kill()
        return port

    def wait_promoted(self, old_port: int, timeout: float = 30) -> tuple[str, int]:
        """Until every sentinel names a master other than `old_port` that says it is one."""

        def promoted() -> tuple[str, int] | None:
            addresses = {sentinel.master_address() for sentinel in self.sentinels}
            if len(addresses) != 1:
                return None
            (address,) = addresses
            if address[1] == old_port:
                return None
            role = redis.Redis(host=address[0], port=address[1]).info("replication").get("role")
            return address if role == "master" else None

        return wait_for(promoted, timeout, "a replica promoted by the sentinels", interval=0.05)

    def rejoin(self, port: int) -> RedisServer:
        """Start the server that listened on `port` again, as a replica of the current master (what an
        orchestrator does for a failed node), and wait until it is in sync."""
        host, master_port = self.master_address()
        server = self.server_on(port)
        server.args = ["--replicaof", host, str(master_port)]
        server.start()
        wait_for(lambda: server.client().info("replication").get("master_link_status") == "up", 30,
                 f"the node on port {port} replicating from the new master", interval=0.05)  # fmt: skip
        return server

    def server_on(self, port: int) -> RedisServer:
        return next(server for server in (self.primary, self.replica) if server.port == port)

    def cut_replication(self) -> None:
        self.replica.proc.send_signal(signal.SIGSTOP)
        self.master_client().client_kill_filter(_type="replica")

    def resume(self) -> None:
        self.replica.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for server in (*self.sentinels, self.primary, self.replica):
            if server.proc and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGCONT)  # a paused server would not die of SIGKILL's wait
            server.kill()


@contextmanager
def sentinel_set(workdir: Path) -> Iterator[SentinelSet]:
    """A started `SentinelSet`, every server killed after the block."""
    require_redis_server()
    servers = SentinelSet(workdir)
    try:
        yield servers.start()
    finally:
        servers.stop()


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports (each checked free when chosen)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports
