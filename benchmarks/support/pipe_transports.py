"""The four ways bench_pipe moves bytes from a sender process to a receiver process: ``ours`` and ``ours_out``
(MooncakePipe, received fresh or into a reused buffer), ``raw_te`` (the raw Transfer Engine in the pipe's write
pattern) and ``socket`` (a plain TCP socket); and the plumbing the two processes share (a token per transfer, the
sender's timestamp, its errors). bench_pipe.py's docstring says what each times."""

from __future__ import annotations

import multiprocessing.queues as mpq
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch

from benchmarks.support import baselines, procs
from harness.ports import HOST, free_port
from kv_pipe import MooncakePipe, MooncakeTransferEngineConfig

STEP_TIMEOUT = 120.0  # seconds one transfer (or the sender's start-up) may take before the run is declared stuck


def pattern(size: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes (the same in every process), so the receiver can check what arrived."""
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))


# ----------------------------------------------------------------------------- the two processes' plumbing
@dataclass
class Link:
    """What the receiver (parent) and the sender (child) share."""

    go: mpq.Queue[int | None] = field(default_factory=procs.SPAWN.Queue)  # receiver -> sender: a token per transfer, None = stop
    done: mpq.Queue[float] = field(default_factory=procs.SPAWN.Queue)  # sender -> receiver: raw_te write durations
    errors: mpq.Queue[str] = field(default_factory=procs.SPAWN.Queue)  # sender -> receiver: its traceback if it failed
    stamp: Any = field(default_factory=lambda: procs.SPAWN.RawValue("d", 0.0))  # perf_counter() right before a send


class SenderFailed(RuntimeError):
    pass


def check_sender_errors(link: Link) -> None:
    """Raise ``SenderFailed`` with the sender's traceback if it reported an error."""
    try:
        error = link.errors.get_nowait()
    except queue.Empty:
        return
    raise SenderFailed(error)


def check_sender(proc: BaseProcess, link: Link) -> None:
    """Raise ``SenderFailed`` if the sender reported an error or died."""
    check_sender_errors(link)
    if not proc.is_alive():
        try:  # it may have reported just before exiting
            raise SenderFailed(link.errors.get(timeout=1.0))
        except queue.Empty:
            raise SenderFailed(f"the sender process exited with code {proc.exitcode}") from None


def get_from_sender(q: mpq.Queue[Any], proc: BaseProcess, link: Link, timeout: float = STEP_TIMEOUT) -> Any:
    return procs.get(q, timeout, lambda: check_sender(proc, link), "the sender")


# ----------------------------------------------------------------------------- senders (child process)
class Sender(Protocol):
    """One transport's sending end; ``send`` returns the transfer's duration if only the sender can know it."""

    def prepare(self, size: int) -> None: ...

    def send(self, size: int) -> float | None: ...

    def close(self) -> None: ...


class PipeSender:
    def __init__(self, setup: dict[str, Any]) -> None:
        self.pipe = MooncakePipe(local_rank=0, kv_rank=0, config=MooncakeTransferEngineConfig(**setup["config"]))
        self.src = torch.empty(0, dtype=torch.uint8)

    def prepare(self, size: int) -> None:
        self.src = torch.empty(0, dtype=torch.uint8)  # free the previous size's tensor before making the next
        self.src = pattern(size)

    def send(self, size: int) -> float | None:
        self.pipe.send_tensor(self.src)
        return None

    def close(self) -> None:
        self.pipe.close()


class RawTESender:
    """The pipe's write pattern on the bare engine: ``chunk_size`` writes, ``max_chunks_in_flight`` in flight."""

    def __init__(self, setup: dict[str, Any]) -> None:
        self.engine = baselines.start_engine(f"{HOST}:{free_port()}")
        self.peer, self.dst_addr = setup["session"], setup["dst_addr"]
        self.chunk, self.inflight = setup["chunk_size"], setup["max_chunks_in_flight"]
        self.src = torch.empty(setup["max_size"], dtype=torch.uint8)
        baselines.register(self.engine, self.src)

    def prepare(self, size: int) -> None:
        self.src[:size].copy_(pattern(size))

    def send(self, size: int) -> float | None:
        t0 = time.perf_counter()
        baselines.write_chunked(self.engine, self.peer, self.src.data_ptr(), self.dst_addr, size, self.chunk,
                                self.inflight, STEP_TIMEOUT)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.unregister_memory(self.src.data_ptr())


class SocketSender:
    def __init__(self, setup: dict[str, Any]) -> None:
        self.sock = baselines.connect((HOST, setup["port"]), STEP_TIMEOUT)
        self.src = torch.empty(setup["max_size"], dtype=torch.uint8)
        self.view = baselines.as_bytes(self.src)

    def prepare(self, size: int) -> None:
        self.src[:size].copy_(pattern(size))

    def send(self, size: int) -> float | None:
        self.sock.sendall(self.view[:size])
        return None

    def close(self) -> None:
        self.sock.close()


SENDERS: dict[str, Callable[[dict[str, Any]], Sender]] = {
    "ours": PipeSender, "ours_out": PipeSender, "raw_te": RawTESender, "socket": SocketSender}


def spin() -> None:
    """A Python thread that never waits, as vLLM's engine loop while a request waits for its KV (``--busy``): every
    other thread of the process then waits for the GIL on each wake-up, up to the 5 ms switch interval."""
    while True:
        time.monotonic()


def start_spinner() -> None:
    threading.Thread(target=spin, name="busy-spinner", daemon=True).start()


def sender_main(transport: str, iterations: dict[int, int], link: Link, setup: dict[str, Any], busy: bool = False) -> None:
    """The child process: one transport, ``iterations[size]`` transfers of each size in order; each transfer starts
    when the receiver's token arrives."""
    if busy:
        start_spinner()
    try:
        sender = SENDERS[transport](setup)
        try:
            for size, count in iterations.items():
                sender.prepare(size)
                for _ in range(count):
                    if link.go.get(timeout=STEP_TIMEOUT) is None:
                        return
                    link.stamp.value = time.perf_counter()
                    elapsed = sender.send(size)
                    if elapsed is not None:
                        link.done.put(elapsed)
            link.go.get(timeout=STEP_TIMEOUT)  # the receiver's "stop": it has everything, we may tear down
        finally:
            sender.close()
    except BaseException as e:  # the receiver turns this into the transport's error
        link.errors.put(procs.failure(f"sender ({transport})", e))


# ----------------------------------------------------------------------------- receivers (this process)
class Receiver(Protocol):
    """One transport's receiving end. ``setup`` is what the sender needs to reach it; ``receive`` waits for one
    transfer and returns its one-way latency; ``received`` is the last transfer's bytes, for the check."""

    setup: dict[str, Any]

    def receive(self, size: int, proc: BaseProcess, link: Link) -> float: ...

    def received(self, size: int) -> torch.Tensor: ...

    def close(self) -> None: ...


class PipeReceiver:
    def __init__(self, config: dict[str, Any], max_size: int) -> None:
        self.pipe = MooncakePipe(local_rank=0, kv_rank=1, config=MooncakeTransferEngineConfig(**config))
        self.setup = {"config": config}
        self.last: torch.Tensor | None = None

    def receive(self, size: int, proc: BaseProcess, link: Link) -> float:
        self.last = None  # never hold two big results at once
        received = self.pipe.recv_tensor()
        done = time.perf_counter()
        if received is None or received.numel() != size:
            raise RuntimeError(f"expected {size} bytes, received {None if received is None else received.numel()}")
        self.last = received
        return done - link.stamp.value

    def received(self, size: int) -> torch.Tensor:
        assert self.last is not None
        return self.last

    def close(self) -> None:
        self.last = None
        print(f"  results from the pool: {self.pipe.endpoint.results.stats}", flush=True)
        self.pipe.close()


class PipeIntoBufferReceiver(PipeReceiver):
    def __init__(self, config: dict[str, Any], max_size: int) -> None:
        super().__init__(config, max_size)
        self.buffer = torch.ones(max_size, dtype=torch.uint8)  # touched once, reused for every transfer

    def receive(self, size: int, proc: BaseProcess, link: Link) -> float:
        received = self.pipe.recv_tensor(out=self.buffer)
        done = time.perf_counter()
        if received is None or received.numel() != size or received.data_ptr() != self.buffer.data_ptr():
            raise RuntimeError(f"expected {size} bytes in the reused buffer")
        self.last = received
        return done - link.stamp.value

    def close(self) -> None:
        super().close()
        self.buffer = torch.empty(0)


class RawTEReceiver:
    def __init__(self, config: dict[str, Any], max_size: int) -> None:
        self.engine = baselines.start_engine(f"{HOST}:{free_port()}")
        self.dst = torch.zeros(max_size, dtype=torch.uint8)
        baselines.register(self.engine, self.dst)
        self.setup = {"session": f"{HOST}:{self.engine.get_rpc_port()}", "dst_addr": self.dst.data_ptr(),
                      "max_size": max_size, "chunk_size": config["chunk_size"],
                      "max_chunks_in_flight": config["max_chunks_in_flight"]}

    def receive(self, size: int, proc: BaseProcess, link: Link) -> float:
        return float(get_from_sender(link.done, proc, link))

    def received(self, size: int) -> torch.Tensor:
        return self.dst[:size]

    def close(self) -> None:
        self.engine.unregister_memory(self.dst.data_ptr())


class SocketReceiver:
    def __init__(self, config: dict[str, Any], max_size: int) -> None:
        port = free_port(HOST)
        self.listener = socket.create_server((HOST, port))
        self.listener.settimeout(STEP_TIMEOUT)
        self.setup = {"port": port, "max_size": max_size}
        self.conn: socket.socket | None = None
        self.dst = torch.empty(max_size, dtype=torch.uint8)
        self.view = baselines.as_bytes(self.dst)

    def _accept(self) -> socket.socket:
        if self.conn is None:
            self.conn = baselines.nodelay(self.listener.accept()[0])
            self.conn.settimeout(STEP_TIMEOUT)
        return self.conn

    def receive(self, size: int, proc: BaseProcess, link: Link) -> float:
        baselines.recv_into(self._accept(), self.view[:size])
        return time.perf_counter() - link.stamp.value

    def received(self, size: int) -> torch.Tensor:
        return self.dst[:size]

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


RECEIVERS: dict[str, Callable[[dict[str, Any], int], Receiver]] = {
    "ours": PipeReceiver, "ours_out": PipeIntoBufferReceiver, "raw_te": RawTEReceiver, "socket": SocketReceiver,
}
