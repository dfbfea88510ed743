"""The bare pipe the loads inside vLLM are measured against: the same bytes through a ``MooncakePipe`` between two
processes of their own, with the worker's GIL switch interval and the vLLM pair's pipe settings; once per round
(``bare_pipe_round``) or kept up between single loads (``BarePipe``)."""

from __future__ import annotations

import sys
import time
from typing import Any

from benchmarks.support import procs
from harness.ports import free_port

SWITCH_INTERVAL = 0.0001  # the connector's gil_switch_interval default, for the bare pipe too


def _pipe_config(base: dict[str, Any]) -> Any:
    from kv_pipe import MooncakeTransferEngineConfig

    return MooncakeTransferEngineConfig.from_dict(base)


def _bare_sender(cfg: dict[str, Any], sizes: list[int], ready: Any, core: int | None) -> None:
    import os

    import torch

    from kv_pipe import MooncakePipe

    if core is not None:
        os.sched_setaffinity(0, {core})
    sys.setswitchinterval(SWITCH_INTERVAL)
    with MooncakePipe(kv_rank=0, config=_pipe_config(cfg)) as pipe:
        data = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8)
        ready.set()
        pipe.recv_tensor(timeout=120)  # "go"
        for size in sizes:
            pipe.send_tensor(data[:size])
        pipe.recv_tensor(timeout=120)  # "done": keep the pipe up until everything is received


def bare_pipe_round(cfg: dict[str, Any], sizes: list[int], pinned: bool) -> dict[str, Any]:
    """The sizes through a bare pipe; ``pinned``: sender on core 0, receiver (this process, meanwhile) on core 1."""
    import os

    import torch

    from kv_pipe import MooncakePipe, WarmPool

    cfg = {**cfg, "prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}"}
    sys.setswitchinterval(SWITCH_INTERVAL)
    ctx = procs.SPAWN
    ready = ctx.Event()
    sender = ctx.Process(target=_bare_sender, args=(cfg, sizes, ready, 0 if pinned else None), daemon=True)
    sender.start()
    all_cores = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {1})
    pool = WarmPool(keep=1)
    buf = pool.get(max(sizes))
    with MooncakePipe(kv_rank=1, config=_pipe_config(cfg)) as pipe:
        if not ready.wait(120):
            raise RuntimeError("the bare-pipe sender did not start")
        start = time.perf_counter()
        pipe.send_tensor(torch.zeros(1))
        for size in sizes:
            got = pipe.recv_tensor(timeout=120, out=buf)
            assert got is not None and got.numel() == size
        wall = time.perf_counter() - start
        pipe.send_tensor(torch.zeros(1))
    sender.join(30)
    os.sched_setaffinity(0, all_cores)
    return {"n": len(sizes), "bytes": sum(sizes), "seconds": wall, "GBps": sum(sizes) / wall / 1e9, "pinned": pinned}


def _bare_server(cfg: dict[str, Any], largest: int, ready: Any, core: int) -> None:
    """A bare-pipe sender that stays up: sends a tensor of each size it is asked for (0: stop)."""
    import os

    import torch

    from kv_pipe import MooncakePipe

    os.sched_setaffinity(0, {core})
    sys.setswitchinterval(SWITCH_INTERVAL)
    with MooncakePipe(kv_rank=0, config=_pipe_config(cfg)) as pipe:
        data = torch.randint(0, 255, (largest,), dtype=torch.uint8)
        ready.set()
        while True:
            ask = pipe.recv_tensor(timeout=3600)
            size = int(ask.item()) if ask is not None else 0
            if size <= 0:
                return
            pipe.send_tensor(data[:size])


def _bare_receiver(cfg: dict[str, Any], largest: int, conn: Any, core: int) -> None:
    """The receiving end of ``BarePipe``, in a process of its own pinned to ``core`` with every thread it starts (as
    the consumer's worker): times each size ``conn`` asks for, from asking the sender to the bytes being in a reused,
    mapped buffer registered once as a receive region, as the consumer's KV cache is (so the sender writes straight
    into it); answers the seconds (0 stops it)."""
    import os

    import torch

    from kv_pipe import MooncakePipe, Scatter

    os.sched_setaffinity(0, {core})
    sys.setswitchinterval(SWITCH_INTERVAL)
    buf = torch.zeros(largest, dtype=torch.uint8)  # written: mapped, as the consumer's KV cache blocks are
    with MooncakePipe(kv_rank=1, config=_pipe_config(cfg)) as pipe:
        pipe.register_receive_region(buf)
        conn.send("ready")
        while True:
            size = conn.recv()
            start = time.perf_counter()
            pipe.send_tensor(torch.tensor([size], dtype=torch.int64))
            if size <= 0:
                return
            got = pipe.recv_tensor(timeout=120, out=Scatter.of([(buf.data_ptr(), size)], (buf,)))
            seconds = time.perf_counter() - start
            conn.send(seconds if got is not None and got.numel() == size else -1.0)


class BarePipe:
    """One bare pipe kept up between single loads, so that each load in vLLM is timed next to a bare transfer of the
    same bytes (interleaved: the machine's slow drifts hit both). The sender on core 0 and the receiver on core 1,
    each a process pinned with all its threads, as the vLLM producer's and consumer's workers."""

    def __init__(self, cfg: dict[str, Any], largest: int) -> None:
        cfg = {**cfg, "prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}"}
        ctx = procs.SPAWN
        ready = ctx.Event()
        self.sender = ctx.Process(target=_bare_server, args=(cfg, largest, ready, 0), daemon=True)
        self.sender.start()
        if not ready.wait(120):
            raise RuntimeError("the bare-pipe sender did not start")
        self.conn, theirs = ctx.Pipe()
        self.receiver = ctx.Process(target=_bare_receiver, args=(cfg, largest, theirs, 1), daemon=True)
        self.receiver.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the bare-pipe receiver did not start")
        self.transfer(1 << 20)  # the link's set-up is not timed (the vLLM pair's link is up too)

    def transfer(self, size: int) -> float:
        """Seconds from the receiver asking for ``size`` bytes until they are in its buffer."""
        self.conn.send(size)
        if not self.conn.poll(120):
            raise RuntimeError(f"the bare pipe did not move {size} bytes in 120 s")
        seconds = self.conn.recv()
        if seconds < 0:
            raise RuntimeError(f"the bare pipe's receiver got the wrong size for {size} bytes")
        return seconds

    def close(self) -> None:
        self.conn.send(0)
        self.receiver.join(30)
        self.sender.join(30)
