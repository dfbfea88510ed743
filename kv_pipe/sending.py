"""Sending on a link: ``send_tensor``, which opens the link's outbound connection when there is none (the
connecting half of ``kv_pipe.handshake``) and schedules each tensor's chunks - Transfer Engine writes into the
receiver's staging ring, or straight into its result once it offered that (zero-copy receive), a bounded number in
flight, each announced by a frame when it is done (see ``kv_pipe.mooncake_pipe`` for the whole path).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kv_pipe import handshake, wire
from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.connections import DIRECT_MIN, Outbound
from kv_pipe.devices import to_host
from kv_pipe.errors import PipeError, PipeTimeout
from kv_pipe.memory import copy_bytes
from kv_pipe.node import Node
from kv_pipe.scatter import split
from kv_pipe.transfer_engine import MooncakeEngine
from kv_pipe.wire import Chunk, DirectChunk, Kind

logger = logging.getLogger(__name__)

FIRST_CHUNK = 1 << 20  # while a zero-copy offer is on its way, only this much is written to the ring
OFFER_WAIT = 0.02  # then, if the receiver said it makes offers, wait this long for it before filling the ring


class Sender:
    """The sending half of ``MooncakePipe`` (a mixin: the state is the pipe's, set up by ``MooncakePipe._init_link``)."""

    endpoint: Node[Any]
    config: MooncakeTransferEngineConfig
    kv_rank: int
    local_rank: int
    host: str
    peer_host: str
    peer_port: int
    peer: str
    channel: str
    last_used: float
    _engine: MooncakeEngine
    _closed: threading.Event
    _closing: bool
    _send_lock: threading.Lock
    _state: threading.Condition
    _outbound: Outbound | None
    _stage: torch.Tensor | None
    _peer_was_up: bool
    link_id: str
    _check_open: Callable[[], None]

    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        timeout = self.config.timeout if timeout is None else timeout
        if tensor is not None:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"send_tensor takes a torch.Tensor or None, got {type(tensor).__name__}")
            if tensor.dtype not in wire.DTYPE_TO_CODE:
                raise TypeError(f"dtype {tensor.dtype} cannot be sent through the pipe")
            if tensor.dim() > wire.MAX_NDIM:
                raise ValueError(f"tensor has {tensor.dim()} dimensions; the pipe carries at most {wire.MAX_NDIM}")
        # the timeout covers the wait for another sender on this pipe too (e.g. one connecting to a peer that is down)
        start = time.monotonic()
        if not self._send_lock.acquire(timeout=max(timeout, 0.0)):
            raise PipeTimeout(f"pipe to {self.peer}: another send held the pipe for the whole timeout ({timeout:.1f} s)")
        try:
            self._check_open()
            timeout = max(timeout - (time.monotonic() - start), 0.001)
            out = self._outbound if self._outbound is not None and self._outbound.probe_alive() else self._connect(timeout)
            try:
                if tensor is None:
                    out.send(wire.encode(Kind.NONE))
                else:
                    self._send(out, tensor, timeout)
            except PipeError as e:
                out.fail(e)  # a half-sent tensor leaves the stream unusable: the next send reconnects
                raise
            finally:
                self.last_used = time.monotonic()
        finally:
            self._send_lock.release()

    def _staging(self) -> torch.Tensor:
        """The registered area chunks are copied into before they are written (RDMA, or zero_copy_send off);
        allocated on first use (under the send lock): over TCP it is never needed, and faulting in its pages made a
        link's first transfer slow."""
        if self._stage is None:
            self._stage = self._engine.allocate(self.config.staging_buffer_size)
        return self._stage

    def _send(self, out: Outbound, tensor: torch.Tensor, timeout: float) -> None:
        # A device tensor is staged whole in pinned host memory by one copy on the caller's stream (its wait is for
        # that copy's event, not for the device), then sent as host memory.
        src = to_host(tensor.detach())
        if not src.is_contiguous():
            src = src.contiguous()
        nbytes = src.numel() * src.element_size()
        shape = tuple(src.shape)
        flat = src.reshape(-1).view(torch.uint8)
        if nbytes <= out.inline_max:  # small: the bytes ride in the frame that announces them
            data = flat.cpu().numpy().tobytes() if nbytes else b""
            out.send(wire.encode_tensor_inline(src.dtype, shape, data))
            return
        # Over TCP the engine reads the source with plain socket writes, so host memory needs no registration: write
        # straight from the tensor (it stays alive and untouched until every write is done: this call waits for them)
        # and save a copy per byte. RDMA needs registered memory: it goes through the stage.
        direct = self.config.zero_copy_send and self.config.protocol == "tcp"
        stage = None if direct else self._staging()
        stage_addr = 0 if stage is None else stage.data_ptr()
        # A large tensor may be written straight into the receiver's result (zero-copy receive): a receiver that said
        # so in its WELCOME offers it (DIRECT) when it reads this header. Until a first small chunk is done only that
        # chunk is in flight, so the offer, which takes one round trip, usually arrives before more went to the ring.
        offer_expected = direct and nbytes >= DIRECT_MIN and out.offers_direct
        seq = out.start_tensor(nbytes)
        out.send(wire.encode_tensor(src.dtype, shape, nbytes))
        inflight: deque[tuple[int, Chunk | DirectChunk]] = deque()
        announced = 0
        direct_piece = 0  # once offered: the rest goes in max_chunks_in_flight writes at most, all started at once
        offer_waited = False

        def announce_oldest() -> None:
            nonlocal announced
            batch, piece = inflight.popleft()
            self._engine.wait(batch, out.session, piece.length, timeout)
            out.send(wire.encode_chunk(piece) if isinstance(piece, Chunk) else wire.encode_dchunk(piece.pos, piece.length))
            announced += 1

        pos = 0
        try:
            while pos < nbytes:
                target = None
                if offer_expected:
                    # Once the first chunk is done, wait a little for the offer: the receiver answers as soon as it
                    # reads the header; if it is not reading yet (busy, or sending to us itself), fill its ring.
                    wait = OFFER_WAIT if announced and not offer_waited else 0.0
                    offer_waited = offer_waited or wait > 0
                    target = out.direct_target(seq, wait)
                waiting_offer = offer_expected and announced == 0 and target is None
                length = min(FIRST_CHUNK if waiting_offer else out.chunk_size, nbytes - pos)
                piece: Chunk | DirectChunk
                if target is not None:
                    # No ring to share: a few large writes instead of many chunk-sized ones. Each completion needs
                    # this thread, and next to a busy Python thread every wake-up waits for the GIL.
                    if not direct_piece:
                        direct_piece = max(out.chunk_size, -(-(nbytes - pos) // self.config.max_chunks_in_flight))
                    length = min(direct_piece, nbytes - pos)
                    piece = DirectChunk(pos, length)
                    parts = split(target, pos, length)
                    sources, done = [], 0
                    for _, n in parts:
                        sources.append(flat.data_ptr() + pos + done)
                        done += n
                    batch = self._engine.write_async(out.session, sources, [a for a, _ in parts], [n for _, n in parts])
                else:
                    chunk = out.try_reserve(length)
                    if chunk is None and inflight:
                        announce_oldest()  # only announced chunks can be ACKed and so free ring space
                        continue
                    if chunk is None:
                        chunk = out.reserve(length, timeout)
                    if stage is None:
                        source = flat.data_ptr() + pos
                    else:
                        copy_bytes(stage[chunk.offset:chunk.offset + length], flat[pos:pos + length])
                        source = stage_addr + chunk.offset
                    piece = chunk
                    batch = self._engine.write_async(out.session, [source], [out.ring_addr + chunk.offset], [length])
                inflight.append((batch, piece))
                pos += length
                if len(inflight) >= (1 if waiting_offer else self.config.max_chunks_in_flight):
                    announce_oldest()  # copy the next chunk while the others are on the wire, up to the limit
            while inflight:
                announce_oldest()
        except BaseException:
            self._drain(inflight, out.session)
            raise

    def _drain(self, inflight: deque[tuple[int, Chunk]], peer: str) -> None:
        """After a failure, let writes still in flight finish (or fail) before the stage is reused."""
        for batch, chunk in inflight:
            try:
                self._engine.wait(batch, peer, chunk.length, min(self.config.timeout, 5.0))
            except PipeError:
                pass
        inflight.clear()


    def _connect(self, timeout: float) -> Outbound:
        """Open the side channel to the peer (retrying while it starts up) and handshake."""
        hello = {"kv_rank": self.kv_rank, "local_rank": self.local_rank, "address": self.endpoint.address,
                 "to": self.peer, "channel": self.channel, "link": self.link_id}
        return handshake.connect(self.peer_host, self.peer_port, hello, source_host=self.host,
                                 secret=self.config.secret, session=self._engine.session, timeout=timeout,
                                 peer_was_up=self._peer_was_up, check_open=self._check_open,
                                 use=lambda sock, welcome: self._outbound_from(sock, welcome, timeout))

    def _outbound_from(self, sock: socket.socket, welcome: dict[str, Any], timeout: float) -> Outbound:
        """The link's outbound connection on ``sock``, whose handshake ended with ``welcome``."""
        ring_size = min(welcome["ring_size"], self.config.staging_buffer_size)  # our stage mirrors the ring's offsets
        chunk_size = min(self.config.chunk_size, welcome["max_chunk"], ring_size // 2)
        sock.settimeout(timeout)
        inline_max = min(self.config.inline_max, welcome["inline_max"])
        out = Outbound(sock, self.peer, self._closed, session=welcome["session"], ring_addr=welcome["ring_addr"],
                       ring_size=ring_size, chunk_size=chunk_size, inline_max=inline_max,
                       offers_direct=welcome["direct_recv"], peer_link=welcome["link"])
        with self._state:
            closing = self._closing  # closed during the handshake: close() does not see this connection
            if not closing:
                self._outbound = out
        if closing:
            out.close()
            self._check_open()  # raises PipeClosed
        self._peer_was_up = True
        logger.info("pipe %s -> %s (%s) connected (peer engine %s, ring %d bytes, chunk %d bytes)",
                    self.endpoint.address, self.peer, self.channel, out.session, ring_size, chunk_size)
        return out
