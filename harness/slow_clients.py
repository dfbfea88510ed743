"""Slow HTTP clients, for the proxy's tests and benchmarks: connections that hold a place and send (almost) nothing.

``SlowClients(port, count)``: a third silent, a third sending a request head that never ends, a third a complete head
whose body comes a byte every half second; a connection the server closes is opened again (as an attacker would),
all from a thread of its own until ``stop()``."""

from __future__ import annotations

import socket
import threading

from harness.ports import HOST

SLOW_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
SLOW_BODY = SLOW_HEAD + b"Content-Length: 100000\r\n\r\n"


def closed(sock: socket.socket) -> bool:
    """Whether the other side closed ``sock`` (reads what is waiting, without blocking)."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


class SlowClients:
    def __init__(self, port: int, count: int) -> None:
        self.port, self.reopened, self.failed = port, 0, 0
        kinds = [None, SLOW_HEAD, SLOW_BODY]
        self.socks: list[tuple[bytes | None, socket.socket | None]] = []
        for i in range(count):
            opening = kinds[i * 3 // count]
            self.socks.append((opening, self.connect(opening)))
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.dribble, daemon=True)
        self.thread.start()

    def connect(self, opening: bytes | None) -> socket.socket | None:
        try:
            sock = socket.create_connection((HOST, self.port), timeout=5)
            if opening:
                sock.sendall(opening)
            return sock
        except OSError:
            self.failed += 1
            return None

    def dribble(self) -> None:
        while not self.stopped.wait(0.5):
            for i, (opening, sock) in enumerate(self.socks):
                try:
                    if sock is None:
                        raise ConnectionResetError
                    if opening == SLOW_BODY:
                        sock.send(b" ")
                    elif closed(sock):
                        raise ConnectionResetError
                except OSError:
                    if sock is not None:
                        sock.close()
                    self.socks[i] = (opening, self.connect(opening))
                    self.reopened += 1

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)
        for _, sock in self.socks:
            if sock is not None:
                sock.close()
