"""bench_xpyd's three stacks, each a producer side and a consumer side: ``ours`` (PipeEndpoint + SimpleBuffer, as the
connector links them), ``te`` (raw Transfer Engine reads) and ``socket`` (a plain TCP request/response); and the
entries they move, whose bytes every consumer checks. bench_xpyd.py's docstring says what each does."""

from __future__ import annotations

import queue
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.support import baselines

HOST = "127.0.0.1"
MiB = 1 << 20
TOKENS = 32  # token ids per entry (int64): entry uid u holds u*TOKENS .. u*TOKENS+31
PROBE_BYTES = 4096  # te: the size of the link set-up read
STACKS = ("ours", "te", "socket")


class BenchError(RuntimeError):
    """A run failed (a process died, hung or raised): the message says which and why."""


# ----------------------------------------------------------------------------- the entries
@dataclass(frozen=True)
class Spec:
    """One run: a stack, a shape and its entries; sent to every child as JSON."""

    stack: str
    producers: list[str]  # host:port of each producer (endpoint, listener, or engine name)
    consumers: list[str]
    per_pair: int  # entries each producer holds for each consumer
    entry_bytes: int  # key + value bytes of one entry
    threads: int
    timeout: float  # seconds any phase of a child may wait
    pipe_timeout: float
    staging_bytes: int = 64 * MiB
    huge_pages: bool = True
    log_level: str = "WARNING"

    @property
    def shape(self) -> str:
        return f"{len(self.producers)}x{len(self.consumers)}"

    def uid(self, p: int, c: int, i: int) -> int:
        return (p * len(self.consumers) + c) * self.per_pair + i

    @property
    def words(self) -> int:
        """int32 elements in the key (and in the value)."""
        return self.entry_bytes // 8


def tokens_of(uid: int) -> torch.Tensor:
    return torch.arange(uid * TOKENS, (uid + 1) * TOKENS, dtype=torch.int64)


def seeds_of(uid: int) -> tuple[int, int]:
    """The offsets added to arange in the key and in the value of entry ``uid`` (below 2**30: no int32 overflow)."""
    key = (uid * 2654435761 + 12345) % (1 << 30)
    return key, (key * 40503 + 977) % (1 << 30)


def fill(out: torch.Tensor, seed: int) -> torch.Tensor:
    """``out`` (int32) := arange + seed."""
    torch.arange(out.numel(), dtype=torch.int32, out=out)
    return out.add_(seed)


