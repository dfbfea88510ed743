"""Receiving on a link: ``recv_tensor`` reads a tensor's frames from the link's inbound connection and collects its
bytes - copied out of the staging ring chunk by chunk (each ACKed, which frees ring space for the sender), or
written by the sender straight into the result or the regions of a ``Scatter`` it was offered (zero-copy receive;
see ``kv_pipe.mooncake_pipe`` for the whole path).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kv_pipe import wire
from kv_pipe.addresses import join_host_port
from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.connections import DIRECT_MIN, Inbound
from kv_pipe.devices import pinned_empty, same_device, to_device
from kv_pipe.errors import PipeError, PipeStalled, PipeTimeout, ProtocolError
from kv_pipe.memory import advise_huge_pages, copy_bytes, prefault
from kv_pipe.node import Node
from kv_pipe.scatter import Scatter, within
from kv_pipe.transfer_engine import MooncakeEngine
from kv_pipe.wire import Chunk, Kind, TensorHeader


class Receiver:
    """The receiving half of ``MooncakePipe`` (a mixin: the state is the pipe's, set up by ``MooncakePipe._init_link``)."""

    endpoint: Node[Any]
    config: MooncakeTransferEngineConfig
    kv_rank: int
    device: torch.device
    host: str
    port: int
    peer: str
    channel: str
    last_used: float
    stats: dict[str, int]
    _engine: MooncakeEngine
    _closed: threading.Event
    _recv_lock: threading.Lock
    _state: threading.Condition
    _inbound: Inbound | None
    _read_from: Inbound | None
    _ring: torch.Tensor | None
    _receiving: bool
    _check_open: Callable[[], None]

    def register_receive_region(self, region: torch.Tensor) -> None:
        """See ``PipeEndpoint.register_receive_region`` (the region serves every link of this pipe's endpoint)."""
        self.endpoint.register_receive_region(region)

    def recv_tensor(self, timeout: float | None = None, out: torch.Tensor | Scatter | None = None) -> torch.Tensor | None:
        """See ``KVPipeBase.recv_tensor``. Without ``out``, a host result of 1 MiB or more lives in memory of the
        endpoint's result pool (``result_pool_size``), faulted in by its first use and reused for a later result only once
        nothing references this one any more (the result, a view or slice of it, its storage); use it as any tensor.
        ``out``: an optional contiguous buffer on the pipe's device to receive into
        (any dtype; the result is then a view of its first bytes, saving the page faults of a fresh allocation);
        if it is too small for the incoming tensor, a new tensor is allocated instead. If this call raises, the
        contents of ``out`` are undefined, and with zero-copy receive writes the sender had already started may still
        land in it for up to ``timeout`` + 5 s: do not reuse it for that long.

        ``out`` may also be a ``Scatter``: the tensor's bytes fill its regions in order and the result is a tensor on
        the ``meta`` device with the tensor's dtype and shape (the bytes are in the regions). If the tensor does not
        fill a whole number of leading regions (another size than expected), it is received into a new tensor,
        which is returned instead. With a Scatter, this call returns or raises only once no write of the sender can
        land in the regions any more (after a failure mid-tensor it waits the configured timeout + 5 s first).

        ``timeout`` bounds only the wait for the next tensor to *start* (its first frame: a caller may poll with a
        short one). Once it started, each wait for the rest (the frame's own bytes, then each CHUNK/DCHUNK frame)
        may take the configured ``timeout`` of the pipe, or ``timeout`` if larger: a tensor whose bytes come later
        than a poll interval is received whole, never cut off. A bare ``PipeTimeout`` therefore always means that
        nothing arrived (the pipe is as it was: call again); a tensor that began and then stopped coming raises
        ``PipeStalled`` (a ``PipeTimeout``): it is lost, with the connection that carried it."""
        if isinstance(out, torch.Tensor) and (not out.is_contiguous() or not same_device(out.device, self.device)):
            raise ValueError(f"out must be a contiguous tensor on {self.device} (got one on {out.device})")
        if self.device.type == "cpu":
            return self._recv(timeout, out)
        # A device pipe receives into pinned host memory (what the engine moves over TCP), then queues one copy onto
        # the device on the caller's stream: no per-chunk copies that each wait for the device.
        got = self._recv(timeout, out if isinstance(out, Scatter) else None)
        if got is None or got.device.type == "meta":
            return got
        return to_device(got, self.device, out if isinstance(out, torch.Tensor) else None)

    def _recv(self, timeout: float | None, out: torch.Tensor | Scatter | None) -> torch.Tensor | None:
        """``recv_tensor`` into host memory (``out``, if a tensor, is host memory)."""
        timeout = self.config.timeout if timeout is None else timeout
        rest = max(timeout, self.config.timeout)  # each wait once a tensor has begun to arrive
        deadline = time.monotonic() + timeout
        with self._recv_lock:
            inbound = self._read_from = self._wait_inbound(deadline, timeout)
            try:
                kind, item = inbound.next_frame(max(deadline - time.monotonic(), 0), rest)
            except PipeStalled:
                inbound.reported = True  # a frame broke off: the connection is dead
                raise
            except PipeTimeout:
                raise  # idle: nothing was half-received, the connection stays
            except PipeError:
                inbound.reported = True
                raise
            reserved = 0
            try:
                if kind == Kind.NONE:
                    return None
                if kind == Kind.TENSOR_INLINE:
                    data = torch.frombuffer(item.data, dtype=torch.uint8) if item.nbytes else None
                    if isinstance(out, Scatter) and out.prefix(item.nbytes) and data is not None:
                        out.copy_in(0, data)
                        return torch.empty(item.shape, dtype=item.dtype, device="meta")
                    result, _ = self._result(item, out if isinstance(out, torch.Tensor) else None)
                    if data is not None:
                        copy_bytes(result.reshape(-1).view(torch.uint8), data)
                    return result
                if kind != Kind.TENSOR:
                    raise ProtocolError(f"expected a TENSOR or NONE frame, got {kind.name}")
                self.endpoint.reserve(item.nbytes, self.peer)
                reserved = item.nbytes
                self._receiving = True
                if isinstance(out, Scatter) and item.nbytes and out.prefix(item.nbytes):
                    return self._receive_scatter(inbound, item, rest, out)
                result, mapped = self._result(item, out if isinstance(out, torch.Tensor) else None)
                return self._receive(inbound, item, rest, result, mapped)
            except PipeTimeout as e:  # after the header: never idleness (e.g. an ACK the sender did not take)
                stalled = e if isinstance(e, PipeStalled) else PipeStalled(
                    f"a tensor from {self.peer} ({self.channel}) broke off: {e}")
                inbound.fail(stalled)
                inbound.reported = True
                if stalled is e:
                    raise
                raise stalled from e
            except PipeError as e:
                inbound.fail(e)  # a half-received tensor leaves the stream unusable
                inbound.reported = True
                raise
            finally:
                if reserved:
                    self.endpoint.release(reserved)
                self._receiving = False
                self.last_used = time.monotonic()

    def _result(self, header: TensorHeader, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """Where a tensor is received, and whether that memory is known to be mapped already: ``out`` if it fits,
        else memory from the endpoint's pool (host results of 1 MiB or more), else a fresh tensor."""
        if out is not None and 0 < header.nbytes <= out.numel() * out.element_size():
            return out.reshape(-1).view(torch.uint8)[:header.nbytes].view(header.dtype).view(header.shape), False
        if header.data is None:
            pooled = self.endpoint.results.take(header.dtype, header.shape, header.nbytes)
            if pooled is not None:
                return pooled
        if self.device.type != "cpu":  # staged here, then copied onto the device (recv_tensor)
            return pinned_empty(header.shape, header.dtype), False
        result = torch.empty(header.shape, dtype=header.dtype)
        if header.data is None and self.config.huge_pages:
            advise_huge_pages(result.reshape(-1).view(torch.uint8))
        return result, False

    def _receive(self, inbound: Inbound, header: TensorHeader, timeout: float, result: torch.Tensor,
                 mapped: bool) -> torch.Tensor:
        """Collect a tensor's bytes: CHUNK frames point into the ring (copy out, ACK), DCHUNK frames say the
        sender wrote them into ``result`` itself (zero-copy receive, offered here for a large host result).
        ``mapped``: the result's pages are mapped already (a pool slot used before), so nothing is prefaulted."""
        if header.nbytes == 0:
            return result
        out = result.reshape(-1).view(torch.uint8)
        direct = (header.nbytes >= DIRECT_MIN and self.endpoint.direct_recv
                  and self._engine.register_region(out.data_ptr(), header.nbytes))

        def place(pos: int, data: torch.Tensor) -> None:
            end = pos + data.numel()
            copy_bytes(out[pos:end], data)
            if not direct and not mapped and end < header.nbytes:
                # While the next chunk is on the wire, fault in the memory it will be copied to (a fresh
                # result's page faults would otherwise double the cost of that copy).
                prefault(out[end:end + data.numel()])

        try:
            if direct:
                inbound.offer_direct(header.nbytes, ((out.data_ptr(), header.nbytes),))
            elif header.nbytes >= DIRECT_MIN and self.endpoint.offers:
                inbound.offer_direct(header.nbytes, ())  # the sender need not wait for an offer
            self._collect(inbound, header.nbytes, timeout, direct, place)
            return result
        except BaseException:
            if direct:
                # Writes the sender started may still land until its own timeout: keep the memory alive till then,
                # counted in the receive budget (a caller's ``out`` buffer is the caller's: see recv_tensor).
                self.endpoint.hold(result, self.config.timeout + 5.0)
                self.endpoint.results.forget(result)  # never handed to another receive, even once this pipe closed
            raise
        finally:
            if direct:
                self._engine.unregister_region(out.data_ptr())

    def _receive_scatter(self, inbound: Inbound, header: TensorHeader, timeout: float, target: Scatter) -> torch.Tensor:
        """Collect a tensor's bytes into the regions of ``target`` (which fill exactly ``header.nbytes``): offered for
        direct writes if they lie in registered memory, else copied out of the ring into them."""
        regions = target.prefix(header.nbytes)
        assert regions is not None
        direct = (header.nbytes >= DIRECT_MIN and self.endpoint.offers and len(regions) <= wire.MAX_REGIONS
                  and within(regions, [r for r, _ in self.endpoint.regions]))
        if header.nbytes >= DIRECT_MIN and self.endpoint.offers:
            inbound.offer_direct(header.nbytes, regions if direct else ())
        try:
            self._collect(inbound, header.nbytes, timeout, direct, target.copy_in)
            return torch.empty(header.shape, dtype=header.dtype, device="meta")
        except BaseException:
            if direct and not self._closed.is_set():
                # The regions belong to the caller (a KV cache vLLM reuses): writes the sender started may land until
                # its own timeout, so do not hand them back before that.
                self._closed.wait(self.config.timeout + 5.0)
            raise

    def _collect(self, inbound: Inbound, nbytes: int, timeout: float, direct: bool,
                 place: Callable[[int, torch.Tensor], None]) -> None:
        """Read a tensor's CHUNK frames (``place`` copies each out of the ring to its position, then it is ACKed) or,
        if ``direct`` was offered, DCHUNK frames (the sender wrote those bytes in place itself) until ``nbytes``."""
        ring = self._ring
        assert ring is not None  # registered before the peer could connect
        pos = 0
        while pos < nbytes:
            try:
                kind, piece = inbound.next_frame(timeout)
            except PipeStalled:
                raise
            except PipeTimeout:
                raise PipeStalled(f"a tensor of {nbytes} bytes from {self.peer} ({self.channel}) broke off: {pos} bytes "
                                  f"came, then nothing for {timeout:.1f} s (the sender is frozen or far too slow)") from None
            missing = nbytes - pos
            if kind == Kind.CHUNK:
                self._check_chunk(inbound, piece, missing, ring.numel())
                place(pos, ring[piece.offset:piece.offset + piece.length])
                inbound.ack(piece.end)
                self.stats["ring_bytes"] += piece.length
            elif kind == Kind.DCHUNK:
                if not direct:
                    raise ProtocolError("DCHUNK for a tensor that was not offered for direct writes")
                if piece.pos != pos or not 0 < piece.length <= missing:
                    raise ProtocolError(f"DCHUNK [{piece.pos}, +{piece.length}) where bytes [{pos}, {nbytes}) of the "
                                        "tensor are missing")
                self.stats["direct_bytes"] += piece.length
                self.stats["direct_writes"] += 1
            else:
                raise ProtocolError(f"expected a CHUNK frame ({missing} bytes of the tensor missing), got {kind.name}")
            pos += piece.length

    def _check_chunk(self, inbound: Inbound, chunk: Chunk, missing: int, ring_size: int) -> None:
        if not 0 < chunk.length <= missing:
            raise ProtocolError(f"chunk of {chunk.length} bytes where {missing} bytes of the tensor are missing")
        if chunk.offset + chunk.length > ring_size:
            raise ProtocolError(f"chunk [{chunk.offset}, +{chunk.length}) lies outside the {ring_size}-byte ring")
        if chunk.end < inbound.consumed + chunk.length:
            raise ProtocolError(f"chunk ends at ring position {chunk.end}, before the consumed position {inbound.consumed}")

    def _wait_inbound(self, deadline: float, timeout: float) -> Inbound:
        with self._state:
            while True:
                self._check_open()
                inbound = self._inbound
                if inbound is not None and not (inbound.reported and not inbound.alive):
                    return inbound
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipeTimeout(f"no peer connected to {join_host_port(self.host, self.port)} within {timeout:.1f} s; "
                                      f"is the kv_rank {1 - self.kv_rank} side running with the same mooncake.json?")
                self._state.wait(min(remaining, 0.25))

