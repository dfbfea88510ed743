"""Two hosts on one machine, for the two-host tests: a producer host and a consumer host, each a network namespace of
its own, joined by a software wire that can delay, drop and cut their frames (this machine's kernel has no netem).

    root namespace: the proxy, the test, the wire (a process)
    producer host: kv 10.231.0.1 -- veth -- wire -- veth -- consumer host: kv 10.231.0.2
    each host: mg -- veth -- root namespace (10.231.1.0/30, 10.231.2.0/30)

Each host has two links: ``kv`` to the other host, through the wire (the KV, the pipes' side channel, etcd), and a
management link to the root namespace (HTTP from the proxy and the test; ``host.http``). The wire forwards whole
frames between its two veth ends with AF_PACKET sockets, keeping the kernel's offload header (PACKET_VNET_HDR), so
segmentation and checksums stay the receiving kernel's job; a "frame" it drops may be a TCP super-segment.

Root only (namespaces and veths); ``unavailable()`` says why not where it cannot run.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import random
import re
import select
import shutil
import socket
import subprocess
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15
_PACKET_OUTGOING = 4
_FRAME = 1 << 17  # a GSO super-frame with its offload header fits


@functools.cache
def unavailable() -> str | None:
    """Why two hosts cannot be made here (None: they can): tried once, with a namespace made and removed."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the suite as root to include the two-host tests)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"mkv{os.getpid()}x"
    try:
        _ip("netns", "add", probe)
        _ip("link", "add", "mkvprobe0", "type", "veth", "peer", "name", "eth0", "netns", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return f"this machine does not let us make network namespaces and veths: {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
        subprocess.run(["ip", "link", "del", "mkvprobe0"], capture_output=True, timeout=20)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address on the KV link (``kv``) and on the management link (``http``)."""

    netns: str
    kv: str
    http: str

    def prefix(self) -> list[str]:
        """Runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]

    def listening(self) -> list[tuple[str, int]]:
        """(address, port) of every listening TCP socket on this host."""
        out = subprocess.run([*self.prefix(), "cat", "/proc/net/tcp", "/proc/net/tcp6"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        found = []
        for line in out.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:  # 0A: LISTEN
                continue
            addr, port = fields[1].rsplit(":", 1)
            if len(addr) == 8:
                ip = socket.inet_ntoa(bytes.fromhex(addr)[::-1])
            else:
                raw = bytes.fromhex(addr)
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append((ip, int(port, 16)))
        return found


class Wire:
    """The forwarder between the two hosts' KV links, in a process of its own. ``delay`` (seconds, each way),
    ``loss`` (a fraction of frames dropped at random, each way), ``cut()`` / ``heal()``; ``cut_after(nbytes)``: cut
    once ``nbytes`` more have gone from the producer host to the consumer host (from now). ``bytes_to_consumer`` /
    ``bytes_to_producer``: what it forwarded each way."""

    def __init__(self, producer_end: str, consumer_end: str) -> None:
        ctx = mp.get_context("spawn")
        self._delay, self._loss = ctx.Value("d", 0.0, lock=False), ctx.Value("d", 0.0, lock=False)
        self._cut, self._cut_at = ctx.Value("b", 0, lock=False), ctx.Value("q", -1, lock=False)
        self._sent = ctx.Array("q", 2, lock=False)  # bytes forwarded: [to the consumer, to the producer]
        self._ready = ctx.Event()
        self._proc = ctx.Process(target=_forward, name="two-hosts-wire", daemon=True,
                                 args=(producer_end, consumer_end, self._delay, self._loss, self._cut, self._cut_at,
                                       self._sent, self._ready))
        self._proc.start()
        deadline = time.monotonic() + 20
        while not self._ready.wait(0.1):
            if not self._proc.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the wire between the two hosts did not start (its error is above)")

    def set(self, delay: float = 0.0, loss: float = 0.0) -> None:
        self._delay.value, self._loss.value = delay, loss

    def cut(self) -> None:
        self._cut.value = 1

    def cut_after(self, nbytes: int) -> None:
        self._cut_at.value = self._sent[0] + nbytes

    def heal(self) -> None:
        self._cut_at.value = -1
        self._cut.value = 0

    @property
    def is_cut(self) -> bool:
        return bool(self._cut.value)

    @property
    def bytes_to_consumer(self) -> int:
        return self._sent[0]

    @property
    def bytes_to_producer(self) -> int:
        return self._sent[1]

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5)


def _forward(producer_end: str, consumer_end: str, delay, loss, cut, cut_at, sent, ready) -> None:
    """The wire's loop: frames read on one end go out of the other one, ``delay`` s later, unless dropped."""
    socks = []
    for name in (producer_end, consumer_end):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        s.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        s.bind((name, 0))
        s.setblocking(False)
        socks.append(s)
    queues: list[deque[tuple[float, bytes]]] = [deque(), deque()]  # [to the consumer, to the producer]
    ready.set()
    while True:
        now = time.monotonic()
        due = [q[0][0] for q in queues if q]
        timeout = max(0.0, min(due) - now) if due else 0.1
        readable, _, _ = select.select(socks, [], [], timeout)
        for s in readable:
            way = 0 if s is socks[0] else 1
            for _ in range(64):
                try:
                    frame, addr = s.recvfrom(_FRAME)
                except BlockingIOError:
                    break
                if addr[2] == _PACKET_OUTGOING:  # what this process sent out of that end
                    continue
                if cut_at.value >= 0 and sent[0] >= cut_at.value:
                    cut.value, cut_at.value = 1, -1
                if cut.value or (loss.value and random.random() < loss.value):
                    continue
                queues[way].append((time.monotonic() + delay.value, frame))
        now = time.monotonic()
        for way, q in enumerate(queues):
            out = socks[1 - way]
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                if cut.value:
                    continue  # a cut also drops what was on the wire
                try:
                    out.send(frame)
                except OSError:
                    continue  # the far end's queue is full, or it went down: the frame is lost
                sent[way] += len(frame) - 10  # less the offload header


def _remove_stale() -> None:
    """Hosts left by a run that was killed (their root-namespace addresses would clash with the new ones)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        match = re.fullmatch(r"mkv(\d+)[pdx]", name)
        if match and not os.path.exists(f"/proc/{match[1]}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Host, Host, Wire]]:
    """The producer host, the consumer host and the wire between them; everything removed afterwards."""
    _remove_stale()
    tag = str(os.getpid())
    hosts = (Host(f"mkv{tag}p", "10.231.0.1", "10.231.1.2"), Host(f"mkv{tag}d", "10.231.0.2", "10.231.2.2"))
    ends = (f"mkv{tag}pw", f"mkv{tag}dw")
    wire = None
    try:
        for i, (host, end) in enumerate(zip(hosts, ends, strict=True)):
            _ip("netns", "add", host.netns)
            _ip("link", "set", "lo", "up", netns=host.netns)
            _ip("link", "add", end, "type", "veth", "peer", "name", "kv", "netns", host.netns)
            _ip("link", "set", end, "up")
            _ip("addr", "add", f"{host.kv}/24", "dev", "kv", netns=host.netns)
            _ip("link", "set", "kv", "up", netns=host.netns)
            mgmt = f"mkv{tag}{'pd'[i]}m"
            _ip("link", "add", mgmt, "type", "veth", "peer", "name", "mg", "netns", host.netns)
            _ip("addr", "add", f"10.231.{i + 1}.1/30", "dev", mgmt)
            _ip("link", "set", mgmt, "up")
            _ip("addr", "add", f"{host.http}/30", "dev", "mg", netns=host.netns)
            _ip("link", "set", "mg", "up", netns=host.netns)
            _ip("route", "add", "default", "via", f"10.231.{i + 1}.1", netns=host.netns)
        wire = Wire(*ends)
        yield hosts[0], hosts[1], wire
    finally:
        if wire is not None:
            wire.close()
        for host in hosts:  # its veths go with it, and their root-namespace ends
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True, timeout=20)