def make_kv(spec: Spec, uid: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = seeds_of(uid)
    return fill(torch.empty(spec.words, dtype=torch.int32), k), fill(torch.empty(spec.words, dtype=torch.int32), v)


def exact(spec: Spec, uid: int, got: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether (tokens, key, value) are exactly entry ``uid``'s."""
    tokens, key, value = got
    if tokens is None or key is None or value is None or not torch.equal(tokens, tokens_of(uid)):
        return False
    expected = torch.empty(spec.words, dtype=torch.int32)
    for t, seed in zip((key, value), seeds_of(uid), strict=True):
        if t.dtype != torch.int32 or t.shape != (spec.words,) or not torch.equal(t, fill(expected, seed)):
            return False
    return True


def pipe_config(spec: Spec, own: str, peer: str) -> Any:
    """mooncake.json for one process: P2PHANDSHAKE, TCP, timeout, staging_buffer_size and huge_pages from the command
    line, the defaults otherwise (the endpoint's address is given to ``PipeEndpoint`` itself; the URLs only have to be
    valid)."""
    from kv_pipe import MooncakeTransferEngineConfig

    return MooncakeTransferEngineConfig(prefill_url=own, decode_url=peer, metadata_server="P2PHANDSHAKE",
                                        protocol="tcp", timeout=spec.pipe_timeout, staging_buffer_size=spec.staging_bytes,
                                        huge_pages=spec.huge_pages)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# ----------------------------------------------------------------------------- stack: ours
class OursProducer:
    def __init__(self, spec: Spec, index: int) -> None:
        from kv_lookup_buffer import SimpleBuffer
        from kv_pipe import PipeEndpoint

        self.spec = spec
        host, port = split_address(spec.producers[index])
        entries = len(spec.consumers) * spec.per_pair
        self.endpoint = PipeEndpoint(pipe_config(spec, spec.producers[index], spec.consumers[0]), host, port,
                                     kv_rank=0, start=False)
        self.buffer = SimpleBuffer(None, None, entries * (spec.entry_bytes + TOKENS * 8) + MiB, role="producer",
                                   timeout=spec.pipe_timeout)
        self.endpoint.on_link(self._on_link)
        self.endpoint.start()  # only now: a consumer linking before on_link was set would not be served
        for c in range(len(spec.consumers)):
            for i in range(spec.per_pair):
                uid = spec.uid(index, c, i)
                self.buffer.insert(tokens_of(uid), None, *make_kv(spec, uid), None, copy=False)

    def _on_link(self, pipe: Any) -> None:
        if pipe.channel == "kv":
            self.buffer.serve_link(pipe)

    def info(self) -> dict[str, Any]:
        return {}

    def left(self) -> dict[str, Any]:
        stats = self.buffer.stats
        return {"left": len(self.buffer), "served": stats["hits"], "misses": stats["misses"],
                "malformed": stats["malformed"]}

    def close(self) -> None:
        self.buffer.close()
        self.endpoint.close()


class OursConsumer:
    def __init__(self, spec: Spec, index: int) -> None:
        from kv_pipe import PipeEndpoint

        self.spec = spec
        host, port = split_address(spec.consumers[index])
        self.endpoint = PipeEndpoint(pipe_config(spec, spec.producers[0], spec.consumers[index]), host, port, kv_rank=1)
        self.buffers: list[Any] = [None] * len(spec.producers)

    def connect(self, p: int, info: dict[str, Any]) -> None:
        from kv_lookup_buffer import SimpleBuffer

        pipe = self.endpoint.link(self.spec.producers[p], "kv")
        self.buffers[p] = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer", timeout=self.spec.pipe_timeout)

    def probe(self, p: int) -> None:
        got = self.buffers[p].drop_select(torch.tensor([-1]), None, timeout=self.spec.pipe_timeout)
        if got[2] is not None:
            raise BenchError(f"a request that matches nothing got an entry from producer {p}")

    def fetch(self, p: int, i: int, uid: int) -> tuple[torch.Tensor | None, ...]:
        tokens, _, key, value, _ = self.buffers[p].drop_select(tokens_of(uid), None, timeout=self.spec.pipe_timeout)
        return tokens, key, value

    def release(self) -> None:
        """Close the buffers (each tells its producer), keep the endpoint until the producers are gone."""
        for buf in self.buffers:
            if buf is not None:
                buf.close()

    def close(self) -> None:
        self.release()
        self.endpoint.close()


# ----------------------------------------------------------------------------- stack: raw Transfer Engine
class TEProducer:
    def __init__(self, spec: Spec, index: int) -> None:
        self.spec = spec
        self.engine = baselines.start_engine(spec.producers[index], BenchError)
        entries = len(spec.consumers) * spec.per_pair
        self.region = torch.empty(PROBE_BYTES + entries * spec.entry_bytes, dtype=torch.uint8)
        self.region[:PROBE_BYTES].fill_(7)
        for c in range(len(spec.consumers)):
            for i in range(spec.per_pair):
                uid = spec.uid(index, c, i)
                start = PROBE_BYTES + (c * spec.per_pair + i) * spec.entry_bytes
                kv = self.region[start:start + spec.entry_bytes].view(torch.int32)
                for half, seed in zip(kv.chunk(2), seeds_of(uid), strict=True):
                    fill(half, seed)
        baselines.register(self.engine, self.region, BenchError)

    def info(self) -> dict[str, Any]:
        return {"session": f"{HOST}:{self.engine.get_rpc_port()}", "base": self.region.data_ptr()}

    def left(self) -> dict[str, Any]:
        return {"left": None, "served": None, "misses": None}  # one-sided reads: nothing is taken

    def close(self) -> None:
        self.engine.unregister_memory(self.region.data_ptr())


class TEConsumer:
    def __init__(self, spec: Spec, index: int) -> None:
        self.spec, self.index = spec, index
        self.engine = baselines.start_engine(spec.consumers[index], BenchError)
        # never touched before the reads: fresh pages, as ours receives into fresh tensors
        self.region = torch.empty(len(spec.producers) * spec.per_pair * spec.entry_bytes, dtype=torch.uint8)
        self.probe_buf = torch.zeros(len(spec.producers) * PROBE_BYTES, dtype=torch.uint8)
        baselines.register(self.engine, self.region, BenchError)
        baselines.register(self.engine, self.probe_buf, BenchError)
        self.peers: list[dict[str, Any]] = [{}] * len(spec.producers)

    def connect(self, p: int, info: dict[str, Any]) -> None:
        self.peers[p] = info

    def _read(self, p: int, local: int, remote: int, nbytes: int) -> None:
        baselines.read(self.engine, self.peers[p]["session"], local, remote, nbytes, self.spec.pipe_timeout, BenchError)

    def probe(self, p: int) -> None:
        self._read(p, self.probe_buf.data_ptr() + p * PROBE_BYTES, self.peers[p]["base"], PROBE_BYTES)

    def fetch(self, p: int, i: int, uid: int) -> tuple[torch.Tensor | None, ...]:
        n = self.spec.entry_bytes
        mine = self.region[(p * self.spec.per_pair + i) * n:(p * self.spec.per_pair + i + 1) * n]
        remote = self.peers[p]["base"] + PROBE_BYTES + (self.index * self.spec.per_pair + i) * n
        self._read(p, mine.data_ptr(), remote, n)
        key, value = mine.view(torch.int32).chunk(2)
        return tokens_of(uid), key, value  # token ids are not transferred: a one-sided read has no request

    def release(self) -> None:
        pass

    def close(self) -> None:
        for buf in (self.region, self.probe_buf):
            self.engine.unregister_memory(buf.data_ptr())


# ----------------------------------------------------------------------------- stack: plain socket
REQUEST = struct.Struct("!qq")  # op, entry uid
ANSWER = struct.Struct("!qqq")  # status (0 hit, 1 miss), token bytes, bytes of the key (= of the value)
OP_PROBE, OP_FETCH = 0, 1


class SocketProducer:
    def __init__(self, spec: Spec, index: int) -> None:
        self.spec = spec
        self.entries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for c in range(len(spec.consumers)):
            for i in range(spec.per_pair):
                uid = spec.uid(index, c, i)
                self.entries[uid] = (tokens_of(uid), *make_kv(spec, uid))
        self.lock = threading.Lock()
        self.counts = {"served": 0, "misses": 0}
        self.closed = threading.Event()
        self.listener = socket.create_server(split_address(spec.producers[index]), backlog=128)
        self.listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True, name="socket-accept").start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self.spec.timeout)
            baselines.nodelay(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="socket-serve").start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQUEST.size)
        with conn:
            while not self.closed.is_set():
                try:
                    baselines.recv_into(conn, memoryview(head))
                except (ConnectionError, OSError):
                    return  # the consumer closed it (or the run is over)
                op, uid = REQUEST.unpack(head)
                with self.lock:
                    entry = self.entries.pop(uid, None) if op == OP_FETCH else None
                    self.counts["misses" if entry is None else "served"] += 1
                if entry is None:
                    conn.sendall(ANSWER.pack(1, 0, 0))
                    continue
                tokens, key, value = entry
                conn.sendall(ANSWER.pack(0, tokens.numel() * 8, key.numel() * 4))
                for t in entry:
                    conn.sendall(baselines.as_bytes(t))

    def info(self) -> dict[str, Any]:
        return {}

    def left(self) -> dict[str, Any]:
        with self.lock:
            return {"left": len(self.entries), **self.counts}

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


