"""XpYd at the pipe/buffer layer (no vLLM): P producer processes x C consumer processes on 127.0.0.1.

Every process is a real, separate process (multiprocessing "spawn") with its own Transfer Engine, laid out as the
connector does it (``kv_connector/links.py``):

- producer: one ``PipeEndpoint`` on its own address and one ``SimpleBuffer(None, None, size, role="producer")`` that
  serves every consumer link (``endpoint.on_link`` -> ``buffer.serve_link`` for channel "kv", set before
  ``endpoint.start()``). It inserts ``per pair`` entries for each consumer (distinct token ids per (producer,
  consumer, i); key and value int32 tensors filled with an arange pattern derived from those ids, handed over with
  ``insert(copy=False)``), reports ready, and keeps serving until every entry was taken.
- consumer: one ``PipeEndpoint``, and per producer ``SimpleBuffer(pipe, pipe, size, role="consumer")`` on
  ``pipe = endpoint.link(producer, "kv")``. It sets up its links (one thread per producer, concurrently), waits for the
  harness's "go", then ``drop_select``s every entry it expects from every producer with ``--threads`` worker threads
  (default 4, the connector's ``load_concurrency``) that take (producer, i) items round-robin over the producers, so
  up to 4 requests are in flight per consumer whatever the shape.

The same harness, process layout, entries, threads and checks run two baselines ("ours vs raw TE vs a plain
socket"):

- ``te``: raw ``mooncake.engine.TransferEngine`` (P2PHANDSHAKE, TCP). Each producer holds all its entries in one
  registered region and publishes its session and base address; a consumer reads each entry (key and value, adjacent)
  with one ``batch_transfer_async_read`` into its own registered, never-touched region (fresh pages, as ours receives
  into fresh tensors), polled with ``transfer_check_status`` and 50 us naps (as ``kv_pipe`` polls its writes; the
  engine's blocking wait spins a core). No request protocol, nothing is taken: the lower bound of a pull.
- ``socket``: each producer listens on a plain TCP socket; each consumer opens ``--threads`` connections to each
  producer; a request is 16 bytes (op, entry id), the answer a 24-byte header then tokens, key and value bytes
  (``sendall`` of the tensors' memory -> ``recv_into`` fresh tensors). The producer pops the entry (taken once).

Timing (``time.monotonic``: CLOCK_MONOTONIC, one clock for every process on Linux):

- link set-up: per (consumer, producer) link, the time to make the link and get the answer to a first request that
  matches nothing (ours: ``endpoint.link`` + ``SimpleBuffer`` + ``drop_select([-1])``, i.e. both side-channel
  connections, both handshakes, the rings; te: the first 4 KiB read from the producer, i.e. the engine's handshake
  and segment lookup; socket: ``--threads`` connects + one round trip). All links of a run are set up at once (every
  consumer, every producer), once every process is up, before the timed phase. "later RTT": the median of 5 more such
  requests on the open link, 1 s later (ours makes spare staging rings again in the background after a link set-up;
  the timed phase starts after that second too).
- per-consumer GB/s: the key+value bytes it received / (its last answer - its first request).
- aggregate GB/s: the key+value bytes all consumers received / (last answer of any consumer - first request of any).
- fetch ms: median time of one request (request sent -> entry received), over every request of the run.
- nothing lost: every consumer verifies, after the timed phase, that each entry it received carries the token ids
  it asked for and the exact key and value pattern of (producer, consumer, i); it counts misses, wrong bytes, entries
  received twice and failed requests; each producer then reports the entries it still holds and how many it served.

Same bytes in every shape: ``--entries`` is the number of entries per (producer, consumer) pair in the largest shape;
smaller shapes move the same total with more entries per pair (1x1 with ``--entries 8`` next to 4x4: 128 entries on
one pair). Settings are identical in every column: mooncake.json defaults (staging 64 MiB, chunk 4 MiB, 8 chunks in
flight, timeout ``--pipe-timeout``), ``--threads`` fetch threads per consumer, one torch thread, the connector's Python
thread switch interval (0.1 ms), no CPU pinning (on this 2-core box 8 processes share 2 cores).

Every wait has a deadline: a child that dies fails the run at once with its exit code (and its traceback, if it
could send one), a phase that overruns ``--timeout`` fails it naming who is late (fetch threads stuck in a call dump
their stacks to stderr first), leftover children are killed, and children exit by themselves if the harness dies.

``--staging-mib`` and ``--no-huge-pages`` change those two mooncake.json keys for ours (e.g. to see what link set-up
and fresh result memory cost here).

Run (from the repository root; the default takes ~1.5-2 minutes)::

    .venv/bin/python benchmarks/bench_xpyd.py
    .venv/bin/python benchmarks/bench_xpyd.py --entries 2 --entry-mib 4 --shapes 1x1,4x4 --stacks ours   # quick
    .venv/bin/python benchmarks/bench_xpyd.py --shapes 1x1,1x4,4x1,4x4 --out benchmarks/results/bench_xpyd.md

Prints a markdown table and writes ``--out`` (markdown) and the figures next to it (same name, ``.json``). Exits
with 1 if any run lost, duplicated or corrupted an entry, or if a process died or hung (it is killed).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Read by the Transfer Engine when it starts, in this process and in every spawned child (which re-imports this file).
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from harness.ports import free_port  # noqa: E402

logger = logging.getLogger("bench_xpyd")

HOST = "127.0.0.1"
MiB = 1 << 20
TOKENS = 32  # token ids per entry (int64): entry uid u holds u*TOKENS .. u*TOKENS+31
PROBE_BYTES = 4096  # te: the size of the link set-up read
STACKS = ("ours", "te", "socket")
SWITCH_INTERVAL = 0.0001  # the connector's gil_switch_interval default
SETTLE = 1.0  # seconds between setting up the links and timing anything else on them
RTT_PROBES = 5
HARNESS_MARGIN = 15.0  # seconds the harness waits for a phase beyond the children's own deadline (--timeout)
_ctx = mp.get_context("spawn")


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
        from kv_pipe.endpoint import PipeEndpoint

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
        from kv_pipe.endpoint import PipeEndpoint

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
def start_engine(address: str) -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(address, "P2PHANDSHAKE", "tcp", "") != 0:
        raise BenchError(f"the Transfer Engine failed to initialize as {address} (its log above says why)")
    return engine


def register(engine: Any, buf: torch.Tensor) -> None:
    if engine.register_memory(buf.data_ptr(), buf.numel()) != 0:
        raise BenchError(f"registering {buf.numel()} bytes with the Transfer Engine failed")


class TEProducer:
    def __init__(self, spec: Spec, index: int) -> None:
        self.spec = spec
        self.engine = start_engine(spec.producers[index])
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
        register(self.engine, self.region)

    def info(self) -> dict[str, Any]:
        return {"session": f"{HOST}:{self.engine.get_rpc_port()}", "base": self.region.data_ptr()}

    def left(self) -> dict[str, Any]:
        return {"left": None, "served": None, "misses": None}  # one-sided reads: nothing is taken

    def close(self) -> None:
        self.engine.unregister_memory(self.region.data_ptr())


class TEConsumer:
    def __init__(self, spec: Spec, index: int) -> None:
        self.spec, self.index = spec, index
        self.engine = start_engine(spec.consumers[index])
        # never touched before the reads: fresh pages, as ours receives into fresh tensors
        self.region = torch.empty(len(spec.producers) * spec.per_pair * spec.entry_bytes, dtype=torch.uint8)
        self.probe_buf = torch.zeros(len(spec.producers) * PROBE_BYTES, dtype=torch.uint8)
        register(self.engine, self.region)
        register(self.engine, self.probe_buf)
        self.peers: list[dict[str, Any]] = [{}] * len(spec.producers)

    def connect(self, p: int, info: dict[str, Any]) -> None:
        self.peers[p] = info

    def _read(self, p: int, local: int, remote: int, nbytes: int) -> None:
        session = self.peers[p]["session"]
        batch = self.engine.batch_transfer_async_read(session, [local], [remote], [nbytes])
        if not batch:
            raise BenchError(f"could not start a {nbytes}-byte read from {session}")
        common.wait_transfer(self.engine, batch, self.spec.pipe_timeout, f"a {nbytes}-byte read from {session}",
                             BenchError)

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


def recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


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
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="socket-serve").start()

    def _serve(self, conn: socket.socket) -> None:
        head = bytearray(REQUEST.size)
        with conn:
            while not self.closed.is_set():
                try:
                    recv_into(conn, memoryview(head))
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
                    conn.sendall(as_bytes(t))

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
            sock = socket.create_connection(split_address(self.spec.producers[p]), timeout=self.spec.pipe_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.all.append(sock)
            self.pools[p].put(sock)

    def _ask(self, p: int, op: int, uid: int) -> tuple[torch.Tensor | None, ...]:
        sock = self.pools[p].get(timeout=self.spec.pipe_timeout)
        try:
            sock.sendall(REQUEST.pack(op, uid))
            head = bytearray(ANSWER.size)
            recv_into(sock, memoryview(head))
            status, token_bytes, half = ANSWER.unpack(head)
            if status != 0:
                return None, None, None
            got = (torch.empty(token_bytes // 8, dtype=torch.int64), torch.empty(half // 4, dtype=torch.int32),
                   torch.empty(half // 4, dtype=torch.int32))
            for t in got:
                recv_into(sock, as_bytes(t))
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


# ----------------------------------------------------------------------------- child processes
class Mailbox:
    """A child's side of the harness: messages in (JSON strings on ``inbox``), reports out (on ``outbox``)."""

    def __init__(self, role: str, index: int, inbox: Any, outbox: Any, timeout: float) -> None:
        self.role, self.index, self.inbox, self.outbox, self.timeout = role, index, inbox, outbox, timeout

    def wait(self, kind: str) -> dict[str, Any]:
        try:
            msg = json.loads(self.inbox.get(timeout=self.timeout))
        except queue.Empty:
            raise TimeoutError(f"no '{kind}' from the harness within {self.timeout:.0f} s") from None
        if msg["kind"] != kind:
            raise BenchError(f"expected '{kind}' from the harness, got '{msg['kind']}'")
        return msg

    def report(self, kind: str, **data: Any) -> None:
        self.outbox.put(json.dumps({"role": self.role, "index": self.index, "kind": kind, **data}))


