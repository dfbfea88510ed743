"""Copies between the paged KV cache and host memory that never stall the forward pass.

Host caches: ``block_copy``'s memmoves, done at once (there is no device to wait for).

Device caches (CUDA): the Transfer Engine moves host memory over TCP, so blocks are staged in pinned host memory by
copies on two streams of the worker's own, never by a synchronizing call in the forward pass's thread:

- **Out of the cache** (a save, a push): an event recorded on the caller's stream (the forward pass's) orders the copy
  after the kernels queued so far, among them the ones that wrote those blocks; the blocks are gathered on the device
  and copied into pinned host memory on the ``out`` stream. The caller gets the host tensor and a wait for that
  copy's event (``Staged.wait``): the thread that sends it waits, the forward pass goes on. The next step's kernels
  may reuse blocks a finished request gave back: ``fence`` (at the start of every step) makes the forward stream
  wait, on the device, for the copies out of the cache queued so far.
- **Into the cache** (a load): the blocks were just handed to the request and kernels of their previous owner may
  still be queued, so the copy waits on the ``in`` stream for an event recorded when the step that started the load
  began (``mark``); the loader thread then waits for the copy's event before it reports the load done, and vLLM
  runs the request only after that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv_connector import block_copy

CHUNK_BYTES = 64 << 20  # device memory a copy uses at a time beyond the cache (bounded whatever the prompt's size)


@dataclass
class Staged:
    """A host tensor that may still be being filled: ``wait()`` returns once it is (at once for a host copy)."""

    tensor: torch.Tensor
    done: Any = None  # torch.cuda.Event of the copy, or None when it is complete
    device: torch.device | None = None  # the event's device

    def wait(self) -> None:
        if self.done is not None:
            with torch.cuda.device(self.device):  # from any thread, without touching another GPU's context
                self.done.synchronize()  # an event wait: not a device or stream synchronize


class KVStaging:
    """Copies for one worker's KV cache ``layers`` (blocks along ``block_dim``); see the module docstring."""

    def __init__(self, layers: Sequence[torch.Tensor], block_dim: int) -> None:
        self.layers, self.block_dim = list(layers), block_dim
        self.device = self.layers[0].device
        self.on_device = self.device.type == "cuda"
        self._out = torch.cuda.Stream(self.device) if self.on_device else None
        self._in = torch.cuda.Stream(self.device) if self.on_device else None
        self._last_out: Any = None  # the event of the latest copy out of the cache
        self._step: Any = None  # recorded on the forward stream by ``mark``
        row = math.prod(self.layers[0].shape) // self.layers[0].shape[block_dim] * self.layers[0].element_size()
        self._rows_per_chunk = max(1, CHUNK_BYTES // (row * len(self.layers)))  # of the block-major tensor

    # ---------------------------------------------------------------- the forward pass's thread
    def mark(self) -> None:
        """A step that starts loads begins: loads copy into the cache only after the work queued so far."""
        if self.on_device:
            self._step = self._record(torch.cuda.current_stream(self.device))

    def fence(self) -> None:
        """A step begins: its kernels wait (on the device) for the copies out of the cache queued before it."""
        if self.on_device and self._last_out is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_out)

    def gather(self, ids: Sequence[int], layer: int | None = None, scratch: torch.Tensor | None = None) -> Staged:
        """Blocks ``ids`` of every layer (or of ``layer`` only) as a block-major host tensor ``[len(ids), layers,
        *block_shape]`` (``block_copy.gather``; on the host a view of ``scratch`` if it is large enough)."""
        layers = self.layers if layer is None else [self.layers[layer]]
        if not self.on_device:
            return Staged(block_copy.gather(layers, self.block_dim, ids, scratch))
        shape = [len(ids), len(layers), *block_copy.block_shape(layers[0], self.block_dim)]
        host = torch.empty(shape, dtype=layers[0].dtype, pin_memory=True)
        after = self._record(torch.cuda.current_stream(self.device))
        index = _index(ids)
        with torch.cuda.device(self.device), torch.cuda.stream(self._out):
            self._out.wait_event(after)
            device_index = index.to(self.device, non_blocking=True)
            step = self._rows_per_chunk * (len(self.layers) // len(layers))
            for lo in range(0, len(ids), step):  # a bounded piece at a time: no prompt-sized device buffer
                part = device_index[lo:lo + step]
                dense = torch.stack([t.index_select(self.block_dim, part).movedim(self.block_dim, 0) for t in layers],
                                    dim=1)
                host[lo:lo + step].copy_(dense, non_blocking=True)
            done = self._record(self._out)
        self._last_out = done
        return Staged(host, done, self.device)

    def drain(self) -> None:
        """Return once every copy out of the cache queued so far has ended (before the cache's memory goes away)."""
        if self._last_out is not None:
            Staged(self.layers[0], self._last_out, self.device).wait()

    # ---------------------------------------------------------------- loader threads
    def bind_thread(self) -> None:
        """Make the cache's GPU this thread's current device (a loader thread's first act): what it allocates in
        pinned memory or asks of CUDA then never touches another GPU (a new thread starts on GPU 0)."""
        if self.on_device:
            torch.cuda.set_device(self.device)

    def scatter(self, ids: Sequence[int], kv: torch.Tensor, heads: tuple[int, int] | None = None,
                layer: int | None = None, wait: bool = True) -> Staged:
        """Write the first ``len(ids)`` rows of the block-major host tensor ``kv`` into blocks ``ids`` of every layer
        (or of ``layer`` only; ``heads``: only that range of each block's first dimension, as
        ``block_copy.scatter``). ``wait``: return once the bytes are in place, else ``Staged.wait`` does. If it
        raises, no copy it queued is still running."""
        layers = self.layers if layer is None else [self.layers[layer]]
        if not self.on_device:
            block_copy.scatter(layers, self.block_dim, ids, kv, heads)
            return Staged(kv)
        n = len(ids)
        src = kv[:n].contiguous()
        if not src.is_pinned():  # a pageable source would make the copy wait for the stream in this thread
            pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            pinned.copy_(src)
            src = pinned
        index = _index(ids)
        if heads is not None:
            layers = [t.narrow(1, heads[0], heads[1] - heads[0]) for t in layers]
        with torch.cuda.device(self.device), torch.cuda.stream(self._in):
            try:
                if self._step is not None:
                    self._in.wait_event(self._step)
                device_index = index.to(self.device, non_blocking=True)
                step = self._rows_per_chunk * (len(self.layers) // len(layers))
                for lo in range(0, n, step):  # a bounded piece at a time: no prompt-sized device buffer
                    rows = src[lo:lo + step].to(self.device, non_blocking=True)
                    for li, t in enumerate(layers):
                        t.index_copy_(self.block_dim, device_index[lo:lo + step],
                                      rows[:, li].movedim(0, self.block_dim))
            except BaseException:  # the caller may reuse ``kv`` and vLLM the blocks once this returns
                Staged(kv, self._record(self._in), self.device).wait()
                raise
            staged = Staged(kv, self._record(self._in), self.device)
        if wait:
            staged.wait()
        return staged

    def _record(self, stream: Any) -> Any:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record(stream)
        return event


def _index(ids: Sequence[int]) -> torch.Tensor:
    """Block ids in pinned host memory, for a copy to the device that does not wait."""
    return torch.tensor(list(ids), dtype=torch.long).pin_memory()
