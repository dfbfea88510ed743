"""Helpers to run one pipe end in a separate, real process with its own Transfer Engine.

Peers start from a "forkserver" that has imported torch and these helpers once: a fresh process per peer as with
"spawn", without paying those imports (seconds) for each. The Mooncake wheel is imported in each child (its etcd
client does not survive a fork), and nothing in the server starts a thread or an engine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from typing import Any

from harness.pipes import open_pipe
from kv_pipe import MooncakeTransferEngineConfig

_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(["torch", "tests.kv_pipe.peers", "tests.kv_lookup_buffer.programs"])


def ctx() -> Any:
    """The multiprocessing context the peers run in (for Events and Queues shared with them)."""
    return _ctx


def _run(fn: Callable[..., Any], args: tuple[Any, ...], results: Any, env: dict[str, str]) -> None:
    import logging

    os.environ.clear()  # the test's environment now, not the forkserver's at its start
    os.environ.update(env)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s peer %(name)s %(levelname)s %(message)s")
    try:
        results.put(("ok", fn(*args)))
    except BaseException as e:  # report everything to the test, which asserts on it
        results.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Peer:
    """``fn(*args)`` running in a child process; ``result()`` returns its value or raises with its traceback."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.results = _ctx.Queue()
        self.proc = _ctx.Process(target=_run, args=(fn, args, self.results, dict(os.environ)), daemon=True)
        self.proc.start()

    def result(self, timeout: float = 120.0) -> Any:
        status, value = self.results.get(timeout=timeout)
        if status != "ok":
            raise AssertionError(f"peer process failed: {value}")
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)


def echo(cfg: dict[str, Any], kv_rank: int, count: int, offer_wait: float | None = None) -> int:
    """Receive ``count`` items and send each straight back; returns how many were tensors. ``offer_wait``: how long
    a large tensor's send waits for the receiver's zero-copy offer before it fills the ring (the pipe's default, a few
    ms, is a tuning choice: a test that asserts the offer is taken gives a receiver on a loaded machine time to make
    it)."""
    if offer_wait is not None:
        from kv_pipe import sending

        sending.OFFER_WAIT = offer_wait
    tensors = 0
    with open_pipe(cfg, kv_rank) as pipe:
        for _ in range(count):
            item = pipe.recv_tensor()
            tensors += item is not None
            pipe.send_tensor(item)
        pipe.recv_tensor()  # wait for the test's "done" before closing
    return tensors


def echo_until_none(cfg: dict[str, Any], kv_rank: int) -> int:
    """Send every tensor received straight back, until a None comes; returns how many were echoed."""
    echoed = 0
    with open_pipe(cfg, kv_rank) as pipe:
        while (item := pipe.recv_tensor()) is not None:
            pipe.send_tensor(item)
            echoed += 1
    return echoed


