"""Producer-side programs run in a child process (the consumer side is the test process)."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from kv_lookup_buffer import BufferClosed, SimpleBuffer
from tests.kv_pipe.peers import open_pipe

Entry = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def basic_entries() -> list[Entry]:
    g = torch.Generator().manual_seed(5)
    return [(torch.tensor([1, 2, 3]), None, torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g), None)]


def prefix_entries() -> list[Entry]:
    kv = lambda i: torch.full((2, 3), float(i))  # noqa: E731
    return [
        (torch.tensor([1, 2, 3, 4]), None, kv(1), kv(-1), torch.ones(4)),
        (torch.tensor([10, 11, 12]), None, kv(2), kv(-2), None),
        (torch.tensor([20, 99, 21, 98]), torch.tensor([True, False, True, False]), kv(3), kv(-3), None),
        (torch.tensor([30, 31, 32]), None, kv(4), None, None),
    ]


STRESS_ENTRY_BYTES = 100 * 8 + 100 * 1 + 3 * 100 * 4  # int64 tokens, bool roi, float32 key/value/hidden


def stress_entries(seed: int = 100) -> list[Entry]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50_000, (100,), generator=g), torch.ones(100, dtype=torch.bool),
             torch.rand(100, generator=g), torch.rand(100, generator=g), torch.rand(100, generator=g))
            for _ in range(200)]


def shuffled(entries: list[Entry], seed: int) -> list[Entry]:
    order = list(range(len(entries)))
    random.Random(seed).shuffle(order)
    return [entries[i] for i in order]


ENTRY_SETS = {"basic": basic_entries, "prefix": prefix_entries, "stress": stress_entries}


def produce(cfg: dict[str, Any], entry_set: str, thresh: float, done: Any, order_seed: int | None = None,
            full: Any = None, linger: float = 120.0) -> dict[str, Any]:
    """Insert the entries (in a shuffled order if order_seed), then wait for ``done`` and report what is left."""
    entries = ENTRY_SETS[entry_set]()
    if order_seed is not None:
        entries = shuffled(entries, order_seed)
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, thresh)
        for i, entry in enumerate(entries):
            buf.insert(*entry)
            if full is not None and i + 1 == min(100, len(entries)):
                full.set()  # the first 100 (or all) are in
        done.wait(linger)
        left = {"entries": len(buf), "bytes": buf.buffer_size, "stats": dict(buf.stats)}
        buf.close()
    return left


def blocked_insert(cfg: dict[str, Any], thresh: float, timeout: float) -> dict[str, Any]:
    """Insert two stress entries into a buffer that holds one; report how the second insert ended."""
    entries = stress_entries()
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, thresh, timeout=timeout)
        buf.insert(*entries[0])
        start = time.monotonic()
        try:
            buf.insert(*entries[1])
            outcome = "inserted"
        except (BufferClosed, TimeoutError) as e:
            outcome = f"{type(e).__name__}: {e}"
        return {"outcome": outcome, "after": time.monotonic() - start}


def close_later(cfg: dict[str, Any], delay: float) -> None:
    """A producer that never inserts, and closes after ``delay`` seconds."""
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1 << 20, role="producer")
        time.sleep(delay)
        buf.close()
        time.sleep(1.0)  # let the CLOSED answer land before the pipe goes
