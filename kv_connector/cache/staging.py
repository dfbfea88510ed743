"""Copies between the paged KV cache and host memory that never stall the forward pass. Host caches:
``block_copy``'s memmoves, done at once. Device caches (CUDA): blocks are staged in pinned host memory
(``pinned.PinnedArena``) by copies on two streams of the worker's own (``out``, ``in``), ordered by events, never by
a synchronizing call in the forward pass's thread; ``suspend`` stops them for sleep mode.

How each copy is ordered, and why a request's blocks are held: docs/architecture.md (A GPU KV cache).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kv_connector.cache import block_copy
from kv_connector.cache.pinned import PinnedArena

CHUNK_BYTES = 64 << 20  # device memory a copy uses at a time beyond the cache (bounded whatever the prompt's size)
DEFAULT_PINNED = 256 << 20  # bytes of pinned memory of a staging made without a size (tests, benchmarks)


class CacheSuspended(RuntimeError):
    """The KV cache's memory is released (sleep mode): no copy into or out of it may start."""


@dataclass
class Staged:
    """A host tensor that may still be being filled: ``wait()`` returns once it is (at once for a host copy)."""

    tensor: torch.Tensor
    done: Any = None  # torch.cuda.Event of the copy (blocking: a waiting thread sleeps), or None when complete
    device: torch.device | None = None  # the event's device

    def wait(self) -> None:
        if self.done is not None:
            with torch.cuda.device(self.device):  # from any thread, without touching another GPU's context
                self.done.synchronize()  # an event wait: not a device or stream synchronize