# ----------------------------------------------------------------------------- deterministic test data
def dtype_cases() -> list[Any]:
    """Every dtype the pipe supports in several shapes (0-d, empty, odd sizes, non-contiguous), plus Nones."""
    import torch

    from kv_pipe import wire

    g = torch.Generator().manual_seed(1234)
    cases: list[Any] = []
    for dtype in sorted(wire.DTYPE_TO_CODE, key=str):
        for shape in [(), (0,), (3, 0, 2), (7,), (5, 6), (2, 3, 4, 5), (257, 129)]:
            n = int(torch.Size(shape).numel())
            if dtype == torch.bool:
                t = torch.randint(0, 2, (n,), generator=g).bool()
            else:
                t = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
            cases.append(t.reshape(shape))
        base = torch.randint(0, 256, (64 * 96 * dtype.itemsize,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            base = base % 2
        mat = base.view(dtype).reshape(64, 96) if dtype != torch.bool else base.bool().reshape(64, 96)
        cases += [mat.t(), mat[::3, 1::2], mat[:, 5]]  # transposed, strided, a column: all non-contiguous
    cases += [None, torch.zeros(()), None]
    return cases


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of dtype, shape and bytes (NaN payloads included); None equals None."""
    import torch

    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.cpu().contiguous().reshape(-1).view(torch.uint8), b.cpu().contiguous().reshape(-1).view(torch.uint8))


def send_cases(cfg: dict[str, Any], kv_rank: int) -> dict[str, Any]:
    """Send every case of ``dtype_cases``, then receive them back (until a None): how many were sent, and which
    echoes differ from their case."""
    cases = dtype_cases()
    with open_pipe(cfg, kv_rank) as pipe:
        for t in cases:
            pipe.send_tensor(t)
        back = []
        while (item := pipe.recv_tensor()) is not None or len(back) < len(cases):
            back.append(item)
        pipe.send_tensor(None)  # all read: the test may close its end
    return {"sent": len(cases), "echoes_differ": [i for i, (a, b) in enumerate(zip(cases, back, strict=True))
                                                  if not same(a, b)]}


# ----------------------------------------------------------------------------- stress
def stress_schedule(seed: int, rounds: int) -> list[tuple[int, bool]]:
    """(sender kv_rank, is_none) per round; the sending side changes every 1-5 rounds, ~5% of rounds are Nones."""
    import random

    rng = random.Random(seed)
    schedule: list[tuple[int, bool]] = []
    sender = 0
    while len(schedule) < rounds:
        for _ in range(rng.randint(1, 5)):
            schedule.append((sender, rng.random() < 0.05))
        sender = 1 - sender
    return schedule[:rounds]


def stress(cfg: dict[str, Any], kv_rank: int, seed: int, rounds: int, pipe: Any = None) -> dict[str, int]:
    """Both ends run this with the same seed: random ~900-1000 x 900-1000 tensors with mean and std, or 3 Nones."""
    import torch

    own = pipe is None
    pipe = open_pipe(cfg, kv_rank) if own else pipe
    g = torch.Generator().manual_seed(seed * 2 + kv_rank)
    stats = {"sent": 0, "received": 0, "nones_sent": 0, "nones_received": 0}
    try:
        for rnd, (sender, is_none) in enumerate(stress_schedule(seed, rounds)):
            if sender == kv_rank:
                if is_none:
                    for _ in range(3):
                        pipe.send_tensor(None)
                    stats["nones_sent"] += 1
                else:
                    rows, cols = (int(v) for v in torch.randint(900, 1001, (2,), generator=g))
                    x = torch.randn(rows, cols, generator=g)
                    pipe.send_tensor(x)
                    pipe.send_tensor(x.mean())
                    pipe.send_tensor(x.std())
                    stats["sent"] += 1
            else:
                x, mean, std = pipe.recv_tensor(), pipe.recv_tensor(), pipe.recv_tensor()
                if is_none:
                    assert x is None and mean is None and std is None, f"round {rnd}: expected 3 Nones"
                    stats["nones_received"] += 1
                else:
                    assert x is not None and 900 <= x.shape[0] <= 1000 and 900 <= x.shape[1] <= 1000, f"round {rnd}"
                    assert torch.allclose(x.mean(), mean) and torch.allclose(x.std(), std), f"round {rnd}: mean/std differ"
                    stats["received"] += 1
        if own:
            pipe.send_tensor(None)  # tell the other end we are done before closing
            assert pipe.recv_tensor() is None
    finally:
        if own:
            pipe.close()
    return stats


# ----------------------------------------------------------------------------- 1 GiB, peak RSS
BLOCK = 64 << 20


def fill_block(out_int32: Any, index: int) -> None:
    import torch

    n = out_int32.numel()
    torch.arange(index * n, (index + 1) * n, dtype=torch.int32, out=out_int32)


def big_sender(cfg: dict[str, Any], kv_rank: int, nbytes: int) -> dict[str, int]:
    import resource

    import psutil
    import torch

    with open_pipe(cfg, kv_rank) as pipe:
        base = psutil.Process().memory_info().rss
        t = torch.empty(nbytes, dtype=torch.uint8)
        for i in range(nbytes // BLOCK):
            fill_block(t[i * BLOCK:(i + 1) * BLOCK].view(torch.int32), i)
        pipe.send_tensor(t)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        assert pipe.recv_tensor(timeout=120) is None  # "received" from the other end
    return {"base": base, "peak": peak}


def big_receiver(cfg: dict[str, Any], kv_rank: int, nbytes: int) -> dict[str, Any]:
    import resource
    import time

    import psutil
    import torch

    with open_pipe(cfg, kv_rank) as pipe:
        base = psutil.Process().memory_info().rss
        t = pipe.recv_tensor(timeout=120)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        expected = torch.empty(BLOCK // 4, dtype=torch.int32)
        bad_blocks = 0
        for i in range(nbytes // BLOCK):
            fill_block(expected, i)
            bad_blocks += not torch.equal(t[i * BLOCK:(i + 1) * BLOCK].view(torch.int32), expected)
        pipe.send_tensor(None)
        time.sleep(0.5)  # let the None land before closing
    return {"base": base, "peak": peak, "numel": t.numel(), "dtype": str(t.dtype), "bad_blocks": bad_blocks}


# ----------------------------------------------------------------------------- failure partners
def sink(cfg: dict[str, Any], kv_rank: int, seconds: float, ready: Any = None) -> None:
    """Accept the connection and never read: the sender fills the ring and waits. Sets ``ready`` once listening."""
    import time

    with open_pipe(cfg, kv_rank):
        if ready is not None:
            ready.set()
        time.sleep(seconds)


def send_then_hang(cfg: dict[str, Any], kv_rank: int, nbytes: int, seconds: float) -> None:
    """Send None (so the test knows we are connected), then one big tensor (blocks once the receiver's ring is
    full), then linger."""
    import time

    import torch

    with open_pipe(cfg, kv_rank) as pipe:
        pipe.send_tensor(None)
        pipe.send_tensor(torch.ones(nbytes, dtype=torch.uint8))
        time.sleep(seconds)


def open_endpoint(cfg: dict[str, Any], kv_rank: int, address: str, **kwargs: Any):
    """A ``PipeEndpoint`` listening on ``address`` (``host:port``) with the settings of ``cfg``."""
    from kv_pipe.addresses import parse_host_port
    from kv_pipe.endpoint import PipeEndpoint

    host, port = parse_host_port(address, "address")
    return PipeEndpoint(MooncakeTransferEngineConfig(**cfg), host, port, kv_rank=kv_rank, **kwargs)


def endpoint_client(cfg: dict[str, Any], address: str, servers: list[str], tag: float, rounds: int) -> list[float]:
    """A consumer endpoint at ``address`` linked to every producer endpoint in ``servers``: for each round, sends a
    tensor of ``tag`` to each and collects each answer (the server adds 1); returns every value received."""
    import torch

    got: list[float] = []
    endpoint = open_endpoint(cfg, 1, address)
    try:
        for _ in range(rounds):
            for server in servers:
                endpoint.link(server).send_tensor(torch.full((1000,), tag))
            for server in servers:
                t = endpoint.link(server).recv_tensor()
                assert t is not None and bool((t == t[0]).all())
                got.append(float(t[0]))
        for server in servers:
            endpoint.link(server).send_tensor(None)
    finally:
        endpoint.close()
    return got


def endpoint_server(cfg: dict[str, Any], address: str, clients: int) -> int:
    """A producer endpoint at ``address``: every link a consumer makes is served (tensor + 1 sent back) until that
    consumer sends None (a consumer that reconnects is served on, on the same link); returns how many tensors it
    answered once ``clients`` links got their None."""
    import threading

    answered = 0
    done = threading.Semaphore(0)
    lock = threading.Lock()

    def serve(pipe: Any) -> None:
        from kv_pipe import PeerDisconnected, PipeClosed

        nonlocal answered
        while True:
            try:
                t = pipe.recv_tensor()
            except PeerDisconnected:  # e.g. the consumer closed an idle link: it comes back on this link
                continue
            except PipeClosed:
                return
            if t is None:
                done.release()
                return
            pipe.send_tensor(t + 1)
            with lock:
                answered += 1

    endpoint = open_endpoint(cfg, 0, address, start=False)
    endpoint.on_link(lambda pipe: threading.Thread(target=serve, args=(pipe,), daemon=True).start())
    endpoint.start()  # only now: a consumer linking earlier would not be served
    try:
        for _ in range(clients):
            if not done.acquire(timeout=120):
                raise TimeoutError("not every consumer finished")
    finally:
        endpoint.close()
    return answered


def late_bye_server(cfg: dict[str, Any], address: str, clients: int, late: float) -> int:
    """``endpoint_server`` on a network that delivers the end of a connection ``late`` seconds after it was sent:
    a BYE on a connection this side sends on is acted on only then, and the TCP state probe does not see the FIN
    (a lossy link retransmitting it)."""
    import time

    from kv_pipe import connections
    from kv_pipe.wire import Kind

    handle = connections.Outbound._handle

    def late_handle(self: Any, kind: Any, payload: bytes) -> None:
        if kind == Kind.BYE:
            time.sleep(late)
        handle(self, kind, payload)

    connections.Outbound._handle = late_handle  # type: ignore[method-assign]
    connections.Connection.probe_alive = connections.Connection.alive.fget  # type: ignore[method-assign,attr-defined]
    return endpoint_server(cfg, address, clients)


def raw_handshake(sock: Any, hello: dict[str, Any], secret: bytes = b"", session: str = "fake:1") -> tuple[Any, bytes]:
    """Speak the side channel's handshake by hand: HELLO (``hello`` plus a nonce and a link id, unless it names one),
    then AUTH under ``secret`` if the endpoint sends its CHALLENGE; returns the last frame (kind, payload): WELCOME,
    or ERROR."""
    import json

    from kv_pipe import auth, wire
    from kv_pipe.wire import Kind

    frame = wire.encode_json(Kind.HELLO, {"nonce": auth.nonce(), "link": auth.nonce(), **hello})
    sock.sendall(frame)
    kind, payload = wire.recv_frame(sock)
    if kind != Kind.CHALLENGE:
        return kind, payload
    theirs = json.loads(payload)["nonce"]
    proof = auth.proof(secret, "link", frame[wire.HEADER.size:], theirs, session)
    sock.sendall(wire.encode_json(Kind.AUTH, {"session": session, "proof": proof}))
    return wire.recv_frame(sock)


# ----------------------------------------------------------------------------- a slow or frozen sender
def pause_after_frames(kinds: set[str], seconds: float, times: int | None = None, paused: Any = None) -> None:
    """Test-only, in a peer process: from now on every pipe sender of this process pauses ``seconds`` after it sent a
    side-channel frame of one of ``kinds`` (``wire.Kind`` names, e.g. "TENSOR": the header of a tensor whose bytes
    follow as CHUNK frames), ``times`` times at most (None: always), as a slow or frozen peer would. ``paused`` (an
    Event) is set when the first pause begins. Only the sending side is changed: the receiver is the real one."""
    import threading
    import time

    from kv_pipe import wire
    from kv_pipe.connections import Outbound

    send = Outbound.send
    left = [times]
    lock = threading.Lock()

    def send_then_pause(self: Outbound, frame: bytes) -> None:
        send(self, frame)
        kind, _ = wire.decode_header(frame[:wire.HEADER.size])
        with lock:
            if kind.name not in kinds or left[0] == 0:
                return
            if left[0] is not None:
                left[0] -= 1
        if paused is not None:
            paused.set()
        time.sleep(seconds)

    Outbound.send = send_then_pause  # type: ignore[method-assign]


def send_late_bytes(cfg: dict[str, Any], kv_rank: int, nbytes: int, pause: float, frozen: Any) -> None:
    """Send None (connected), then a tensor of ``nbytes`` (``late_tensor``) pausing ``pause`` s after its header and
    after its first chunk; then the header of a second one, and freeze (``frozen`` is set): the test kills us."""
    with open_pipe(cfg, kv_rank) as pipe:
        pipe.send_tensor(None, timeout=60.0)  # linking may take longer than the test's short timeout on a busy box
        pause_after_frames({"TENSOR", "CHUNK"}, pause, times=2)
        pipe.send_tensor(late_tensor(nbytes))
        pause_after_frames({"TENSOR"}, 600.0, times=1, paused=frozen)
        pipe.send_tensor(late_tensor(nbytes))


def late_tensor(nbytes: int) -> Any:
    import torch

    return torch.arange(nbytes // 4, dtype=torch.int32) * 3 + 1


def link_once(cfg: dict[str, Any], address: str, server: str) -> str:
    """A consumer endpoint at ``address`` sends one tensor to the endpoint it believes listens at ``server``;
    returns "sent", or the error's type and message."""
    import torch

    with open_endpoint(cfg, 1, address) as endpoint:
        try:
            endpoint.link(server).send_tensor(torch.ones(4), timeout=5.0)
        except Exception as e:  # the test asserts on what it was
            return f"{type(e).__name__}: {e}"
    return "sent"


def listening_sockets(cfg: dict[str, Any], address: str) -> list[tuple[str, int]]:
    """Every TCP socket this process listens on while a pipe endpoint at ``address`` is open (its side channel and
    its Transfer Engine's ports): (ip, port)."""
    import psutil

    with open_endpoint(cfg, 0, address):
        return sorted((c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN)


def ready() -> bool:
    """Nothing: starting it starts the forkserver, so that a later peer's start-up is not timed with it."""
    return True
