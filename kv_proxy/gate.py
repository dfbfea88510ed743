"""The proxy's listening socket and who may hold a connection to it: ``ClientGate`` (with its socket classes
``_Listener`` and ``_Client``), which also serves the app with Hypercorn, and ``fit_to_file_limit``, which sizes the
client cap and the upstream pool to the process's open-file limit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import logging
import re
import resource
import socket
import struct
import termios
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from quart import Quart

from kv_proxy.config import ConfigError, ProxyConfig

log = logging.getLogger(__name__)

BACKLOG = 2048  # the listening socket's queue of connections not yet accepted
RESERVED_FILES = 64  # for the process itself: the listener, logs, the event loop, imports, /metrics reads
MIN_FILES = 128  # below this open-file limit the proxy refuses to start
MAX_FILES = 1 << 20  # the most it raises its soft limit to
MIN_BODY_RATE = 1024  # bytes per second a request body must average once it has had BODY_GRACE seconds
BODY_GRACE = 5.0
NEW_GRACE = 1.0  # seconds a connection keeps its place while its first request is on its way to the app
HEAD_GRACE = 10.0  # ... and once a whole HTTP/1 request head of it was read: only the app is late (a loaded machine)
REQUEST_LINE = re.compile(rb"[A-Z]{1,20} [!-~]+ HTTP/1\.[01]\r?\n")
MAX_REQUEST_LINE = 8192  # a first line longer than this is not looked at further


def fit_to_file_limit(config: ProxyConfig) -> ProxyConfig:
    """``config`` with ``max_clients`` and ``max_connections`` lowered to what the open-file limit holds (its soft
    limit raised towards the hard one first, up to MAX_FILES): RESERVED_FILES for the process, a quarter of the rest
    at most for the upstream pool, and of what is left an eighth kept free for client connections being closed
    (``ClientGate``). Clients beyond the limit cost accept errors and starve everyone. Raises ``ConfigError`` below
    MIN_FILES."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_FILES if hard == resource.RLIM_INFINITY else min(hard, MAX_FILES)
    if soft != resource.RLIM_INFINITY and soft < target:
        for attempt in (target, min(target, 10240)):  # macOS refuses more than its own maximum
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (attempt, hard))
            except (ValueError, OSError):
                continue
            soft = attempt
            break
    if soft == resource.RLIM_INFINITY or soft > MAX_FILES:
        soft = MAX_FILES
    if soft < MIN_FILES:
        raise ConfigError(f"the open-file limit is {soft} (and cannot be raised): the proxy needs at least "
                          f"{MIN_FILES}; raise it (ulimit -n)")
    usable = soft - RESERVED_FILES
    pool = min(config.max_connections, max(usable // 4, 8))
    clients = min(config.max_clients, (usable - pool) * 8 // 9)
    if clients < config.max_clients or pool < config.max_connections:
        (log.warning if clients < config.max_clients else log.info)(
            "the open-file limit is %d: at most %d client connections (--max-clients %d) and %d upstream connections "
            "(--max-connections %d); raise the limit (ulimit -n) for more", soft, clients, config.max_clients, pool,
            config.max_connections)
    return dataclasses.replace(config, max_clients=clients, max_connections=pool)


class _Request:
    """A request the app is handling on a connection: its body as it comes (``receiving`` until its last part), and
    since when an answer's write waits for the client to read (``blocked``)."""

    __slots__ = ("body", "receiving", "since", "blocked")

    def __init__(self) -> None:
        self.since, self.body, self.receiving = time.monotonic(), 0, True
        self.blocked: float | None = None


class _Client(socket.socket):
    """An accepted client connection, counted by its gate until closed."""

    gate: ClientGate | None = None
    address: tuple[str, int] = ("", 0)  # the client's, as the app's requests name it
    last_active = 0.0
    evicted = False  # shut down to make room; closed once its transport sees the end
    accepted = 0.0
    sent = 0  # bytes of requests it sent (heads as the app saw them, bodies as they came)
    read = 0  # bytes the transport read from it (a head not parsed yet included)
    dispatched = False  # the app has seen a request of it
    head_read = False  # before that: a whole HTTP/1 request head (request line to blank line) was read from it
    _looking = True  # the bytes read are looked at for that (until the app sees a request, or they cannot be one)
    _first: bytes | None = b""  # the first line as it comes; None once it ended and is a request line
    _tail = b""  # the last bytes read after it, for a blank line split between two reads
    requests: set[_Request] | None = None  # the app is handling them (a streamed answer counts until its end)

    @property
    def in_flight(self) -> int:
        return len(self.requests or ())

    def recv(self, size: int, flags: int = 0) -> bytes:
        data = super().recv(size, flags)
        if not flags & socket.MSG_PEEK:
            self.read += len(data)
            if self._looking and not self.dispatched:
                self._look(data)
        return data

    def recv_into(self, buffer: Any, size: int = 0, flags: int = 0) -> int:
        count = super().recv_into(buffer, size, flags)
        if not flags & socket.MSG_PEEK:
            self.read += count
            if self._looking and not self.dispatched:
                self._look(bytes(memoryview(buffer)[:count]))
        return count

    def _look(self, data: bytes) -> None:
        """Note a whole HTTP/1 request head among the first bytes read: a request line (HTTP/2's preface is not
        one), then a blank line, also when either is split between reads."""
        if self._first is not None:
            first = self._first + data
            end = first.find(b"\n")
            if end < 0:
                self._first = first
                self._looking = len(first) <= MAX_REQUEST_LINE
                return
            if not REQUEST_LINE.fullmatch(first[:end + 1]):
                self._looking = False
                return
            self._first, self._tail, data = None, first[max(end - 2, 0):end + 1], first[end + 1:]
        seen = self._tail + data
        if b"\r\n\r\n" in seen or b"\n\n" in seen:
            self.head_read, self._looking = True, False
        self._tail = seen[-3:]

    def evictable(self) -> bool:
        """No request under way, or only requests whose bodies are still coming (pipelined or HTTP/2 streams
        alike): its place may go to another client."""
        return all(r.receiving for r in self.requests or ())

    def rate(self, now: float) -> float:
        """Bytes per second it sent since accepted (at least a second counted): the lowest goes first when full."""
        return self.sent / max(now - self.accepted, 1.0)

    def new(self, now: float) -> bool:
        """No request of it seen by the app yet, and bytes sent, accepted under NEW_GRACE seconds ago (its request,
        read or waiting to be, not parsed and handed to the app yet: a few loop turns), or under HEAD_GRACE if a
        whole HTTP/1 request head of it was read (the app is late: a busy process on a loaded machine); none of it
        counts in ``sent`` yet. A silent connection is not new: it waits for nothing. A head that never ends, or
        bytes that are no HTTP/1 request (HTTP/2's preface with no stream after it), are new only for NEW_GRACE."""
        if self.dispatched:
            return False
        age = now - self.accepted
        if self.head_read:
            return age < HEAD_GRACE
        return age < NEW_GRACE and (self.read > 0 or self.waiting() > 0)

    def waiting(self) -> int:
        """Bytes received and not read yet."""
        try:
            return struct.unpack("i", fcntl.ioctl(self.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        except OSError:
            return 0

    def end(self) -> None:
        """Shut the connection down: its transport sees the end and closes it."""
        with contextlib.suppress(OSError):
            self.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.closed(self)
        super().close()


class _Listener(socket.socket):
    """The proxy's listening socket: asyncio calls its ``accept``, which asks the gate."""

    gate: ClientGate

    def accept(self) -> tuple[socket.socket, Any]:  # type: ignore[override]
        if not self.gate.room():
            raise BlockingIOError  # asyncio accepts again when the listener is readable again: the connection waits
        fd, address = self._accept()  # type: ignore[attr-defined]
        client = _Client(self.family, self.type, self.proto, fileno=fd)
        # asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without it Nagle's algorithm and the
        # client's delayed ACK hold each small response write back
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.gate.admit(client, address):
            client.close()
            raise ConnectionAbortedError  # asyncio goes on accepting
        return client, address


class ClientGate:
    """Who may hold a connection to the proxy: at most ``max_clients`` at once, so slow clients cannot exhaust the
    proxy's file descriptors. When full, a new connection takes the place of the one that sent the fewest bytes per
    second since it was accepted among those with no request under way or a request whose body is still coming (a
    real client sends its request at once), or is closed if every one has a request under way. A new connection
    (``_Client.new``) goes only when all others are under way or new: until the app sees its request it has sent
    nothing counted, and one accepted in the same breath would close it. The places being
    given up (an eighth more) do not hold new ones back. A connection with no request under way is closed after
    ``client_timeout`` seconds (a request's head must arrive within them: a client that trickles its headers, or
    sits idle, gives its place up), and a body that averages under MIN_BODY_RATE after BODY_GRACE seconds is cut
    (its total time is also bounded, see BODY_TIMEOUT), and one whose client reads nothing of its answer for
    ``client_timeout`` is closed. On Linux the listener defers accepting a connection until its client sends
    something (TCP_DEFER_ACCEPT, for about ``client_timeout``; after that the kernel hands it over, and it is an idle
    connection like any other): Hypercorn keeps a connection it was told to close that never sent anything until its
    keep-alive timeout. The app sees requests only once
    their head is complete, so it marks what a connection is doing and counts its body (``wrap``)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.limit, self.idle = config.max_clients, config.client_timeout
        self.headroom = max(self.limit // 8, 1)  # connections being closed on top of the limit
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.listener = _Listener(family, socket.SOCK_STREAM)
        self.listener.gate = self
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((config.host, config.port))
        except OSError as error:
            self.listener.close()
            raise ConfigError(f"cannot listen on {config.host}:{config.port}: {error.strerror}") from None
        if hasattr(socket, "TCP_DEFER_ACCEPT"):  # Linux: a connection that sends nothing is never accepted (no file)
            self.listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, max(int(self.idle), 1))
        self.listener.listen(BACKLOG)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.clients: dict[tuple[str, int], _Client] = {}  # by peer address: what the app's requests name
        self.open = 0  # connections accepted and not closed yet (evicted ones included): file descriptors held
        self.closing = 0  # of them, evicted and not closed yet
        self.crowded = 0  # times the limit was reached
        self.cut = 0  # connections closed for a body too slow or an answer not read

    def room(self) -> bool:
        """Whether a connection may be accepted now: while the places being given up fit in the headroom (a file
        each until closed); else it waits in the listen queue."""
        return self.open < self.limit + self.headroom

    def make_room(self) -> bool:
        """At the limit, shut down the evictable connection that sent the fewest bytes per second (see the class
        docstring); False if every one has a request under way (the new one is then closed at once). Asked only
        once a connection is accepted: asyncio calls ``accept`` until none is waiting."""
        now = time.monotonic()
        evictable = [c for c in self.clients.values() if c.evictable()]
        victims = [c for c in evictable if not c.new(now)] or evictable
        self.crowded += 1
        if self.crowded in (1, 10, 100) or self.crowded % 1000 == 0:
            log.warning("%d client connections open (--max-clients): %s (%d times so far)", self.limit,
                        "closing the slowest sender" if victims else "refusing a new one", self.crowded)
        if not victims:
            return False
        self.evict(min(victims, key=lambda c: (c.rate(now), c.accepted)))
        return True

    def evict(self, client: _Client) -> None:
        client.evicted = True
        self.closing += 1
        del self.clients[client.address]
        client.end()

    def admit(self, client: _Client, address: Any) -> bool:
        """Count ``client`` in (accepted once ``room`` said so), making room at the limit; False: close it."""
        if self.open - self.closing >= self.limit and not self.make_room():
            return False
        client.gate, client.address, client.requests = self, address[:2], set()
        client.last_active = client.accepted = time.monotonic()
        self.clients[client.address] = client
        self.open += 1
        return True

    def closed(self, client: _Client) -> None:
        self.open -= 1
        if client.evicted:
            self.closing -= 1
        if self.clients.get(client.address) is client:
            del self.clients[client.address]

    def wrap(self, app: Any) -> Callable[..., Awaitable[None]]:
        """The ASGI app, marking each request on its connection while the app handles it, and counting what its
        client sends: the head (as parsed), the body as it comes (a request without one has none to wait for)."""
        async def gated(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            client = self.clients.get(tuple(scope.get("client") or ())[:2]) if scope["type"] == "http" else None
            if client is None:
                await app(scope, receive, send)
                return
            headers = scope.get("headers") or []
            client.sent += len(scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in headers) + 16
            client.dispatched = True
            request = _Request()  # every request's body is tracked (HTTP/2 needs no length header)

            async def counted() -> Any:
                message = await receive()
                if message.get("type") == "http.request" and request.receiving:
                    size = len(message.get("body") or b"")
                    client.sent += size
                    request.body += size
                    request.receiving = bool(message.get("more_body"))
                elif message.get("type") == "http.disconnect":
                    request.receiving = False
                return message

            async def timed(message: Any) -> None:
                request.blocked = time.monotonic()
                try:
                    await send(message)
                finally:
                    request.blocked = None

            assert client.requests is not None
            client.requests.add(request)
            try:
                await app(scope, counted, timed)
            finally:
                client.requests.discard(request)
                client.last_active = time.monotonic()
        return gated

    async def sweep(self) -> None:
        """Close, every fraction of ``client_timeout`` (a second at most), the connections idle (or still sending a
        head) for longer, those with a request body coming slower than MIN_BODY_RATE after BODY_GRACE, and those
        whose client has not read an answer's write for ``client_timeout``."""
        while True:
            await asyncio.sleep(min(1.0, self.idle / 4))
            now = time.monotonic()
            cutoff = now - self.idle
            for client in list(self.clients.values()):
                if client.in_flight == 0 and client.last_active < cutoff:
                    client.end()
                    continue
                why = self._too_slow(client, now, cutoff)
                if why:
                    self.cut += 1
                    if self.cut in (1, 10, 100) or self.cut % 1000 == 0:
                        log.warning("closed a client connection from %s: %s (%d such so far)", client.address[0], why,
                                    self.cut)
                    self.evict(client)

    @staticmethod
    def _too_slow(client: _Client, now: float, cutoff: float) -> str:
        for request in list(client.requests or ()):
            took = now - request.since
            if request.receiving and took > BODY_GRACE and request.body < MIN_BODY_RATE * took:
                return f"its request body came at {request.body / took:.0f} bytes/s (at least {MIN_BODY_RATE})"
            if request.blocked is not None and request.blocked < cutoff:
                return f"it read nothing of its answer for {now - request.blocked:.0f} s (--client-timeout)"
        return ""

    async def serve(self, app: Quart, shutdown_trigger: Callable[..., Awaitable[Any]] | None = None) -> None:
        """Serve ``app`` with Hypercorn on this gate's socket until ``shutdown_trigger`` (default: SIGINT/SIGTERM)."""
        gate = self

        class _Config(HypercornConfig):
            def create_sockets(self) -> Sockets:
                return Sockets([], [gate.listener], [])

        server = _Config()
        server.backlog = BACKLOG
        server.accesslog = None
        server.errorlog = logging.getLogger("hypercorn.error")  # through this process's logging set-up, no own handler
        server.graceful_timeout = 5.0
        server.keep_alive_timeout = self.idle
        # no read_timeout: Hypercorn would close a connection whose client sends nothing while it waits for a long
        # answer or stream; heads and idle connections are the sweeper's, bodies BODY_TIMEOUT's
        sweeper = asyncio.create_task(self.sweep())
        try:
            await serve(self.wrap(app), server, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
        finally:
            sweeper.cancel()
            self.listener.close()
