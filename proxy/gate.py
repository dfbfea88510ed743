"""The proxy's listening socket and who may hold a connection to it: ``ClientGate`` (with its socket classes
``_Listener`` and ``_Client``), which also serves the app with Hypercorn, and ``fit_to_file_limit``, which sizes the
client cap and the upstream pool to the process's open-file limit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from quart import Quart

from proxy.config import ConfigError, ProxyConfig

log = logging.getLogger(__name__)

BACKLOG = 2048  # the listening socket's queue of connections not yet accepted
RESERVED_FILES = 64  # for the process itself: the listener, logs, the event loop, imports, /metrics reads
MIN_BODY_RATE = 1024  # bytes per second a request body must average once it has had BODY_GRACE seconds
BODY_GRACE = 2.0


def fit_to_file_limit(config: ProxyConfig) -> ProxyConfig:
    """``config`` with ``max_clients`` and ``max_connections`` lowered to what the open-file limit holds (its soft
    limit raised to the hard one first): RESERVED_FILES for the process, a quarter of the rest at most for the
    upstream pool, and of what is left an eighth kept free for client connections being closed (``ClientGate``).
    Clients beyond the limit cost accept errors and starve everyone; said once at start-up."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    usable = max(soft - RESERVED_FILES, 32)
    pool = min(config.max_connections, max(usable // 4, 8))
    clients = min(config.max_clients, max((usable - pool) * 8 // 9, 8))
    if (clients, pool) != (config.max_clients, config.max_connections):
        log.warning("the open-file limit is %d: at most %d client connections (--max-clients %d) and %d upstream "
                    "connections (--max-connections %d); raise the limit (ulimit -n) for more", soft, clients,
                    config.max_clients, pool, config.max_connections)
    return dataclasses.replace(config, max_clients=clients, max_connections=pool)


class _Client(socket.socket):
    """An accepted client connection, counted by its gate until closed."""

    gate: ClientGate | None = None
    address: tuple[str, int] = ("", 0)  # the client's, as the app's requests name it
    in_flight = 0  # requests of it the app is handling (a streamed answer counts until its end)
    last_active = 0.0
    evicted = False  # shut down to make room; closed once its transport sees the end
    accepted = 0.0
    sent = 0  # bytes of requests it sent (heads as the app saw them, bodies as they came)
    body_since: float | None = None  # when the body of its request under way began; None: no body being sent
    body_bytes = 0

    def evictable(self) -> bool:
        """No request under way, or one whose body is still coming: its place may go to another client."""
        return self.in_flight == 0 or self.body_since is not None

    def rate(self, now: float) -> float:
        """Bytes per second it sent since accepted (at least a second counted): the lowest goes first when full."""
        return self.sent / max(now - self.accepted, 1.0)

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
    real client sends its request at once), or is closed if every one has a request under way. The places being
    given up (an eighth more) do not hold new ones back. A connection with no request under way is closed after
    ``client_timeout`` seconds (a request's head must arrive within them: a client that trickles its headers, or
    sits idle, gives its place up), and a body that averages under MIN_BODY_RATE after BODY_GRACE seconds is cut
    (its total time is also bounded, see BODY_TIMEOUT). On Linux the listener defers accepting a connection until
    its client sends something (TCP_DEFER_ACCEPT, up to ``client_timeout``): a silent connection holds no file here,
    and Hypercorn would keep one it was told to close for its keep-alive timeout. The app sees requests only once
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

    def room(self) -> bool:
        """Whether a new connection may be accepted now. At the limit the evictable connection that sent the fewest
        bytes per second is shut down to make room (see the class docstring); the new one is accepted at once while
        the places being given up fit in the headroom, else it waits in the listen queue. If every one has a request
        under way the new one is accepted and closed at once (``admit``)."""
        if self.open >= self.limit + self.headroom:
            return False
        if self.open - self.closing < self.limit:
            return True
        now = time.monotonic()
        victims = [c for c in self.clients.values() if c.evictable()]
        self.crowded += 1
        if self.crowded in (1, 10, 100) or self.crowded % 1000 == 0:
            log.warning("%d client connections open (--max-clients): %s (%d times so far)", self.limit,
                        "closing the slowest sender" if victims else "refusing a new one", self.crowded)
        if not victims:
            return True
        self.evict(min(victims, key=lambda c: (c.rate(now), c.accepted)))
        return self.open < self.limit + self.headroom

    def evict(self, client: _Client) -> None:
        client.evicted = True
        self.closing += 1
        del self.clients[client.address]
        client.end()

    def admit(self, client: _Client, address: Any) -> bool:
        if self.open - self.closing >= self.limit or self.open >= self.limit + self.headroom:
            return False
        client.gate, client.address = self, address[:2]
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
            names = {k.lower() for k, v in headers if k.lower() != b"content-length" or v.strip() not in (b"", b"0")}
            if names & {b"content-length", b"transfer-encoding"}:
                client.body_since, client.body_bytes = time.monotonic(), 0

            async def counted() -> Any:
                message = await receive()
                if message.get("type") == "http.request" and client.body_since is not None:
                    size = len(message.get("body") or b"")
                    client.sent += size
                    client.body_bytes += size
                    if not message.get("more_body"):
                        client.body_since = None
                return message

            client.in_flight += 1
            try:
                await app(scope, counted, send)
            finally:
                client.in_flight -= 1
                client.body_since = None
                client.last_active = time.monotonic()
        return gated

    async def sweep(self) -> None:
        """Close, every fraction of ``client_timeout`` (a second at most), the connections idle (or still sending a
        head) for longer, and those whose body comes slower than MIN_BODY_RATE after BODY_GRACE."""
        while True:
            await asyncio.sleep(min(1.0, self.idle / 4))
            now = time.monotonic()
            cutoff = now - self.idle
            for client in list(self.clients.values()):
                if client.in_flight == 0 and client.last_active < cutoff:
                    client.end()
                elif client.body_since is not None and now - client.body_since > BODY_GRACE and \
                        client.body_bytes < MIN_BODY_RATE * (now - client.body_since):
                    log.info("closed a client connection from %s: its request body came at %.0f bytes/s (at least "
                             "%d)", client.address[0], client.body_bytes / (now - client.body_since), MIN_BODY_RATE)
                    self.evict(client)

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