class KVStaging:
    """Copies for one worker's KV cache ``layers`` (blocks along ``block_dim``); see the module docstring.
    ``pinned_bytes``: a device cache's pinned arena, which every host side of a copy comes from."""

    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int, pinned_bytes: int = DEFAULT_PINNED) -> None:
        self.layers, self.block_dim = list(layers), block_dim
        self.device = self.layers[0].device
        self.on_device = self.device.type == "cuda"
        self.arena = PinnedArena(pinned_bytes) if self.on_device else None
        self._out = torch.cuda.Stream(self.device) if self.on_device else None
        self._in = torch.cuda.Stream(self.device) if self.on_device else None
        self._step: Any = None  # recorded on the forward stream by ``mark``
        self._copying: dict[str, Any] = {}  # request -> the event of its latest copy out of the cache
        self._gate = threading.Condition()
        self._active = 0  # copies being queued
        self._suspended = False
        row = math.prod(self.layers[0].shape) // self.layers[0].shape[block_dim] * self.layers[0].element_size()
        self._rows_per_chunk = max(1, CHUNK_BYTES // (row * len(self.layers)))  # of the block-major tensor

    # ---------------------------------------------------------------- the forward pass's thread
    def mark(self) -> None:
        """Loads start in this step: their copies into the cache wait for the work queued so far."""
        if self.on_device:
            self._step = self._record(torch.cuda.current_stream(self.device))

    def gather(self, ids: Sequence[int], layer: int | None = None, scratch: torch.Tensor | None = None,
               owner: str | None = None) -> Staged:
        """Blocks ``ids`` of every layer (or of ``layer`` only) as a block-major host tensor ``[len(ids), layers,
        *block_shape]`` (``block_copy.gather``; on the host a view of ``scratch`` if it is large enough). ``owner``:
        the request whose blocks they are (``sent`` tells when its copies ended). A device gather takes its pinned
        memory without waiting: ``ArenaFull`` if there is no room (the caller drops what it was saving)."""
        layers = self.layers if layer is None else [self.layers[layer]]
        with self._copy():
            if not self.on_device:
                return Staged(block_copy.gather(layers, self.block_dim, ids, scratch))
            assert self.arena is not None and self._out is not None
            shape = [len(ids), len(layers), *block_copy.block_shape(layers[0], self.block_dim)]
            piece = self.arena.take(math.prod(shape) * layers[0].element_size())
            index = self._index(ids)
            host = piece.view(shape, layers[0].dtype)
            after = self._record(torch.cuda.current_stream(self.device))
            with torch.cuda.device(self.device), torch.cuda.stream(self._out):
                self._out.wait_event(after)
                device_index = index.tensor.view(torch.long)[:len(ids)].to(self.device, non_blocking=True)
                step = self._rows_per_chunk * (len(self.layers) // len(layers))
                for lo in range(0, len(ids), step):  # a bounded piece at a time: no prompt-sized device buffer
                    part = device_index[lo:lo + step]
                    dense = torch.stack([t.index_select(self.block_dim, part).movedim(self.block_dim, 0)
                                         for t in layers], dim=1)
                    host[lo:lo + step].copy_(dense, non_blocking=True)
                done = self._record(self._out, blocking=True)
            piece.after(done)
            index.after(done)
            if owner is not None:
                self._copying[owner] = done
            return Staged(host, done, self.device)

    def sent(self, held: Iterable[str]) -> set[str]:
        """Of the requests ``held``, those whose copies out of the cache have all ended (their blocks may be reused).
        Forgets every copy that ended, held or not."""
        if not self.on_device:
            return set(held)
        for req_id, event in list(self._copying.items()):
            if event.query():
                del self._copying[req_id]
        return {req_id for req_id in held if req_id not in self._copying}

    def protect(self, req_ids: Iterable[str]) -> None:
        """Requests preempted (vLLM frees their blocks without asking): the next forward's kernels wait, on the
        device, for their copies out of the cache still queued."""
        if not self.on_device:
            return
        stream = torch.cuda.current_stream(self.device)
        for req_id in req_ids:
            event = self._copying.pop(req_id, None)
            if event is not None:
                stream.wait_event(event)

    # ---------------------------------------------------------------- loader threads
    def bind_thread(self) -> None:
        """Make the cache's GPU this thread's current device (a loader thread's first act): what it asks of CUDA then
        never touches another GPU (a new thread starts on GPU 0)."""
        if self.on_device:
            torch.cuda.set_device(self.device)

    def host(self, nbytes: int, timeout: float) -> torch.Tensor | None:
        """A device cache: ``nbytes`` (or more) of pinned memory to receive into, waiting up to ``timeout`` seconds
        for room (``ArenaFull``); a host cache: None (the caller uses memory of its own)."""
        if self.arena is None:
            return None
        return self.arena.take(nbytes, timeout).tensor

    def scatter(self, ids: Sequence[int], kv: torch.Tensor, heads: tuple[int, int] | None = None,
                layer: int | None = None, wait: bool = True, timeout: float = 5.0) -> Staged:
        """Write the first ``len(ids)`` rows of the block-major host tensor ``kv`` into blocks ``ids`` of every layer
        (or of ``layer`` only; ``heads``: only that range of each block's first dimension, as
        ``block_copy.scatter``). ``wait``: return once the bytes are in place, else ``Staged.wait`` does. If it
        raises, no copy it queued is still running. ``timeout``: how long a device copy from unpinned memory may
        wait for pinned room."""
        layers = self.layers if layer is None else [self.layers[layer]]
        # vLLM may allocate the cache as inference tensors, which only code in inference mode may write
        with self._copy(), torch.inference_mode():
            if not self.on_device:
                block_copy.scatter(layers, self.block_dim, ids, kv, heads)
                return Staged(kv)
            staged = self._scatter(ids, kv, heads, layers, timeout)
        if wait:
            staged.wait()
        return staged

    def _scatter(self, ids: Sequence[int], kv: torch.Tensor, heads: tuple[int, int] | None,
                 layers: list[torch.Tensor], timeout: float) -> Staged:
        assert self.arena is not None and self._in is not None
        n = len(ids)
        src = kv[:n]
        pieces = []
        if not (src.is_contiguous() and src.is_pinned()):  # a pageable source would make the copy wait in this thread
            piece = self.arena.take(src.numel() * src.element_size(), timeout)
            pinned = piece.view(list(src.shape), src.dtype)
            pinned.copy_(src)
            src = pinned
            pieces.append(piece)
        index = self._index(ids, timeout)
        pieces.append(index)
        if heads is not None:
            layers = [t.narrow(1, heads[0], heads[1] - heads[0]) for t in layers]
        with torch.cuda.device(self.device), torch.cuda.stream(self._in):
            try:
                if self._step is not None:
                    self._in.wait_event(self._step)
                device_index = index.tensor.view(torch.long)[:n].to(self.device, non_blocking=True)
                step = self._rows_per_chunk * (len(self.layers) // len(layers))
                for lo in range(0, n, step):  # a bounded piece at a time: no prompt-sized device buffer
                    rows = src[lo:lo + step].to(self.device, non_blocking=True)
                    for li, t in enumerate(layers):
                        t.index_copy_(self.block_dim, device_index[lo:lo + step],
                                      rows[:, li].movedim(0, self.block_dim))
            except BaseException:  # the caller may reuse ``kv`` and vLLM the blocks once this returns
                Staged(kv, self._record(self._in, blocking=True), self.device).wait()
                raise
            done = self._record(self._in, blocking=True)
        for piece in pieces:
            piece.after(done)
        return Staged(kv, done, self.device)

    def readback(self, ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``ids`` of every layer as they lie in the cache now, as a host tensor like ``gather``'s, for a
        loader thread checking what its load wrote: on the ``in`` stream, after the copies into the cache queued
        there (its own among them), not after the forward pass; it moves nothing the forward pass waits for."""
        if not self.on_device:
            return block_copy.gather(self.layers, self.block_dim, ids)
        assert self.arena is not None and self._in is not None
        with self._copy():
            shape = [len(ids), len(self.layers), *block_copy.block_shape(self.layers[0], self.block_dim)]
            piece = self.arena.take(math.prod(shape) * self.layers[0].element_size(), timeout=5.0)
            index = self._index(ids, 5.0)
            host = piece.view(shape, self.layers[0].dtype)
            with torch.cuda.device(self.device), torch.cuda.stream(self._in):
                device_index = index.tensor.view(torch.long)[:len(ids)].to(self.device, non_blocking=True)
                step = self._rows_per_chunk
                for lo in range(0, len(ids), step):
                    part = device_index[lo:lo + step]
                    dense = torch.stack([t.index_select(self.block_dim, part).movedim(self.block_dim, 0)
                                         for t in self.layers], dim=1)
                    host[lo:lo + step].copy_(dense, non_blocking=True)
                done = self._record(self._in, blocking=True)
            piece.after(done)
            index.after(done)
        Staged(host, done, self.device).wait()
        return host

    # ---------------------------------------------------------------- sleep mode
    def suspend(self) -> None:
        """The cache's memory is about to be released: no copy may start into or out of it any more
        (``CacheSuspended``); returns once every copy queued on either stream has ended."""
        with self._gate:
            self._suspended = True
            while self._active:  # copies being queued right now: they are on a stream once this ends
                self._gate.wait()
        self.drain()

    def resume(self) -> None:
        with self._gate:
            self._suspended = False

    def drain(self) -> None:
        """Return once every copy into or out of the cache queued so far has ended."""
        if not self.on_device:
            return
        for stream in (self._out, self._in):
            Staged(self.layers[0], self._record(stream, blocking=True), self.device).wait()

    # ---------------------------------------------------------------- helpers
    @contextmanager
    def _copy(self) -> Any:
        with self._gate:
            if self._suspended:
                raise CacheSuspended("the KV cache is released for sleep mode")
            self._active += 1
        try:
            yield
        finally:
            with self._gate:
                self._active -= 1
                if not self._active:
                    self._gate.notify_all()

    def _index(self, ids: Sequence[int], timeout: float = 0.0) -> Any:
        """Block ids in pinned memory (a piece of the arena), for a copy to the device that does not wait."""
        assert self.arena is not None
        piece = self.arena.take(8 * len(ids), timeout)
        piece.tensor.view(torch.long)[:len(ids)].copy_(torch.as_tensor(list(ids), dtype=torch.long))
        return piece

    def _record(self, stream: Any, blocking: bool = False) -> Any:
        """An event on ``stream``; ``blocking``: a thread that waits for it sleeps instead of spinning a core."""
        with torch.cuda.device(self.device):
            event = torch.cuda.Event(blocking=blocking)
            event.record(stream)
        return event
