"""The contract of a KV pipe: a FIFO of tensors (or ``None``) between two processes.

Same names as vLLM v0's ``kv_transfer.kv_pipe.base.KVPipeBase``, so code written against that design fits.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class KVPipeBase(ABC):
    """One end of a pipe. Both ends may send and receive: each direction is its own FIFO."""

    @abstractmethod
    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        """Send a tensor, or ``None``, to the other end.

        ``timeout`` (seconds, default: the pipe's configured one) bounds each wait for the receiver.
        Returns once the data sits in the receiver's memory (not necessarily received yet). The tensor may be
        reused by the caller as soon as this returns. Raises ``PipeTimeout`` if the receiver makes no room within
        the timeout, ``PeerDisconnected`` / ``TransferError`` if the peer is gone, ``PipeClosed`` after ``close()``,
        ``TypeError`` for a dtype the pipe cannot carry.
        """

    @abstractmethod
    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        """Receive the next tensor (or ``None``) sent by the other end, in send order.

        ``timeout`` (seconds, default: the pipe's configured one) bounds the wait for the next tensor to *start*
        arriving, so a caller may poll with a short one. Once it started, each wait for the rest of it (a large
        tensor's bytes come after its header) is bounded by the pipe's configured timeout, or by ``timeout`` if that
        is larger: a tensor whose bytes come later than the poll interval is still received whole.
        The result equals what was sent bit for bit (dtype, shape, values) and lives on the pipe's device.
        Raises ``PipeTimeout`` if nothing arrives within the timeout (nothing was consumed: call again),
        ``PipeStalled`` (a ``PipeTimeout``) if a tensor began to arrive and its rest did not (that tensor is lost:
        never mistake this for idleness), ``PeerDisconnected`` if the peer died, ``ProtocolError`` on a malformed
        frame, ``PipeClosed`` if ``close()`` is called meanwhile.
        """

    def abandon_receive(self, reason: str) -> None:
        """The caller gave up in the middle of a message made of several tensors: what is still in flight could not
        be told apart from the next message. Make the next ``recv_tensor`` start clean. Default: ``close()``."""
        self.close()

    @abstractmethod
    def close(self) -> None:
        """Release every resource and unblock any call blocked in this pipe. Idempotent."""
