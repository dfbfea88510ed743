"""A real ``mooncake_master`` (Mooncake Store's master, shipped in the Transfer Engine wheel) on 127.0.0.1 for the
tests, the benchmarks and the demo: free ports, its own log, stopped afterwards; restartable on the same ports
(clients reconnect), and frozen or killed on purpose for the fault tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from pathlib import Path

from harness.ports import HOST, free_port
from harness.processes import ServerUnavailable, kill, start, stop, wheel_binary

ATTEMPTS = 3


def _listening(port: int, host: str, prefix: list[str]) -> bool:
    """Whether ``host:port`` takes a connection (from inside the host ``prefix`` runs commands on, if given)."""
    if prefix:
        probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1.0).close()"
        return subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, timeout=20).returncode == 0
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class MooncakeMaster:
    """``address``: what mooncake.json's ``master_server_address`` takes. ``args``: more of the master's flags
    (e.g. ``--default_kv_lease_ttl=...``). ``host``/``prefix``: run it on another host (harness/netns.py)."""

    def __init__(self, work: Path, args: list[str] | None = None, host: str = HOST,
                 prefix: list[str] | None = None) -> None:
        self.work, self.args, self.host, self.prefix = work, args or [], host, prefix or []
        self.rpc_port = self.metrics_port = 0
        self.proc = None
        self.log = work / "mooncake_master.log"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def start(self) -> MooncakeMaster:
        error: ServerUnavailable | None = None
        fresh = not self.rpc_port
        for _ in range(ATTEMPTS if fresh else 1):
            if fresh:
                here = HOST if self.prefix else self.host  # a fresh namespace has every port free
                self.rpc_port, self.metrics_port = free_port(here), free_port(here)
            cmd = [*self.prefix, wheel_binary("mooncake_master"), f"--rpc_port={self.rpc_port}", f"--rpc_address={self.host}",
                   f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}", *self.args]
            try:
                self.proc = start(cmd, self.log, lambda: _listening(self.rpc_port, self.host, self.prefix),
                                  "mooncake_master")
                return self
            except ServerUnavailable as e:  # e.g. a port taken meanwhile
                error = e
        raise error  # type: ignore[misc]

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def kill(self) -> None:
        """Gone at once, with every object it knew of (clients keep their segments, the next master knows none)."""
        if self.proc is not None:
            kill(self.proc)
            self.proc = None

    def restart(self) -> None:
        """Killed, then started again on the same ports."""
        self.kill()
        self.start()

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.thaw()
        self.stop()