def watch_parent(parent: int) -> None:
    """Exit at once if the harness dies (its children must not linger holding ports and memory)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def child_main(role: str, index: int, spec_json: str, inbox: Any, outbox: Any, parent: int) -> None:
    """Entry point of every child: runs the producer or consumer protocol, reports any failure with its traceback."""
    watch_parent(parent)
    spec = Spec(**json.loads(spec_json))
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s {role}{index} %(name)s %(levelname)s %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL)
    torch.set_num_threads(1)
    # the harness's own deadlines (spec.timeout per phase) come first and name the culprit; this one only ends a
    # child the harness forgot
    mail = Mailbox(role, index, inbox, outbox, 3 * spec.timeout + 60)
    try:
        (run_producer if role == "producer" else run_consumer)(spec, index, mail)
    except BaseException as e:
        mail.report("error", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        time.sleep(0.5)  # let the queue's feeder thread deliver it
        raise SystemExit(1) from None


def run_producer(spec: Spec, index: int, mail: Mailbox) -> None:
    start = time.monotonic()
    side = PRODUCERS[spec.stack](spec, index)
    try:
        mail.report("ready", info=side.info(), seconds=time.monotonic() - start)
        mail.wait("finish")
        mail.report("result", **side.left())
        mail.wait("close")
    finally:
        side.close()


def run_consumer(spec: Spec, index: int, mail: Mailbox) -> None:
    start = time.monotonic()
    side = CONSUMERS[spec.stack](spec, index)
    try:
        mail.report("started", seconds=time.monotonic() - start)
        infos = mail.wait("producers")["infos"]
        mail.report("linked", links=set_up_links(side, infos, spec.timeout))
        mail.wait("go")
        records, failures = fetch_all(side, spec, index)
        mail.report("result", **check(spec, index, records, failures))
        mail.wait("close")
        side.release()
        mail.report("released")
        mail.wait("exit")
    finally:
        side.close()


def run_threads(targets: list[Callable[[], None]], timeout: float, what: str) -> None:
    threads = [threading.Thread(target=t, daemon=True, name=f"{what}-{k}") for k, t in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        faulthandler.dump_traceback(all_threads=True)  # where they are stuck, on stderr
        raise TimeoutError(f"{what}: threads still running after {timeout:.0f} s (their stacks are on stderr)")


def set_up_links(side: Any, infos: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """Make each producer link (one thread per producer, all at once) and time it: link + first request answered
    (set-up), and the same request right after (second). Then, once ``SETTLE`` seconds let background work of the
    set-up end (ours: spare staging rings made again), the median of ``RTT_PROBES`` more (later RTT)."""
    links: list[dict[str, Any]] = [{} for _ in infos]

    def link(p: int) -> None:
        t0 = time.monotonic()
        side.connect(p, infos[p])
        side.probe(p)
        t1 = time.monotonic()
        side.probe(p)
        links[p] = {"producer": p, "setup_ms": (t1 - t0) * 1e3, "second_ms": (time.monotonic() - t1) * 1e3}

    errors: list[str] = []

    def guarded(p: int) -> Callable[[], None]:
        def run() -> None:
            try:
                link(p)
            except Exception as e:  # reported below with the producer it concerns
                errors.append(f"link to producer {p}: {type(e).__name__}: {e}")
        return run

    run_threads([guarded(p) for p in range(len(infos))], timeout, "link")
    if errors:
        raise BenchError("; ".join(errors))
    time.sleep(SETTLE)
    for p, link_stats in enumerate(links):
        rtts = []
        for _ in range(RTT_PROBES):
            t0 = time.monotonic()
            side.probe(p)
            rtts.append((time.monotonic() - t0) * 1e3)
        link_stats["rtt_ms"] = statistics.median(rtts)
    return links


@dataclass
class Record:
    p: int
    i: int
    start: float
    end: float
    got: tuple[torch.Tensor | None, ...] | None = None  # None: the request failed
    error: str = ""


def fetch_all(side: Any, spec: Spec, c: int) -> tuple[list[Record], list[str]]:
    """Every entry this consumer expects, by ``spec.threads`` threads taking (producer, i) round-robin."""
    items = deque((p, i) for i in range(spec.per_pair) for p in range(len(spec.producers)))
    lock = threading.Lock()
    records: list[Record] = []

    def worker() -> None:
        while True:
            with lock:
                if not items:
                    return
                p, i = items.popleft()
            start = time.monotonic()
            try:
                record = Record(p, i, start, 0.0, side.fetch(p, i, spec.uid(p, c, i)))
            except Exception as e:  # counted as a failed request, the others go on
                record = Record(p, i, start, 0.0, None, f"entry {i} from producer {p}: {type(e).__name__}: {e}")
            record.end = time.monotonic()
            with lock:
                records.append(record)

    run_threads([worker] * spec.threads, spec.timeout, "fetch")
    return records, [r.error for r in records if r.error]


def check(spec: Spec, c: int, records: list[Record], failures: list[str]) -> dict[str, Any]:
    """Verify every answer (after the timed phase) and summarise this consumer's run."""
    counts: Counter[str] = Counter()
    seen: Counter[int] = Counter()
    nbytes = 0
    for r in records:
        if r.got is None:
            counts["failed"] += 1
            continue
        tokens, key, value = r.got
        if key is None:
            counts["missing"] += 1
            continue
        nbytes += sum(t.numel() * t.element_size() for t in (key, value) if t is not None)
        if tokens is not None and tokens.numel():
            seen[int(tokens[0]) // TOKENS] += 1
        counts["exact" if exact(spec, spec.uid(r.p, c, r.i), r.got) else "wrong"] += 1
    asked = {(r.p, r.i) for r in records}
    return {"exact": counts["exact"], "wrong": counts["wrong"], "missing": counts["missing"],
            "failed": counts["failed"], "duplicates": sum(n - 1 for n in seen.values() if n > 1),
            "not_asked": len(spec.producers) * spec.per_pair - len(asked), "bytes": nbytes,
            "first": min(r.start for r in records), "last": max(r.end for r in records),
            "fetch_ms": [(r.end - r.start) * 1e3 for r in records], "errors": failures[:5]}


# ----------------------------------------------------------------------------- the harness
@dataclass
class Child:
    role: str
    index: int
    proc: Any
    inbox: Any
    done: bool = False  # exited as planned


@dataclass
class Run:
    """One (stack, shape): spawns the children and walks them through the phases; every wait has a deadline and a
    dead child fails the run at once, with its own error if it sent one."""

    spec: Spec
    outbox: Any = field(default_factory=_ctx.Queue)
    children: list[Child] = field(default_factory=list)
    backlog: list[dict[str, Any]] = field(default_factory=list)

    def start(self) -> None:
        spec_json = json.dumps(dataclasses.asdict(self.spec))
        for role, n in (("producer", len(self.spec.producers)), ("consumer", len(self.spec.consumers))):
            for index in range(n):
                inbox = _ctx.Queue()
                proc = _ctx.Process(target=child_main, args=(role, index, spec_json, inbox, self.outbox, os.getpid()),
                                    daemon=True, name=f"xpyd-{role}{index}")
                proc.start()
                self.children.append(Child(role, index, proc, inbox))

    def of(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role]

    def send(self, role: str, kind: str, **data: Any) -> None:
        for child in self.of(role):
            child.inbox.put(json.dumps({"kind": kind, **data}))

    def collect(self, role: str, kind: str, timeout: float) -> list[dict[str, Any]]:
        """Each ``role`` child's ``kind`` report, in index order (reports of other phases that arrive meanwhile are
        kept for their own ``collect``)."""
        want = len(self.of(role))
        got: dict[int, dict[str, Any]] = {}
        for msg in [m for m in self.backlog if m["role"] == role and m["kind"] == kind]:
            self.backlog.remove(msg)
            got[msg["index"]] = msg
        deadline = time.monotonic() + timeout
        while len(got) < want:
            try:
                msg = json.loads(self.outbox.get(timeout=0.5))
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    late = sorted(set(range(want)) - set(got))
                    raise BenchError(f"{self.spec.stack} {self.spec.shape}: {role}s {late} did not report '{kind}' "
                                     f"within {timeout:.0f} s") from None
                continue
            self._raise_if_error(msg)
            if msg["role"] == role and msg["kind"] == kind:
                got[msg["index"]] = msg
            else:
                self.backlog.append(msg)
        return [got[i] for i in range(want)]

    def _raise_if_error(self, msg: dict[str, Any]) -> None:
        if msg["kind"] == "error":
            raise BenchError(f"{self.spec.stack} {self.spec.shape}: {msg['role']} {msg['index']} failed: "
                             f"{msg['error']}\n{msg['trace']}")

    def _check_alive(self) -> None:
        for child in self.children:
            code = child.proc.exitcode
            if code is None or child.done:
                continue
            try:  # it may have reported why just before it died
                self._raise_if_error(json.loads(self.outbox.get(timeout=1.0)))
            except queue.Empty:
                pass
            hint = " (SIGKILL: out of memory, or killed by hand)" if code == -9 else ""
            raise BenchError(f"{self.spec.stack} {self.spec.shape}: {child.role} {child.index} (pid {child.proc.pid}) "
                             f"exited with code {code}{hint} in the middle of the run")

    def stop(self, clean: bool) -> None:
        """After a clean run: consumers close their buffers first (they tell the producers), then the producers
        close, then the consumers' endpoints, so that nobody logs a peer that went away; whoever is still there after
        30 s is killed. After a failure: everyone is told to close and killed after 5 s."""
        deadline = time.monotonic() + (30.0 if clean else 5.0)
        self.send("consumer", "close")
        if clean:
            try:
                self.collect("consumer", "released", deadline - time.monotonic())
            except BenchError as e:
                logger.warning("shutting down anyway: %s", e)
        for role, kind in (("producer", "close"), ("consumer", "exit")):
            self.send(role, kind)
            for child in self.of(role):
                child.proc.join(max(0.1, deadline - time.monotonic()))
                child.done = child.proc.exitcode == 0
        for child in self.children:
            if child.proc.is_alive():
                logger.warning("killing %s %d (pid %d): it did not exit", child.role, child.index, child.proc.pid)
                child.proc.kill()
                child.proc.join(5)


def run_once(spec: Spec) -> dict[str, Any]:
    """One (stack, shape) end to end; the children are always gone when this returns."""
    run = Run(spec)
    t0 = time.monotonic()
    wait = spec.timeout + HARNESS_MARGIN  # a child's own deadline of a phase (spec.timeout) ends first: its report is clearer
    ok = False
    try:
        run.start()
        # every process is up (and the producers hold their entries) before any link is made: link set-up is then
        # not timed against other processes' start-up
        ready = run.collect("producer", "ready", wait)
        run.collect("consumer", "started", wait)
        logger.info("%s %s: all processes up in %.1f s (each producer inserted %d entries)", spec.stack, spec.shape,
                    time.monotonic() - t0, len(spec.consumers) * spec.per_pair)
        for child in run.of("consumer"):
            child.inbox.put(json.dumps({"kind": "producers", "infos": [r["info"] for r in ready]}))
        linked = run.collect("consumer", "linked", wait)
        run.send("consumer", "go")
        consumers = run.collect("consumer", "result", wait)
        run.send("producer", "finish")
        producers = run.collect("producer", "result", wait)
        ok = True
    finally:
        run.stop(clean=ok)
    result = summarize(spec, linked, consumers, producers)
    result["seconds"] = time.monotonic() - t0
    return result


def summarize(spec: Spec, linked: list[dict[str, Any]], consumers: list[dict[str, Any]],
              producers: list[dict[str, Any]]) -> dict[str, Any]:
    links = [link for c in linked for link in c["links"]]
    first, last = min(c["first"] for c in consumers), max(c["last"] for c in consumers)
    total = sum(c["bytes"] for c in consumers)
    expected = len(spec.producers) * len(spec.consumers) * spec.per_pair
    lost = {k: sum(c[k] for c in consumers) for k in ("wrong", "missing", "failed", "duplicates", "not_asked")}
    lefts = [p["left"] for p in producers if p["left"] is not None]
    served = [p["served"] for p in producers if p["served"] is not None]
    lost["left_in_producers"] = sum(lefts)
    exact_n = sum(c["exact"] for c in consumers)
    intact = exact_n == expected and not any(lost.values()) and (not served or sum(served) == expected)
    return {
        "stack": spec.stack, "shape": spec.shape, "producers": len(spec.producers), "consumers": len(spec.consumers),
        "per_pair": spec.per_pair, "entries": expected, "bytes": total, "exact": exact_n, "lost": lost,
        "served": sum(served) if served else None, "intact": intact,
        "setup_ms": [round(link["setup_ms"], 2) for link in links], "rtt_ms": [round(link["rtt_ms"], 3) for link in links],
        "second_ms": [round(link["second_ms"], 3) for link in links],
        "fetch_ms_p50": statistics.median(ms for c in consumers for ms in c["fetch_ms"]),
        "per_consumer_gbps": [c["bytes"] / (c["last"] - c["first"]) / 1e9 for c in consumers],
        "aggregate_gbps": total / (last - first) / 1e9, "window_s": last - first,
        "errors": [e for c in consumers for e in c["errors"]][:5],
    }


# ----------------------------------------------------------------------------- the report
COLUMNS = """\
What each column times (CLOCK_MONOTONIC, shared by all processes; every run is a fresh set of processes):

- **link set-up ms**: per (consumer, producer) link, from making the link to the answer of a first request that
  matches nothing (ours: `endpoint.link` + `SimpleBuffer` + `drop_select([-1])`: both side-channel connections and
  handshakes, the staging rings; te: the engine's first 4 KiB read from that producer: handshake and segment lookup;
  socket: `--threads` TCP connects + one round trip). All links of a run are set up at the same time, once every
  process is up. Median / max over the run's links. Ours allocates, prefaults and registers a staging ring
  (`staging_buffer_size`, `--staging-mib`) for the inbound direction on each side of each link, and a spare one
  again in the background. **later RTT ms**: the same request on the open link 1 s later (median of 5 per link,
  median over links); the timed phase starts after that second too.
- **fetch ms p50**: one request, from sending it to having the whole entry (key + value), median over the run.
- **per-consumer GB/s**: key+value bytes a consumer received / (its last answer - its first request), one figure per
  consumer. **aggregate GB/s**: key+value bytes all consumers received / (the last answer of any consumer - the first
  request of any); link set-up and the producers' inserts are not in it. **x 1x1**: aggregate / the same stack's 1x1.
- **nothing lost**: every entry was received exactly once with the exact token ids, key and value bytes of its
  (producer, consumer, i) pattern, no request missed or failed, and (ours, socket) each producer served exactly its
  entries and holds none at the end. te reads one-sidedly: nothing is taken, so nothing can be left.

Stacks: **ours** = `PipeEndpoint` + `SimpleBuffer` (`serve_link` on the producer, a buffer per producer link on the
consumer); **te** = raw Transfer Engine reads (`batch_transfer_async_read`, polled), no request protocol, the lower
bound of a pull; **socket** = a plain TCP request/response per entry into fresh tensors, `--threads` connections per
producer. Identical in every run: `--threads` fetch threads per consumer taking (producer, i) round-robin over the
producers, mooncake.json defaults, one torch thread, a 0.1 ms Python switch interval, no CPU pinning.
"""


def fmt_row(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    setup, rtt = r["setup_ms"], r["rtt_ms"]
    lost = r["lost"]
    intact = (f"yes ({r['exact']}/{r['entries']} exact)" if r["intact"] else
              "NO: " + ", ".join(f"{k} {v}" for k, v in lost.items() if v) + f"; exact {r['exact']}/{r['entries']}"
              + (f"; served {r['served']}" if r["served"] is not None else ""))
    scale = f"{r['aggregate_gbps'] / base['aggregate_gbps']:.2f}" if base else "-"
    return (f"| {r['stack']} | {r['shape']} | {r['per_pair']} | {r['bytes'] / MiB:.0f} | "
            f"{statistics.median(setup):.1f} / {max(setup):.1f} | {statistics.median(rtt):.2f} | "
            f"{r['fetch_ms_p50']:.1f} | {' '.join(f'{g:.2f}' for g in r['per_consumer_gbps'])} | "
            f"**{r['aggregate_gbps']:.2f}** | {scale} | {intact} |")


def comparison(results: list[dict[str, Any]], stacks: list[str], shapes: list[str]) -> list[str]:
    if "ours" not in stacks or len(stacks) < 2:
        return []
    by = {(r["stack"], r["shape"]): r for r in results}
    others = [s for s in stacks if s != "ours"]
    lines = ["", "| shape | " + " | ".join(f"{s} GB/s" for s in stacks) + " | "
             + " | ".join(f"ours / {s}" for s in others) + " |",
             "|---|" + "---:|" * (len(stacks) + len(others))]
    for shape in shapes:
        row = [by[(s, shape)]["aggregate_gbps"] for s in stacks]
        ours = by[("ours", shape)]["aggregate_gbps"]
        ratios = [ours / by[(s, shape)]["aggregate_gbps"] for s in others]
        lines.append(f"| {shape} | " + " | ".join(f"{g:.2f}" for g in row) + " | "
                     + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return lines


def script_state() -> str:
    """Whether this script itself is committed as it is (the commit names the rest of the tree)."""
    out = subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/bench_xpyd.py"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    return "untracked" if out.startswith("??") else "modified" if out else "as committed"


def report(args: argparse.Namespace, results: list[dict[str, Any]], load: tuple[list[float], list[float]]) -> str:
    import mooncake  # only for its version

    try:
        from importlib.metadata import version

        te_version = version("mooncake-transfer-engine-non-cuda")
    except Exception:
        te_version = getattr(mooncake, "__version__", "unknown")
    lines = [common.header("XpYd at the pipe/buffer layer: P producers x C consumers on 127.0.0.1 (bench_xpyd.py)"),
             f"Python {sys.version.split()[0]}, torch {torch.__version__}, Mooncake Transfer Engine {te_version}; "
             f"bench_xpyd.py {script_state()}. Load average (1/5/15 min) before {load[0][0]:.2f}/{load[0][1]:.2f}/"
             f"{load[0][2]:.2f}, after {load[1][0]:.2f}/{load[1][1]:.2f}/{load[1][2]:.2f}. {os.cpu_count()} cores "
             f"shared by all {max(int(s.split('x')[0]) + int(s.split('x')[1]) for s in args.shapes)} processes of the "
             "largest shape (no pinning): expect the aggregate to be bounded by the CPU, not the links.", "",
             f"Entries of {args.entry_bytes / MiB:g} MiB (key + value, int32) and {TOKENS} token ids each; "
             f"{args.total} entries ({args.total * args.entry_bytes / MiB:.0f} MiB) per run in every shape; "
             f"{args.threads} fetch threads per consumer; ours with staging_buffer_size {args.staging_mib} MiB, "
             f"huge_pages {str(args.huge_pages).lower()}, the other "
             "mooncake.json keys at their defaults.", "",
             "| stack | shape PxC | entries / pair | MiB moved | link set-up ms p50 / max | later RTT ms | fetch ms p50 "
             "| per-consumer GB/s | aggregate GB/s | x 1x1 | nothing lost |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    base = {r["stack"]: r for r in results if r["shape"] == "1x1"}
    for r in results:
        lines.append(fmt_row(r, base.get(r["stack"])))
    lines += comparison(results, args.stacks, args.shapes)
    errors = [f"- {r['stack']} {r['shape']}: {e}" for r in results for e in r["errors"]]
    if errors:
        lines += ["", "Request errors (first 5 per run):", *errors]
    lines += ["", COLUMNS]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            p, c = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r}: write PxC, e.g. 4x4") from None
        if p < 1 or c < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r}: at least one producer and one consumer")
        shapes.append((p, c))
    return shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=8,
                        help="entries per (producer, consumer) pair in the largest shape; every shape moves the same "
                             "total (default 8)")
    parser.add_argument("--entry-mib", type=float, default=16.0, help="key + value MiB per entry (default 16)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x1,4x4"),
                        help="comma-separated PxC (default 1x1,4x4; e.g. 1x1,1x4,4x1,4x4)")
    parser.add_argument("--stacks", default=",".join(STACKS),
                        help=f"comma-separated, run in this order for each shape (default {','.join(STACKS)})")
    parser.add_argument("--threads", type=int, default=4, help="fetch threads per consumer (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds each phase of a run may take before the run fails (default 120)")
    parser.add_argument("--pipe-timeout", type=float, default=30.0, help="mooncake.json timeout (default 30)")
    parser.add_argument("--staging-mib", type=int, default=64,
                        help="ours: mooncake.json staging_buffer_size in MiB (default 64, the default of mooncake.json)")
    parser.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                        help="ours: mooncake.json huge_pages false (default true, the default of mooncake.json)")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "bench_xpyd.md",
                        help="markdown results; the figures go next to it as .json (default benchmarks/results/bench_xpyd.md)")
    parser.add_argument("--verbose", action="store_true", help="INFO logs from the children too")
    args = parser.parse_args(argv)
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    if not args.stacks or set(args.stacks) - set(STACKS):
        parser.error(f"--stacks: choose from {', '.join(STACKS)}")
    args.entry_bytes = int(args.entry_mib * MiB) // 8 * 8
    if args.entry_bytes < 8 or args.entries < 1 or args.threads < 1:
        parser.error("--entry-mib, --entries and --threads must be positive")
    if args.staging_mib < 8:
        parser.error("--staging-mib: at least 8 (twice mooncake.json's 4 MiB chunk_size)")
    largest = max(p * c for p, c in args.shapes)
    args.total = args.entries * largest
    for p, c in args.shapes:
        if args.total % (p * c):
            parser.error(f"shape {p}x{c}: {args.total} entries do not split evenly over {p * c} pairs")
    args.shapes = [f"{p}x{c}" for p, c in args.shapes]
    return args


