"""An endpoint's side-channel listener: the accept loop, a thread per connection for its handshake, and the flood
control that keeps connections which never finish their handshake from holding up a real peer's.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

from kv_pipe.addresses import join_host_port
from kv_pipe.errors import ConfigError
from kv_pipe.handshake import Tally

logger = logging.getLogger(__name__)
EVICTED = Tally()  # unfinished handshakes closed to make room

MAX_HANDSHAKES = 64  # unfinished handshakes at once; a newer connection closes the oldest (see _begins)
MAX_HANDSHAKES_PER_HOST = 16  # of them from one host group
BACKLOG = 128


class Acceptor:
    """Listens on ``host:port``; each connection accepted runs ``handshake(sock, host, who)`` in a thread of its own
    (``host``: the connection's IP, ``who``: ``host:port``), which calls ``ended`` once the peer proved itself.
    ``loop`` is the accept thread's body; it returns once ``closed`` is set."""

    def __init__(self, host: str, port: int, closed: threading.Event,
                 handshake: Callable[[socket.socket, str, str], None]) -> None:
        self.port = port
        self._closed = closed
        self._handshake = handshake
        self._lock = threading.Lock()
        self._handshakes: dict[str, list[socket.socket]] = {}  # unfinished handshakes by host group, oldest first
        try:
            self._listener = socket.create_server((host, port), backlog=BACKLOG)
        except OSError as e:
            raise ConfigError(f"cannot listen on {join_host_port(host, port)} for the pipe's side channel "
                              f"({e.strerror}); another process holds the port - pick other ports in mooncake.json"
                              ) from None
        self._listener.settimeout(0.2)

    def loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.05)
                continue
            host, who = str(addr[0]), join_host_port(str(addr[0]), addr[1])
            for evicted in self._begins(sock, host):
                seen = EVICTED.add()
                logger.log(logging.WARNING if EVICTED.tells(seen) else logging.DEBUG, "closed an unfinished "
                           "side-channel handshake to make room for a newer connection (too many at once from %s; %d "
                           "such so far)", _host_group(host), seen)
                _shut(evicted)
            try:
                threading.Thread(target=self._handshake, args=(sock, host, who), daemon=True,
                                 name=f"kv-pipe-hello-{self.port}").start()
            except RuntimeError:  # no thread to be had: refuse this one, keep accepting
                self.ended(sock, host)
                sock.close()

    def _begins(self, sock: socket.socket, host: str) -> list[socket.socket]:
        """Count a handshake from ``host`` in; returns the unfinished handshakes to close to make room for it: the
        oldest of its host group when the group has ``MAX_HANDSHAKES_PER_HOST`` (one host's flood leaves room for
        the others: all of 127/8 or an IPv6 /64 is one host), else the oldest of all at ``MAX_HANDSHAKES`` (a flood
        must not pile up threads). A real peer finishes in milliseconds, so only a silent or slow one loses its
        place, and a flood cannot hold a place for long."""
        group = _host_group(host)
        with self._lock:
            pending = self._handshakes.setdefault(group, [])
            evict = [pending.pop(0)] if len(pending) >= MAX_HANDSHAKES_PER_HOST else []
            if not evict and sum(map(len, self._handshakes.values())) >= MAX_HANDSHAKES:
                fullest = max(self._handshakes.values(), key=len)
                evict = [fullest.pop(0)]
            pending.append(sock)
            return evict

    def ended(self, sock: socket.socket, host: str) -> None:
        """``sock``'s handshake is over (either way): it no longer takes a place. Idempotent."""
        group = _host_group(host)
        with self._lock:
            pending = self._handshakes.get(group, [])
            if sock in pending:
                pending.remove(sock)
            if not pending:
                self._handshakes.pop(group, None)

    def close(self) -> None:
        self._listener.close()


def _host_group(host: str) -> str:
    """The flood limit's unit: one IPv4 address; all of 127.0.0.0/8 (one machine); an IPv6 /64."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if ip.version == 4:
        return "127.0.0.0/8" if ip.is_loopback else str(ip)
    if ip.ipv4_mapped is not None:
        return _host_group(str(ip.ipv4_mapped))
    return str(ipaddress.ip_network(f"{ip}/64", strict=False))


def _shut(sock: socket.socket) -> None:
    """End a connection another thread is reading: its read fails at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