class SocketConsumer:
    def __init__(self, spec: Spec, index: int) -> None:
        self.spec = spec
        self.pools: list[queue.LifoQueue[socket.socket]] = [queue.LifoQueue() for _ in spec.producers]
        self.all: list[socket.socket] = []

    def connect(self, p: int, info: dict[str, Any]) -> None:
        for _ in range(self.spec.threads):  # one connection per fetch thread: requests in flight together
            sock = baselines.connect(split_address(self.spec.producers[p]), self.spec.pipe_timeout)
            self.all.append(sock)
            self.pools[p].put(sock)

    def _ask(self, p: int, op: int, uid: int) -> tuple[torch.Tensor | None, ...]:
        sock = self.pools[p].get(timeout=self.spec.pipe_timeout)
        try:
            sock.sendall(REQUEST.pack(op, uid))
            head = bytearray(ANSWER.size)
            baselines.recv_into(sock, memoryview(head))
            status, token_bytes, half = ANSWER.unpack(head)
            if status != 0:
                return None, None, None
            got = (torch.empty(token_bytes // 8, dtype=torch.int64), torch.empty(half // 4, dtype=torch.int32),
                   torch.empty(half // 4, dtype=torch.int32))
            for t in got:
                baselines.recv_into(sock, baselines.as_bytes(t))
            return got
        finally:
            self.pools[p].put(sock)

    def probe(self, p: int) -> None:
        if self._ask(p, OP_PROBE, -1)[0] is not None:
            raise BenchError(f"a probe got an entry from producer {p}")

    def fetch(self, p: int, i: int, uid: int) -> tuple[torch.Tensor | None, ...]:
        return self._ask(p, OP_FETCH, uid)

    def release(self) -> None:
        pass

    def close(self) -> None:
        for sock in self.all:
            sock.close()


PRODUCERS: dict[str, Callable[[Spec, int], Any]] = {"ours": OursProducer, "te": TEProducer, "socket": SocketProducer}
CONSUMERS: dict[str, Callable[[Spec, int], Any]] = {"ours": OursConsumer, "te": TEConsumer, "socket": SocketConsumer}
