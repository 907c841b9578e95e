"""A fault-injecting TCP proxy between a client and a Redis: the half-open connection, on demand.

    proxy = RedisProxy(redis_port).start()        # clients connect to proxy.port
    proxy.drop_reply(lambda command: ...)          # the first reply to a matching command is dropped
    ...
    proxy.dropped.wait(timeout)                    # set once a reply was dropped

The proxy reads the commands each client sends (RESP arrays) and the replies Redis sends back, in
order, so it knows which reply answers which command. When the reply to the first command that
the predicate accepts arrives (and, for a fetch, is not nil), the proxy swallows it and that
connection goes half-open: both sockets stay open, nothing more passes either way, as after a
lost reply on a dead route. Every other connection, and every connection opened later, is
forwarded as is; when either end of one closes, both are closed (a restarted Redis is seen by the
client as its own restart would be). `upstream`: where each new connection goes, asked at each
connect (docs/bench/chaos.py follows the Sentinel-named master with it). Standard library only:
threads and sockets.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import deque
from collections.abc import Callable

Command = list[bytes]  # the command's name and arguments, as the client sent them


class _Reader:
    """Incremental RESP (2 and 3) parsing: feed bytes, take whole values' byte lengths."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def take(self) -> tuple[bytes, object] | None:
        """(the raw bytes of the next whole value, the value), or None when it is not all here."""
        parsed = _parse(self.buffer, 0)
        if parsed is None:
            return None
        end, value = parsed
        raw, self.buffer = self.buffer[:end], self.buffer[end:]
        return raw, value


def _parse(buffer: bytes, at: int) -> tuple[int, object] | None:
    line_end = buffer.find(b"\r\n", at)
    if line_end < 0:
        return None
    kind, body, after = buffer[at:at + 1], buffer[at + 1:line_end], line_end + 2
    if kind in (b"+", b"-", b":", b",", b"#", b"("):
        return after, body
    if kind == b"_":
        return after, None
    if kind in (b"$", b"=", b"!"):
        size = int(body)
        if size < 0:
            return after, None
        if len(buffer) < after + size + 2:
            return None
        return after + size + 2, buffer[after:after + size]
    if kind in (b"*", b"~", b">", b"%", b"|"):
        count = int(body)
        if count < 0:
            return after, None
        count *= 2 if kind in (b"%", b"|") else 1
        items = []
        for _ in range(count):
            parsed = _parse(buffer, after)
            if parsed is None:
                return None
            after, item = parsed
            items.append(item)
        return after, items
    raise ValueError(f"not RESP: {buffer[at:at + 20]!r}")


class RedisProxy:
    def __init__(self, redis_port: int, host: str = "127.0.0.1",
                 upstream: Callable[[], tuple[str, int]] | None = None) -> None:  # fmt: skip
        self.upstream = upstream or (lambda: (host, redis_port))
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = threading.Event()
        self.dropped_command: Command | None = None
        self.dropped_reply: object = None  # the reply that was swallowed (parsed RESP)
        self._rule: Callable[[Command], bool] | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False

    def start(self) -> RedisProxy:
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()
        return self

    def drop_reply(self, matches: Callable[[Command], bool]) -> None:
        """Drop the first non-nil reply to a command `matches` accepts; that connection goes half-open."""
        with self._lock:
            self._rule = matches
            self.dropped.clear()

    def close(self) -> None:
        self._closed = True
        for sock in [self.listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream(), timeout=5)
            except Exception:  # Redis down, or no master named: the client sees a closed connection
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            _Connection(self, client, server).start()

    def drops(self, command: Command, reply: object) -> bool:
        """Whether the reply to `command`, here now, is the one to drop: the rule is used once, by
        the first reply that arrives after it was set (a command sent before counts too)."""
        with self._lock:
            if self._rule is None or not self._rule(command):
                return False
            self._rule, self.dropped_command, self.dropped_reply = None, command, reply
            self.dropped.set()
            return True


class _Connection:
    """One client connection: commands forwarded and remembered, replies matched to them."""

    def __init__(self, proxy: RedisProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.pending: deque[Command] = deque()  # sent, not answered yet, in order
        self.lock = threading.Lock()
        self.half_open = False

    def start(self) -> None:
        threading.Thread(target=self._closing, args=(self._upstream,), name="proxy-up", daemon=True).start()
        threading.Thread(target=self._closing, args=(self._downstream,), name="proxy-down", daemon=True).start()

    def _closing(self, forward: Callable[[], None]) -> None:
        """Runs one direction; when it ends, not half-open, both sockets close."""
        forward()
        if not self.half_open:
            for sock in (self.client, self.server):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()

    def _upstream(self) -> None:
        reader = _Reader()
        while chunk := _recv(self.client):
            reader.feed(chunk)
            while (taken := reader.take()) is not None:
                raw, value = taken
                command = [part if isinstance(part, bytes) else str(part).encode() for part in value] \
                    if isinstance(value, list) else [raw]  # fmt: skip
                with self.lock:
                    if self.half_open:
                        return
                    self.pending.append(command)
                    if not _send(self.server, raw):
                        return

    def _downstream(self) -> None:
        reader = _Reader()
        while chunk := _recv(self.server):
            reader.feed(chunk)
            while (taken := reader.take()) is not None:
                raw, value = taken
                with self.lock:
                    if self.half_open:
                        return
                    if isinstance(value, list) and value[:1] in ([b"message"], [b"pmessage"]):
                        command = [b"PUSH"]  # a pub/sub push answers no command
                    else:
                        command = self.pending.popleft() if self.pending else [b"?"]
                    if value is not None and self.proxy.drops(command, value):
                        self.half_open = True  # the reply is lost, and so is everything after it
                        return
                    if not _send(self.client, raw):
                        return


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def command_is(name: str, containing: bytes | None = None) -> Callable[[Command], bool]:
    """A rule: the command's name is `name` (any case), with an argument equal to `containing`."""
    def matches(command: Command) -> bool:
        return command[0].upper() == name.encode().upper() and (containing is None or containing in command[1:])
    return matches
