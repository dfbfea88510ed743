"""Page-locked (pinned) host memory allocated once, when the KV cache is registered, and sub-allocated per copy.

Copies between a GPU cache and the host need pinned memory to run without a wait in the calling thread; allocating
it (``cudaHostAlloc``) takes the driver's lock, which would stall the forward pass's own CUDA calls. So each worker
of a GPU cache takes one arena at start-up and every gather, scatter source and block index is a piece of it.

A piece is an ordinary host tensor; its bytes go back to the arena when the last tensor viewing them is gone
(CPython frees it at once), and not before the CUDA copy recorded with ``Piece.after`` has ended - a copy queued
into a piece that nobody holds any more must not land in memory handed out again.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(f"vllm.{__name__}")
ALIGN = 512  # bytes: every piece starts aligned for any dtype and for DMA
POLL = 0.005  # seconds between looks at pending copies while a ``take`` waits for room


class ArenaFull(MemoryError):
    """No room in the arena for a piece now (or ever, for one larger than the arena)."""


@dataclass
class _Fence:
    event: Any = None  # a torch.cuda.Event: the piece's bytes are reused only once it completed


@dataclass
class Piece:
    """A piece of the arena: ``tensor`` (uint8, ``nbytes`` long) and its views keep it taken."""

    tensor: torch.Tensor
    _fence: _Fence

    def after(self, event: Any) -> None:
        """A CUDA copy into or out of this piece was queued: its memory is reused only once ``event`` completed
        (the latest call counts: copies on one stream end in order)."""
        self._fence.event = event

    def view(self, shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Its first bytes as a tensor of ``shape`` and ``dtype``."""
        n = math.prod(shape) * dtype.itemsize
        return self.tensor[:n].view(dtype).view(shape)


class PinnedArena:
    """``nbytes`` of host memory (page-locked if ``pinned``), handed out in pieces (first fit, freed ranges merged)."""

    def __init__(self, nbytes: int, pinned: bool = True) -> None:
        self.capacity = _aligned(max(nbytes, ALIGN))
        with torch.inference_mode(False):  # written by any thread, in inference mode or not
            self._base = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=pinned)
        self._bytes = self._base.numpy()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, size), sorted by offset
        self._pending: list[tuple[_Fence, int, int]] = []  # given back while a copy may still use them
        self._cv = threading.Condition()
        self.used = 0

    @property
    def memory(self) -> torch.Tensor:
        """All of the arena's bytes (to register them with a transfer engine once)."""
        return self._base

    def take(self, nbytes: int, timeout: float = 0.0) -> Piece:
        """A piece of at least ``nbytes``; waits up to ``timeout`` seconds for room (0: not at all). Raises
        ``ArenaFull``."""
        size = _aligned(max(nbytes, 1))
        if size > self.capacity:
            raise ArenaFull(f"a piece of {nbytes} bytes is larger than the whole pinned arena ({self.capacity} "
                            "bytes)")
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                self._reclaim()
                offset = self._fit(size)
                if offset is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ArenaFull(f"no room for {nbytes} bytes in the pinned arena ({self.used} of "
                                    f"{self.capacity} bytes in use)")
                self._cv.wait(min(left, POLL) if self._pending else left)
            self.used += size
        return self._piece(offset, size)

    def _fit(self, size: int) -> int | None:
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                return offset
        return None

    def _piece(self, offset: int, size: int) -> Piece:
        # A tensor over the arena's bytes that owns nothing but a numpy array: when the last tensor (or view) of it
        # is gone, so is the array, and its finalizer gives the range back.
        array = self._bytes[offset:offset + size]  # a numpy view: its own object, the arena's memory
        if torch.is_inference_mode_enabled():
            with torch.inference_mode(False):  # written by any thread, in inference mode or not
                tensor = torch.from_numpy(array)
        else:
            tensor = torch.from_numpy(array)
        fence = _Fence()
        weakref.finalize(array, self._give_back, offset, size, fence)
        return Piece(tensor, fence)

    def _give_back(self, offset: int, size: int, fence: _Fence) -> None:
        with self._cv:
            if fence.event is not None and not _completed(fence.event):
                self._pending.append((fence, offset, size))
            else:
                self._merge(offset, size)
            self._cv.notify_all()

    def _reclaim(self) -> None:
        """Give back the pending pieces whose copies ended (under the lock)."""
        if not self._pending:
            return
        still = []
        for fence, offset, size in self._pending:
            if _completed(fence.event):
                self._merge(offset, size)
            else:
                still.append((fence, offset, size))
        self._pending = still

    def _merge(self, offset: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect(self._free, (offset, size))
        if i < len(self._free) and offset + size == self._free[i][0]:  # joins the next free range
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the previous one
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, size))

    def stats(self) -> dict[str, int]:
        with self._cv:
            self._reclaim()
            return {"capacity": self.capacity, "used": self.used, "pending": len(self._pending),
                    "largest_free": max((s for _, s in self._free), default=0)}


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _completed(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # a broken context: the copy will never touch the bytes again
        logger.exception("MooncakeConnector: querying a copy's event failed; taking its pinned memory back")
        return True
