"""The proxy's listening socket and who may hold a connection to it: ``ClientGate`` (with its socket classes
``_Listener`` and ``_Client``), which also serves the app with Hypercorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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


class _Client(socket.socket):
    """An accepted client connection, counted by its gate until closed."""

    gate: ClientGate | None = None
    address: tuple[str, int] = ("", 0)  # the client's, as the app's requests name it
    in_flight = 0  # requests of it the app is handling (a streamed answer counts until its end)
    last_active = 0.0
    evicted = False  # shut down to make room; closed once its transport sees the end

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
    proxy's file descriptors (a new one takes the place of the oldest with no request under way, or is closed if
    every one has a request under way), and a connection with no request under way is closed after
    ``client_timeout`` seconds (a request's head must arrive within them: a client that trickles
    its headers, or sits idle, gives its place up; the body has as long, see BODY_TIMEOUT). The app sees requests
    only once their head is complete, so it marks what a connection is doing (``wrap``)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.limit, self.idle = config.max_clients, config.client_timeout
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.listener = _Listener(family, socket.SOCK_STREAM)
        self.listener.gate = self
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((config.host, config.port))
        except OSError as error:
            self.listener.close()
            raise ConfigError(f"cannot listen on {config.host}:{config.port}: {error.strerror}") from None
        self.listener.listen(BACKLOG)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.clients: dict[tuple[str, int], _Client] = {}  # by peer address: what the app's requests name
        self.open = 0  # connections accepted and not closed yet (evicted ones included): file descriptors held
        self.closing = 0  # of them, evicted and not closed yet
        self.crowded = 0  # times the limit was reached

    def room(self) -> bool:
        """Whether a new connection may be accepted now. At the limit the oldest connection with no request under way
        (idle, or still sending its head: a real client sends its request at once) is shut down to make room, and
        the new one waits in the listen queue until it is closed; if every one has a request under way the new one
        is accepted and closed at once (``admit``)."""
        if self.open < self.limit:
            return True
        if self.closing:
            return False
        idle = [c for c in self.clients.values() if c.in_flight == 0]
        self.crowded += 1
        if self.crowded in (1, 10, 100) or self.crowded % 1000 == 0:
            log.warning("%d client connections open (--max-clients): %s (%d times so far)", self.limit,
                        "closing the oldest idle one" if idle else "refusing a new one", self.crowded)
        if not idle:
            return True
        oldest = min(idle, key=lambda c: c.last_active)
        oldest.evicted = True
        self.closing += 1
        del self.clients[oldest.address]
        oldest.end()
        return False

    def admit(self, client: _Client, address: Any) -> bool:
        if self.open >= self.limit:
            return False
        client.gate, client.address, client.last_active = self, address[:2], time.monotonic()
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
        """The ASGI app, marking each request on its connection while the app handles it."""
        async def gated(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            client = self.clients.get(tuple(scope.get("client") or ())[:2]) if scope["type"] == "http" else None
            if client is None:
                await app(scope, receive, send)
                return
            client.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                client.in_flight -= 1
                client.last_active = time.monotonic()
        return gated

    async def sweep(self) -> None:
        """Close, every fraction of ``client_timeout``, the connections idle (or still sending a head) for longer."""
        while True:
            await asyncio.sleep(min(1.0, self.idle / 4))
            cutoff = time.monotonic() - self.idle
            for client in list(self.clients.values()):
                if client.in_flight == 0 and client.last_active < cutoff:
                    client.end()

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
