"""The baselines our pipe is measured against: the raw Transfer Engine and a plain TCP socket.

Raw Transfer Engine: P2PHANDSHAKE, TCP; one-sided writes or reads between registered regions, each batch awaited as
the pipe's ``MooncakeEngine.wait`` does it (polled, with naps). Plain socket: TCP_NODELAY, ``sendall`` of a tensor's
memory, ``recv_into`` a preallocated one.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


# ----------------------------------------------------------------------------- raw Transfer Engine
def start_engine(address: str, error: type[Exception] = RuntimeError) -> Any:
    """A Transfer Engine named ``address`` (host:port), P2PHANDSHAKE over TCP."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(address, "P2PHANDSHAKE", "tcp", "") != 0:
        raise error(f"the Transfer Engine failed to initialize as {address} (its log above says why)")
    return engine


def register(engine: Any, buf: torch.Tensor, error: type[Exception] = RuntimeError) -> None:
    if engine.register_memory(buf.data_ptr(), buf.numel() * buf.element_size()) != 0:
        raise error(f"registering {buf.numel() * buf.element_size()} bytes with the Transfer Engine failed")


def wait_transfer(engine: Any, batch: int, timeout: float, what: str, error: type[Exception] = RuntimeError) -> None:
    """Wait for a raw Transfer Engine batch as the pipe's ``MooncakeEngine.wait`` does (the binding's blocking wait
    spins a core at full speed): 64 polls, then 50 us naps between polls. ``what`` names the transfer in the
    ``error`` raised when it fails or is not done within ``timeout`` seconds."""
    polls, deadline = 0, time.monotonic() + timeout
    while (status := engine.transfer_check_status(batch)) == 0:
        polls += 1
        if polls > 64:
            if time.monotonic() > deadline:
                raise error(f"{what} did not complete within {timeout} s")
            time.sleep(0.00005)
    if status != 1:
        raise error(f"{what} failed (status {status})")


def write_chunked(engine: Any, session: str, src: int, dst: int, size: int, chunk: int, inflight: int,
                  timeout: float) -> None:
    """The pipe's write pattern on the bare engine: ``size`` bytes from ``src`` to ``session``'s ``dst`` in ``chunk``
    writes (one per batch), at most ``inflight`` of them in flight."""
    pending: deque[tuple[int, int]] = deque()  # (batch id, bytes) of the writes in flight
    for pos in range(0, size, chunk):
        length = min(chunk, size - pos)
        batch = engine.batch_transfer_async_write(session, [src + pos], [dst + pos], [length])
        if not batch:
            raise RuntimeError(f"could not start a {length}-byte write to {session}")
        pending.append((batch, length))
        if len(pending) >= inflight:
            done, nbytes = pending.popleft()
            wait_transfer(engine, done, timeout, f"a {nbytes}-byte write to {session}")
    while pending:
        done, nbytes = pending.popleft()
        wait_transfer(engine, done, timeout, f"a {nbytes}-byte write to {session}")


def read(engine: Any, session: str, local: int, remote: int, nbytes: int, timeout: float,
         error: type[Exception] = RuntimeError) -> None:
    """One ``batch_transfer_async_read`` of ``nbytes`` from ``session``'s ``remote`` into ``local``, awaited."""
    batch = engine.batch_transfer_async_read(session, [local], [remote], [nbytes])
    if not batch:
        raise error(f"could not start a {nbytes}-byte read from {session}")
    wait_transfer(engine, batch, timeout, f"a {nbytes}-byte read from {session}", error)


# ----------------------------------------------------------------------------- plain socket
def nodelay(sock: socket.socket) -> socket.socket:
    """``sock`` with TCP_NODELAY on (small messages go out at once)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def connect(address: tuple[str, int], timeout: float | None) -> socket.socket:
    """A TCP_NODELAY connection to ``address``; ``timeout`` None: blocking calls without a deadline (no poll before
    each call)."""
    return nodelay(socket.create_connection(address, timeout=timeout))


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's memory as bytes, for ``sendall`` and ``recv_into`` without a copy."""
    return memoryview(t.numpy()).cast("B")
