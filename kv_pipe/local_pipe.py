"""An in-process ``KVPipeBase``: two connected ends over in-memory queues, for fast tests of the layers above the pipe
(no Transfer Engine, no sockets, no child process).

It keeps the contract of ``kv_pipe.base``: each direction is a FIFO; ``None`` passes through; a tensor is copied when
sent (the sender may reuse it at once) and arrives bit for bit on the receiving end's device; a wait that runs out
raises ``PipeTimeout``; ``close()`` makes the pending and later calls of that end raise ``PipeClosed``, and the other
end, once it has received what was sent before, sees ``PeerDisconnected`` (as ``kv_pipe.errors`` defines it: the peer
closed the connection). A tensor arrives whole or not at all, so ``PipeStalled`` never happens here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from kv_pipe.base import KVPipeBase
from kv_pipe.devices import canonical, same_device
from kv_pipe.errors import PeerDisconnected, PipeClosed, PipeTimeout
from kv_pipe.scatter import Scatter
from kv_pipe.wire import DTYPE_TO_CODE

__all__ = ["LocalPipe", "LocalPipeConfig", "local_pipe_pair"]


@dataclass(frozen=True)
class LocalPipeConfig:
    """What a user of a pipe may read from its ``config`` (as from ``MooncakePipe.config``)."""

    timeout: float = 10.0


class _Link:
    """The state both ends share: one queue per direction (index: the receiving end) under one lock."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.queues: tuple[deque[torch.Tensor | None], deque[torch.Tensor | None]] = (deque(), deque())
        self.closed = [False, False]
        self.cv = threading.Condition()


class LocalPipe(KVPipeBase):
    """One end of a pair made by ``local_pipe_pair``."""

    def __init__(self, link: _Link, side: int, config: LocalPipeConfig, device: str | torch.device) -> None:
        self._link, self._side = link, side
        self.config = config
        self.device = canonical(device)

    @property
    def closed(self) -> bool:
        with self._link.cv:
            return self._link.closed[self._side]

    def _check(self, what: str) -> None:
        """Under the lock: raise if this end is closed."""
        if self._link.closed[self._side]:
            raise PipeClosed(f"{what} on a closed local pipe")

    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        timeout = self.config.timeout if timeout is None else timeout
        if tensor is not None:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"send_tensor takes a torch.Tensor or None, got {type(tensor).__name__}")
            if tensor.dtype not in DTYPE_TO_CODE:
                raise TypeError(f"dtype {tensor.dtype} cannot be sent through the pipe")
        # copied before it is queued: what the sender does to its tensor afterwards never shows
        copy = None if tensor is None else torch.empty(tensor.shape, dtype=tensor.dtype, device=self.device)
        if copy is not None and tensor is not None:
            copy.copy_(tensor.detach())
        link, peer = self._link, 1 - self._side
        deadline = time.monotonic() + timeout
        with link.cv:
            while True:
                self._check("send_tensor")
                if link.closed[peer]:
                    raise PeerDisconnected("the other end of the local pipe was closed")
                if link.capacity is None or len(link.queues[peer]) < link.capacity:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipeTimeout(f"the receiver made no room within {timeout:.1f} s")
                link.cv.wait(remaining)
            link.queues[peer].append(copy)
            link.cv.notify_all()

    def recv_tensor(self, timeout: float | None = None,
                    out: torch.Tensor | Scatter | None = None) -> torch.Tensor | None:
        """See ``KVPipeBase.recv_tensor``; ``out`` as in ``MooncakePipe.recv_tensor`` (a buffer large enough gets
        the bytes and the result is a view of it; a ``Scatter`` whose leading regions it fills exactly gets them and
        the result is a ``meta`` tensor; otherwise the result is a tensor of its own)."""
        timeout = self.config.timeout if timeout is None else timeout
        if isinstance(out, torch.Tensor) and (not out.is_contiguous() or not same_device(out.device, self.device)):
            raise ValueError(f"out must be a contiguous tensor on {self.device} (got one on {out.device})")
        link = self._link
        deadline = time.monotonic() + timeout
        with link.cv:
            while True:
                self._check("recv_tensor")
                queue = link.queues[self._side]
                if queue:
                    item = queue.popleft()
                    link.cv.notify_all()  # a sender may wait for room
                    break
                if link.closed[1 - self._side]:
                    raise PeerDisconnected("the other end of the local pipe was closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipeTimeout(f"nothing arrived within {timeout:.1f} s")
                link.cv.wait(remaining)
        if item is None or out is None:
            return item
        data = item.reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        if isinstance(out, Scatter):
            if nbytes and out.prefix(nbytes):
                out.copy_in(0, data)
                return torch.empty(item.shape, dtype=item.dtype, device="meta")
            return item
        room = out.reshape(-1).view(torch.uint8)
        if room.numel() < nbytes:
            return item
        room[:nbytes].copy_(data)
        return room[:nbytes].view(item.dtype).view(item.shape)

    def close(self) -> None:
        with self._link.cv:
            self._link.closed[self._side] = True
            self._link.cv.notify_all()


def local_pipe_pair(timeout: float = 10.0, capacity: int | None = None,
                    device: str | torch.device = "cpu") -> tuple[LocalPipe, LocalPipe]:
    """Two connected ends. ``timeout``: each end's configured timeout (``config.timeout``); ``capacity``: how many
    tensors a direction holds before ``send_tensor`` waits for the receiver (None: no limit)."""
    link = _Link(capacity)
    config = LocalPipeConfig(timeout)
    return LocalPipe(link, 0, config, device), LocalPipe(link, 1, config, device)