def make_spec(args: argparse.Namespace, stack: str, shape: str) -> Spec:
    p, c = (int(x) for x in shape.split("x"))
    return Spec(stack=stack, producers=[f"{HOST}:{free_port()}" for _ in range(p)],
                consumers=[f"{HOST}:{free_port()}" for _ in range(c)], per_pair=args.total // (p * c),
                entry_bytes=args.entry_bytes, threads=args.threads, timeout=args.timeout,
                pipe_timeout=args.pipe_timeout, staging_bytes=args.staging_mib * MiB, huge_pages=args.huge_pages,
                log_level="INFO" if args.verbose else "WARNING")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    load_before = list(os.getloadavg())
    results: list[dict[str, Any]] = []
    try:
        for shape in args.shapes:
            for stack in args.stacks:
                result = run_once(make_spec(args, stack, shape))
                logger.info("%s %s: %.2f GB/s aggregate, nothing lost: %s (%.1f s)", stack, shape,
                            result["aggregate_gbps"], result["intact"], result["seconds"])
                results.append(result)
    except BenchError as e:
        logger.error("the benchmark failed: %s", e)
        return 1
    table = report(args, results, (load_before, list(os.getloadavg())))
    print(table)
    common.write(args.out.stem, {"args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results},
                 table, args.out.parent)
    logger.info("wrote %s and %s", args.out, args.out.with_suffix(".json"))
    return 0 if all(r["intact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
