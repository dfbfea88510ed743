"""Free ports on 127.0.0.1 for the servers and pipes a test or a benchmark starts next."""

from __future__ import annotations

import os
import random
import socket

from harness.processes import ServerUnavailable

HOST = "127.0.0.1"


def _port_range() -> tuple[int, int]:
    """Below the kernel's ephemeral range: a port picked here is not handed out meanwhile to another process's outgoing
    connection or to a server binding port 0 (vLLM's own sockets do). ``MKV_TEST_PORTS=first-last`` narrows it, so
    that test runs side by side (scripts/test.sh) never pick the same port; each pytest-xdist worker takes a slice of
    its own (a port is only checked free when picked: two workers picking the same one would meet each other's
    servers)."""
    first, last = (int(n) for n in os.environ.get("MKV_TEST_PORTS", "20000-31999").split("-"))
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and workers.isdigit() and int(workers) > 1:
        size = (last + 1 - first) // int(workers)
        first += int(worker[2:]) * size
        last = first + size - 1
    return first, last + 1


_PORTS = _port_range()
_handed_out: set[int] = set()


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now and not handed out before by this process, for a server started next."""
    for _ in range(1000):
        port = random.randrange(*_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise ServerUnavailable(f"no free port in {_PORTS} on {host}")


def port_pair() -> int:
    """A port p with p and p + 1 free (the pipes of tensor-parallel ranks 0 and 1)."""
    for _ in range(100):
        base = free_port()
        if base + 1 < _PORTS[1]:
            with socket.socket() as a, socket.socket() as b:
                try:
                    a.bind((HOST, base))
                    b.bind((HOST, base + 1))
                except OSError:
                    continue
            return base
    raise RuntimeError("no two consecutive free ports found")
