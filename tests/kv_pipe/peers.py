"""Helpers to run one pipe end in a separate, real process (multiprocessing "spawn": its own Transfer Engine)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable
from typing import Any

from kv_pipe import MooncakeTransferEngineConfig

_ctx = mp.get_context("spawn")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_config(**overrides: Any) -> dict[str, Any]:
    """A config dict with two free ports on 127.0.0.1 (P2PHANDSHAKE, TCP unless overridden)."""
    cfg = {"prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}", "timeout": 10.0}
    cfg.update(overrides)
    return cfg


def _run(fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s peer %(name)s %(levelname)s %(message)s")
    try:
        results.put(("ok", fn(*args)))
    except BaseException as e:  # report everything to the test, which asserts on it
        results.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Peer:
    """``fn(*args)`` running in a child process; ``result()`` returns its value or raises with its traceback."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self.results = _ctx.Queue()
        self.proc = _ctx.Process(target=_run, args=(fn, args, self.results), daemon=True)
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


def open_pipe(cfg: dict[str, Any], kv_rank: int, local_rank: int = 0, device: str = "cpu"):
    from kv_pipe import MooncakePipe

    return MooncakePipe(local_rank=local_rank, kv_rank=kv_rank, config=MooncakeTransferEngineConfig(**cfg), device=device)


def echo(cfg: dict[str, Any], kv_rank: int, count: int) -> int:
    """Receive ``count`` items and send each straight back; returns how many were tensors."""
    tensors = 0
    with open_pipe(cfg, kv_rank) as pipe:
        for _ in range(count):
            item = pipe.recv_tensor()
            tensors += item is not None
            pipe.send_tensor(item)
        pipe.recv_tensor()  # wait for the test's "done" before closing
    return tensors
