"""MooncakePipe: a tensor FIFO between two processes over Mooncake Transfer Engine registered buffers.

How one tensor travels (sender A -> receiver B):

1. A holds a TCP side channel to B (opened on first send, see ``_connect``) on which B announced, in its WELCOME,
   its engine session and the address of its registered *staging ring* (``staging_buffer_size`` bytes).
2. A sends a TENSOR frame (dtype, shape, size), then splits the bytes into chunks (``chunk_size``). For each:
   reserve ring space, start a one-sided Transfer Engine write into B's ring (over TCP straight from the tensor;
   RDMA and device tensors first copy into A's own registered staging area). Up to ``max_chunks_in_flight`` writes
   run at once; as each completes, a CHUNK frame tells B where it is.
3. B's ``recv_tensor`` takes the result from the endpoint's pool of memory kept mapped (``ResultPool``: a fresh
   result's page faults cost as much as the transfer; a slot is reused once the caller dropped every reference to
   its result) or allocates it, copies each chunk out of the ring and ACKs it, which frees the space for A's next
   chunks. Memory use is fixed: two staging areas plus the result tensor (and the pool, ``result_pool_size``).
4. Zero-copy receive (TCP, host result of at least ``DIRECT_MIN`` bytes): on the TENSOR frame B registers the
   result itself and offers it (DIRECT; its WELCOME told A whether it does). A writes a first small chunk to the ring
   meanwhile and then waits up to ``OFFER_WAIT`` for the offer (a receiver that is not reading yet gets its ring
   filled instead); from then on A writes the rest straight into it, in at most
   ``max_chunks_in_flight`` large writes started at once (every completion wakes a Python thread, which in a
   process with a busy Python thread waits up to the 5 ms GIL switch interval), and announces them with DCHUNK frames.
   B unregisters the result before returning it. Registering is bookkeeping over TCP with
   P2PHANDSHAKE (~0.1 ms); with a metadata server it would write to that server twice per tensor, and RDMA would
   pin memory per tensor, so those keep the ring.
5. Scatter targets (``recv_tensor(out=Scatter(...))``): the bytes go into several regions in order, e.g. the KV cache
   blocks a request loads into. Regions inside memory registered once with ``register_receive_region`` are offered
   to the sender as in 4 (with any metadata server: nothing is registered per tensor); otherwise chunks are copied
   out of the ring straight into the regions. Either way the bytes are copied once, into the place they are used.

Nothing on the side channel is executed or unpickled: frames are parsed by ``kv_pipe.wire`` and validated.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from kv_pipe import auth, wire
from kv_pipe.base import KVPipeBase
from kv_pipe.channel import Inbound, Outbound, tune
from kv_pipe.config import MooncakeTransferEngineConfig, join_host_port, parse_host_port
from kv_pipe.endpoint import DEFAULT_CHANNEL, HANDSHAKE_TIMEOUT, PipeEndpoint
from kv_pipe.errors import PeerDisconnected, PipeClosed, PipeError, PipeStalled, PipeTimeout, ProtocolError
from kv_pipe.memory import advise_huge_pages, copy_bytes, prefault
from kv_pipe.scatter import Scatter, split, within
from kv_pipe.wire import Chunk, DirectChunk, Kind, TensorHeader

logger = logging.getLogger(__name__)

DIRECT_MIN = 8 << 20  # tensors at least this large are received zero-copy (TCP): one round trip to set it up
FIRST_CHUNK = 1 << 20  # while that offer is on its way, only this much is written to the ring
OFFER_WAIT = 0.02  # then, if the receiver said it makes offers, wait this long for it before filling the ring
_WELCOME = {"session": str, "ring_addr": int, "ring_size": int, "max_chunk": int, "inline_max": int, "direct_recv": bool}


class MooncakePipe(KVPipeBase):
    """One end of a full-duplex tensor pipe: a link between two ``PipeEndpoint``s.

    ``MooncakePipe(local_rank, kv_rank, config)`` (vLLM v0's signature) makes an endpoint of its own on this side's
    mooncake.json address and links it to the other side's: kv_rank 0 is the producer end (``prefill_url`` port +
    local_rank), kv_rank 1 the consumer end (``decode_url`` port + local_rank); only that peer is admitted.
    ``PipeEndpoint.link(peer, channel)`` makes links to any number of peers (XpYd). ``config=None`` reads
    MOONCAKE_CONFIG_PATH. Received tensors are placed on ``device``. Thread-safe: concurrent senders (or receivers)
    are serialized.
    """

    def __init__(self, local_rank: int = 0, kv_rank: int = 0, config: MooncakeTransferEngineConfig | None = None,
                 device: str | torch.device = "cpu") -> None:
        config = config if config is not None else MooncakeTransferEngineConfig.load_from_env()
        host, port = config.pipe_address(kv_rank, local_rank)
        peer = join_host_port(*config.pipe_address(1 - kv_rank, local_rank))
        endpoint = PipeEndpoint(config, host, port, kv_rank=kv_rank, local_rank=local_rank, device=device, peers={peer},
                                start=False)
        try:
            self._init_link(endpoint, peer, DEFAULT_CHANNEL, owns_endpoint=True)
            endpoint.adopt(self)
            endpoint.start()  # only now: a peer connecting earlier would have made a link of its own
        except BaseException:
            endpoint.close()
            raise

    @classmethod
    def linked(cls, endpoint: PipeEndpoint, peer: str, channel: str) -> MooncakePipe:
        """The link of ``endpoint`` to the peer endpoint at ``peer`` on ``channel`` (use ``PipeEndpoint.link``)."""
        pipe = cls.__new__(cls)
        pipe._init_link(endpoint, peer, channel, owns_endpoint=False)
        return pipe

    def _init_link(self, endpoint: PipeEndpoint, peer: str, channel: str, owns_endpoint: bool) -> None:
        self.endpoint = endpoint
        self.config = endpoint.config
        self.kv_rank, self.local_rank = endpoint.kv_rank, endpoint.local_rank
        self.device = endpoint.device
        self.host, self.port = endpoint.host, endpoint.port
        self.peer_host, self.peer_port = parse_host_port(peer, "peer address")
        self.peer = join_host_port(self.peer_host, self.peer_port)
        self.channel = channel
        self._owns_endpoint = owns_endpoint
        self._engine = endpoint.engine
        self._closed = threading.Event()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._state = threading.Condition()  # guards _inbound / _outbound replacement and the ring
        self._inbound: Inbound | None = None
        self._read_from: Inbound | None = None  # the connection the last recv_tensor read from
        self._outbound: Outbound | None = None
        self._ring: torch.Tensor | None = None  # where the peer writes chunks: taken when it first connects
        self._stage: torch.Tensor | None = None
        self._peer_was_up = False  # a refused connection then means "down", not "still starting"
        self._quarantine: deque[tuple[float, torch.Tensor]] = deque()  # results of failed direct receives
        self._receiving = False  # a tensor's bytes are being received (set under the receive lock)
        self.last_used = time.monotonic()
        # received through the ring / written into results directly, and in how many direct writes
        self.stats = {"ring_bytes": 0, "direct_bytes": 0, "direct_writes": 0}

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def has_ring(self) -> bool:
        """A peer connected to send to us: this link holds a staging ring."""
        return self._ring is not None

    @property
    def busy(self) -> bool:
        """A tensor is being sent (or the link opened for it) or received on this link."""
        return self._send_lock.locked() or self._receiving

    # ------------------------------------------------------------------ sending
    def send_tensor(self, tensor: torch.Tensor | None, timeout: float | None = None) -> None:
        timeout = self.config.timeout if timeout is None else timeout
        if tensor is not None:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"send_tensor takes a torch.Tensor or None, got {type(tensor).__name__}")
            if tensor.dtype not in wire.DTYPE_TO_CODE:
                raise TypeError(f"dtype {tensor.dtype} cannot be sent through the pipe")
            if tensor.dim() > wire.MAX_NDIM:
                raise ValueError(f"tensor has {tensor.dim()} dimensions; the pipe carries at most {wire.MAX_NDIM}")
        with self._send_lock:
            self._check_open()
            out = self._outbound if self._outbound is not None and self._outbound.alive else self._connect(timeout)
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

    def _staging(self) -> torch.Tensor:
        """The registered area chunks are copied into before they are written (RDMA, device tensors, or
        zero_copy_send off); allocated on first use (under the send lock): over TCP from host memory it is never
        needed, and faulting in its pages made a link's first transfer slow."""
        if self._stage is None:
            self._stage = self._engine.allocate(self.config.staging_buffer_size, pin=torch.cuda.is_available())
        return self._stage

    def _send(self, out: Outbound, tensor: torch.Tensor, timeout: float) -> None:
        src = tensor.detach()
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
        # and save a copy per byte. RDMA needs registered memory, and device tensors go through the pinned stage.
        direct = self.config.zero_copy_send and self.config.protocol == "tcp" and flat.device.type == "cpu"
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
        deadline = time.monotonic() + timeout
        last_error = "no attempt yet"  # text only: a kept exception would pin this frame (and the pipe) via its traceback
        while True:
            self._check_open()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PipeTimeout(f"could not reach the peer pipe at {self.peer} within {timeout:.1f} s ({last_error}); "
                                  f"is the kv_rank {1 - self.kv_rank} side running, listening on that address?")
            try:
                sock = socket.create_connection((self.peer_host, self.peer_port), timeout=min(remaining, 5.0),
                                                source_address=(self.host, 0))
            except OSError as e:
                if isinstance(e, ConnectionRefusedError) and self._peer_was_up:
                    # It answered before and nothing listens now: it is down, not starting. Fail fast (the caller
                    # may fall back, e.g. recompute); a later send tries again and finds it once it is back.
                    raise PeerDisconnected(f"peer pipe at {self.peer} is down (connection refused)") from None
                last_error = str(e)
                time.sleep(min(0.05, max(remaining, 0)))
                continue
            if sock.getsockname() == sock.getpeername():
                # Nothing listened yet and the kernel gave us the peer's port as our own source port: TCP connected
                # the socket to itself (we would read our own HELLO). Not the peer: try again.
                sock.close()
                last_error = "connected to itself (the peer is not listening yet)"
                time.sleep(min(0.05, max(remaining, 0)))
                continue
            try:
                return self._handshake_out(sock, min(max(remaining, 0.1), HANDSHAKE_TIMEOUT), timeout)
            except OSError as e:
                sock.close()
                last_error = str(e)
                time.sleep(0.05)
            except PeerDisconnected:
                sock.close()
                raise
            except Exception as e:  # a malformed answer: refused, whatever broke on it
                sock.close()
                raise ProtocolError(f"handshake with {self.peer} failed: {e}") from None

    def _handshake_out(self, sock: socket.socket, handshake_timeout: float, timeout: float) -> Outbound:
        tune(sock)
        sock.settimeout(handshake_timeout)
        ours = auth.nonce()
        # "to": the endpoint we dialed. Both proofs cover it, so a handshake relayed to another endpoint fails there.
        hello = wire.encode_json(Kind.HELLO, {"kv_rank": self.kv_rank, "local_rank": self.local_rank,
                                              "address": self.endpoint.address, "to": self.peer,
                                              "channel": self.channel, "nonce": ours})
        sock.sendall(hello)
        hello_payload = hello[wire.HEADER.size:]
        payload = self._expect(sock, Kind.CHALLENGE)
        # the peer proves that it knows the secret, then we do; nothing about our memory is sent (kv_pipe/auth.py)
        challenge = wire.decode_json(payload, {"nonce": str, "proof": str})
        theirs = auth.check_nonce(challenge["nonce"], "CHALLENGE")
        secret = self.config.secret
        auth.verify(secret, "endpoint", challenge["proof"], hello_payload, theirs, who=f"the peer pipe at {self.peer}")
        session = self._engine.session
        sock.sendall(wire.encode_json(Kind.AUTH, {"session": session, "proof": auth.proof(
            secret, "link", hello_payload, theirs, session)}))
        payload = self._expect(sock, Kind.WELCOME)
        welcome = wire.decode_json(payload, _WELCOME)
        if welcome["ring_size"] <= 0 or welcome["max_chunk"] <= 0 or welcome["ring_addr"] <= 0:
            raise ProtocolError(f"WELCOME announces an unusable ring: {welcome}")
        ring_size = min(welcome["ring_size"], self.config.staging_buffer_size)  # our stage mirrors the ring's offsets
        chunk_size = min(self.config.chunk_size, welcome["max_chunk"], ring_size // 2)
        sock.settimeout(timeout)
        inline_max = min(self.config.inline_max, welcome["inline_max"])
        out = Outbound(sock, self.peer, self._closed, session=welcome["session"], ring_addr=welcome["ring_addr"],
                       ring_size=ring_size, chunk_size=chunk_size, inline_max=inline_max,
                       offers_direct=welcome["direct_recv"])
        with self._state:
            self._outbound = out
        self._peer_was_up = True
        logger.info("pipe %s -> %s (%s) connected (peer engine %s, ring %d bytes, chunk %d bytes)",
                    self.endpoint.address, self.peer, self.channel, out.session, ring_size, chunk_size)
        return out

    def _expect(self, sock: socket.socket, expected: Kind) -> bytes:
        """The payload of the next handshake frame, which must be ``expected`` (an ERROR: the peer refused us)."""
        kind, payload = wire.recv_frame(sock)
        if kind == Kind.ERROR:
            sock.close()
            raise PeerDisconnected(f"peer {self.peer} refused the connection: {payload.decode('utf-8', 'replace')}")
        if kind != expected:
            raise ProtocolError(f"expected {expected.name}, got {kind.name}")
        return payload

    # ---------------------------------------------------------------- receiving
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
        timeout = self.config.timeout if timeout is None else timeout
        rest = max(timeout, self.config.timeout)  # each wait once a tensor has begun to arrive
        if isinstance(out, torch.Tensor) and (not out.is_contiguous() or out.device != self.device):
            raise ValueError(f"out must be a contiguous tensor on {self.device}")
        deadline = time.monotonic() + timeout
        with self._recv_lock:
            now = time.monotonic()
            while self._quarantine and self._quarantine[0][0] < now:
                self._quarantine.popleft()
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
        result = torch.empty(header.shape, dtype=header.dtype, device=self.device)
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
                # Writes the sender started may still land until its own timeout: keep the memory alive till then
                # (a caller's ``out`` buffer is the caller's: see the docstring of recv_tensor).
                self._quarantine.append((time.monotonic() + self.config.timeout + 5.0, result))
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

    # ---------------------------------------------------------------- accepting
    def attach_inbound(self, sock: socket.socket, who: str, session: str) -> None:
        """The peer connected to send to us (its HELLO was checked by the endpoint): welcome it, telling it where our
        ring is (registered on its first connection), and make it this link's inbound connection."""
        with self._state:
            self._check_open()
            old = self._inbound
            if old is not None and old.probe_alive():
                # The new connection proved what the old one did (the peer's address and host, the secret): the old
                # one is stale (the peer restarted, or its host vanished without a FIN) or was an impostor's; keeping
                # it would lock the peer out.
                logger.warning("pipe %s <- %s (%s): the peer connected again from %s; its older connection from %s "
                               "is closed", self.endpoint.address, self.peer, self.channel, who, old.peer)
                old.fail(PeerDisconnected(f"peer {self.peer} connected again: its older connection was closed"))
            if self._ring is None:
                self._ring = self.endpoint.take_ring(self)
            sock.settimeout(min(HANDSHAKE_TIMEOUT, self.config.timeout))
            sock.sendall(wire.encode_json(Kind.WELCOME, {
                "session": self._engine.session, "ring_addr": self._ring.data_ptr(), "ring_size": self._ring.numel(),
                "max_chunk": self.config.chunk_size, "inline_max": self.config.inline_max,
                "direct_recv": self.endpoint.offers}))
            sock.settimeout(self.config.timeout)
            self._inbound = Inbound(sock, who, self._closed, max_tensor_size=self.config.max_tensor_size,
                                    inline_max=self.config.inline_max)
            self._state.notify_all()
        self.last_used = time.monotonic()
        logger.info("pipe %s <- %s (%s) connected from %s (peer engine %s)", self.endpoint.address, self.peer,
                    self.channel, who, session)

    def abandon_receive(self, reason: str) -> None:
        """Drop the connection the peer sends on (see ``KVPipeBase.abandon_receive``): its next send connects
        afresh, and ``recv_tensor`` waits for that connection. Only the connection the last ``recv_tensor`` read
        from is dropped: one the peer made since is left alone."""
        inbound = self._read_from
        if inbound is not None:
            inbound.fail(PeerDisconnected(f"receiving from {self.peer} was abandoned: {reason}"))
            inbound.reported = True
        logger.warning("pipe %s <- %s (%s): dropped the connection in the middle of a message (%s)",
                       self.endpoint.address, self.peer, self.channel, reason)

    # ------------------------------------------------------------------ closing
    def _check_open(self) -> None:
        if self._closed.is_set():
            raise PipeClosed("the pipe is closed")

    def close(self) -> None:
        """Close this link (and the endpoint, if the pipe made its own). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._state:
            conns = [c for c in (self._outbound, self._inbound) if c is not None]
            self._state.notify_all()
        for conn in conns:
            conn.close()
        self.endpoint.forget(self)
        if self._owns_endpoint:
            self.endpoint.close()
        else:
            with self._send_lock, self._recv_lock:  # nothing reads or writes them any more
                for buf in (self._ring, self._stage):
                    if buf is not None:
                        self._engine.release(buf)
        logger.info("pipe %s <-> %s (%s) closed", self.endpoint.address, self.peer, self.channel)

    def __enter__(self) -> MooncakePipe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
