"""The side channel of one pipe direction: a TCP connection carrying frames (``wire``) plus the ring bookkeeping.

The sender owns an ``Outbound``: it reserves space in the receiver's staging ring, writes the bytes there with the
Transfer Engine, then announces them with a frame; the receiver's ACK frames free the space again, and its DIRECT
frame (zero-copy receive) offers the current tensor's result as the target instead. The receiver owns an
``Inbound``: ``recv_tensor`` reads and validates the frames itself.

Ring positions are absolute byte counters (never wrap); a chunk sits at ``position % ring_size`` and never
straddles the end of the ring (the sender skips to the start instead), so each chunk is one contiguous slice.
"""

from __future__ import annotations

import copy
import logging
import socket
import threading
import time
from typing import Any

from kv_pipe import wire
from kv_pipe.errors import PeerDisconnected, PipeClosed, PipeError, PipeStalled, PipeTimeout, ProtocolError
from kv_pipe.wire import Chunk, Kind

logger = logging.getLogger(__name__)

_POLL = 0.25  # how often a blocked wait re-checks for close(); wake-ups on events are immediate
KEEPALIVE = (30, 10, 3)  # idle seconds, probe interval, probes: a peer host gone without a FIN is noticed in ~60 s
DIRECT_MIN = 8 << 20  # tensors at least this large are received zero-copy (TCP): one round trip to set it up


def tune(sock: socket.socket) -> None:
    """A side-channel socket: no Nagle delay; TCP keepalive, so that a peer whose host vanished does not hold its
    link (and lock out its own restart) until ``link_idle``."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Connection:
    """A connected, handshaken socket: locked sends, and one way to die (``fail``) that wakes every waiter."""

    def __init__(self, sock: socket.socket, peer: str, closed: threading.Event) -> None:
        self.sock = sock
        self.send_timeout = sock.gettimeout()
        self.peer = peer
        self._closed = closed  # the owning pipe's close flag
        self._send_lock = threading.Lock()
        self._dead = threading.Event()
        self._error: PipeError | None = None
        self._ending = False  # close() began: whatever ends the connection now, it was closed here

    @property
    def error(self) -> PipeError | None:
        """What killed the connection, as a new exception each time. The one kept carries no traceback: raising or
        keeping one that does would keep the frames it went through alive with the connection, and with them
        whatever they held (a failed receive's result: hundreds of MiB)."""
        return None if self._error is None else copy.copy(self._error)

    @property
    def alive(self) -> bool:
        return not self._dead.is_set()

    def probe_alive(self) -> bool:
        """Whether the peer still holds the connection open: it may have closed it (or died) with nobody reading
        since, e.g. a link it closed idle while our reply was on its way; a frame sent then would be lost unseen."""
        if self._dead.is_set():
            return False
        if not hasattr(socket, "TCP_INFO"):  # Linux only; elsewhere a dead peer shows on the next read or write
            return True
        try:
            state = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            state = -1
        if state != _TCP_ESTABLISHED:
            self.fail(PeerDisconnected(f"peer {self.peer} disconnected"))
            return False
        return True

    def send(self, frame: bytes) -> None:
        if self._dead.is_set():
            raise self.error or PeerDisconnected(f"connection to {self.peer} is closed")
        try:
            with self._send_lock:
                self.sock.sendall(frame)
        except TimeoutError:
            self.fail(PipeTimeout(f"sending to {self.peer} blocked longer than the timeout: the peer is not reading"))
            raise self.error from None
        except OSError as e:
            self.fail(PeerDisconnected(f"peer {self.peer} disconnected: {e}"))
            raise self.error from None

    def fail(self, error: PipeError) -> None:
        """Mark the connection dead with ``error`` (the first error wins) and close the socket."""
        if self._dead.is_set():
            return
        if self._ending and not isinstance(error, PipeClosed):  # e.g. the peer's FIN answering our BYE
            error = PipeClosed("the pipe was closed")
        self._error = copy.copy(error)  # a copy: ``error`` itself goes on with its traceback
        self._dead.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._on_dead()

    def close(self, join: bool = True) -> None:
        """Say BYE (best effort), then die with PipeClosed. ``join``: also wait for a reader thread to end."""
        self._ending = True
        if not self._dead.is_set():
            try:
                with self._send_lock:
                    self.sock.settimeout(1.0)
                    self.sock.sendall(wire.encode(Kind.BYE))
            except OSError:
                pass
        self.fail(PipeClosed("the pipe was closed"))

    def _on_dead(self) -> None:
        """Wake whoever waits on this connection."""


class Outbound(Connection):
    """Sender side: ring reservations, and a thread reading the ACKs that release them."""

    def __init__(self, sock: socket.socket, peer: str, closed: threading.Event, *, session: str,
                 ring_addr: int, ring_size: int, chunk_size: int, inline_max: int, offers_direct: bool = False,
                 peer_link: str = "") -> None:
        super().__init__(sock, peer, closed)
        self.session = session
        self.peer_link = peer_link  # the id of the peer's link that took this connection (WELCOME)
        self.offers_direct = offers_direct  # the receiver answers large tensors with DIRECT (WELCOME)
        self.inline_max = inline_max  # tensors up to this size travel inside their frame
        self.ring_addr = ring_addr
        self.ring_size = ring_size
        self.chunk_size = chunk_size
        self.written = 0  # absolute ring position after the last reserved chunk
        self.acked = 0  # absolute ring position the receiver has consumed up to
        self.tensor_seq = -1  # seq of the tensor being sent (TENSOR frames counted from 0)
        self._tensor_nbytes = 0
        self._offer: tuple[tuple[int, int], ...] | None = None  # the receiver's answer for the current tensor (() = no)
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read_loop, name=f"kv-pipe-acks-{peer}", daemon=True)
        self._reader.start()

    def close(self, join: bool = True) -> None:
        super().close()
        if join and self._reader is not threading.current_thread():
            self._reader.join(timeout=2.0)

    def _read_loop(self) -> None:
        keep_waiting = lambda: not self._closed.is_set() and not self._dead.is_set()  # noqa: E731
        try:
            while not self._dead.is_set():
                kind, payload = wire.recv_frame(self.sock, keep_waiting)
                self._handle(kind, payload)
        except ProtocolError as e:
            logger.error("dropping the connection to %s: %s", self.peer, e)
            self.fail(ProtocolError(f"peer {self.peer} sent a malformed frame: {e}"))
        except (ConnectionError, TimeoutError, OSError) as e:
            self.fail(PeerDisconnected(f"peer {self.peer} disconnected: {e}"))
        except PipeError as e:
            self.fail(e)

    def _place(self, length: int) -> tuple[int, int]:
        """(absolute start, ring offset) of the next chunk: never straddle the end, skip to the ring's start."""
        if not 0 < length <= self.ring_size // 2:
            raise ValueError(f"chunk of {length} bytes does not fit a ring of {self.ring_size}")
        start = self.written
        offset = start % self.ring_size
        if offset + length > self.ring_size:
            start += self.ring_size - offset
            offset = 0
        return start, offset

    def try_reserve(self, length: int) -> Chunk | None:
        """Claim ``length`` contiguous bytes of the receiver's ring if they are free now, else None."""
        start, offset = self._place(length)
        with self._cv:
            if start + length - self.acked > self.ring_size:
                return None
            self.written = start + length
        return Chunk(offset, length, start + length)

    def reserve(self, length: int, timeout: float) -> Chunk:
        """Wait until ``length`` contiguous bytes are free in the receiver's ring and claim them.

        Only ACKs free space, so the caller must have announced every chunk it wrote before waiting here.
        """
        start, offset = self._place(length)
        deadline = time.monotonic() + timeout
        with self._cv:
            while start + length - self.acked > self.ring_size:
                if self._dead.is_set():
                    raise self.error or PeerDisconnected(f"connection to {self.peer} is closed")
                if self._closed.is_set():
                    raise PipeClosed("the pipe was closed")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipeTimeout(f"the receiver at {self.peer} freed no staging space for {timeout:.1f} s "
                                      "(it is not calling recv_tensor, or it is frozen)")
                self._cv.wait(min(remaining, _POLL))
            self.written = start + length
        return Chunk(offset, length, start + length)

    def start_tensor(self, nbytes: int) -> int:
        """Number the next TENSOR frame (the receiver counts them alike) and forget any earlier DIRECT offer."""
        with self._cv:
            self.tensor_seq += 1
            self._tensor_nbytes = nbytes
            self._offer = None
            return self.tensor_seq

    def direct_target(self, seq: int, timeout: float = 0.0) -> tuple[tuple[int, int], ...] | None:
        """The receiver's regions (filled in order by the whole tensor) where tensor ``seq`` goes, if it offered them,
        waiting up to ``timeout`` seconds for its answer; None if it declined or has not answered."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while seq == self.tensor_seq and self._offer is None and not self._dead.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cv.wait(remaining)
            return (self._offer or None) if seq == self.tensor_seq else None

    def _handle(self, kind: Kind, payload: bytes) -> None:
        if kind == Kind.DIRECT:
            offer = wire.decode_direct(payload)
            with self._cv:
                if offer.seq > self.tensor_seq:
                    raise ProtocolError(f"DIRECT for tensor {offer.seq}, but only {self.tensor_seq + 1} were sent")
                if offer.seq == self.tensor_seq:  # an offer for a tensor already sent in full is simply late
                    if offer.nbytes != self._tensor_nbytes:
                        raise ProtocolError(f"DIRECT offers {offer.nbytes} bytes for a tensor of {self._tensor_nbytes}")
                    self._offer = offer.regions
                    self._cv.notify_all()
        elif kind == Kind.ACK:
            end = wire.decode_ack(payload)
            with self._cv:
                if not self.acked <= end <= self.written:
                    raise ProtocolError(f"ACK for ring position {end} outside [{self.acked}, {self.written}]")
                self.acked = end
                self._cv.notify_all()
        elif kind == Kind.BYE:
            raise PeerDisconnected(f"peer {self.peer} closed the pipe")
        elif kind == Kind.ERROR:
            raise PeerDisconnected(f"peer {self.peer} dropped us: {payload.decode('utf-8', 'replace')}")
        else:
            raise ProtocolError(f"unexpected {kind.name} frame on the sending side")

    def _on_dead(self) -> None:
        with self._cv:
            self._cv.notify_all()


class Inbound(Connection):
    """Receiver side: ``recv_tensor`` reads and validates frames straight from the socket (no thread, no queue:
    the kernel's socket buffer is the queue and back-pressures the sender)."""

    def __init__(self, sock: socket.socket, peer: str, closed: threading.Event, *, max_tensor_size: int,
                 inline_max: int) -> None:
        super().__init__(sock, peer, closed)
        self.max_tensor_size = max_tensor_size
        self.inline_max = inline_max
        self.consumed = 0  # absolute ring position up to which data was copied out
        self.tensor_seq = -1  # TENSOR frames received, counted like the sender does
        self.reported = False  # its error was raised to a caller already

    def next_frame(self, timeout: float, rest: float | None = None) -> tuple[Kind, Any]:
        """Read the next frame and validate it; ``PipeTimeout`` if none starts within ``timeout`` (the connection
        stays usable). Once its first byte came, each wait for the rest of it may take ``rest`` seconds (default:
        ``timeout``): a short poll never cuts a frame in half; ``PipeStalled`` if the rest does not come. Any error
        but that bare ``PipeTimeout`` kills the connection (a half-read frame cannot be resynchronised)."""
        if self._dead.is_set():
            raise self.error or PeerDisconnected(f"peer {self.peer} disconnected")
        rest = timeout if rest is None else rest
        try:
            head = self._read(wire.HEADER.size, time.monotonic() + timeout, idle_ok=True, rest=rest)
            kind, length = wire.decode_header(head)
            payload = self._read(length, time.monotonic() + rest, idle_ok=False, rest=rest) if length else b""
            if kind == Kind.TENSOR:
                header = wire.decode_tensor(payload, self.max_tensor_size)
                self.tensor_seq += 1
                return kind, header
            if kind == Kind.TENSOR_INLINE:
                return kind, wire.decode_tensor_inline(payload, self.inline_max)
            if kind == Kind.CHUNK:
                return kind, wire.decode_chunk(payload)
            if kind == Kind.DCHUNK:
                return kind, wire.decode_dchunk(payload)
            if kind == Kind.NONE:
                return kind, None
            if kind == Kind.BYE:
                raise PeerDisconnected(f"peer {self.peer} closed the pipe")
            raise ProtocolError(f"unexpected {kind.name} frame on the receiving side")
        except _Idle:
            raise PipeTimeout(f"nothing arrived from {self.peer} within {timeout:.1f} s") from None
        except ProtocolError as e:
            logger.error("dropping the connection from %s: %s", self.peer, e)
            self.fail(ProtocolError(f"peer {self.peer} sent a malformed frame: {e}"))
        except PipeError as e:
            self.fail(e)
        except (ConnectionError, OSError) as e:
            self.fail(PipeClosed("the pipe was closed") if self._closed.is_set()
                      else PeerDisconnected(f"peer {self.peer} disconnected: {e}"))
        raise self.error  # type: ignore[misc]

    def _read(self, n: int, deadline: float, idle_ok: bool, rest: float) -> bytearray:
        """``n`` bytes by ``deadline``; once some came, each wait for more may take ``rest`` seconds."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if idle_ok and got == 0:
                    raise _Idle
                raise PipeStalled(f"{self.peer} stalled in the middle of a frame ({got} of {n} bytes in {rest:.1f} s)")
            self.sock.settimeout(min(remaining, _POLL))
            try:
                k = self.sock.recv_into(view[got:])
            except TimeoutError:
                if self._closed.is_set():
                    raise PipeClosed("the pipe was closed") from None
                continue
            if k == 0:
                if self._closed.is_set():
                    raise PipeClosed("the pipe was closed")
                where = "" if got == 0 else f" mid-frame ({got}/{n} bytes)"
                raise ConnectionError(f"connection closed by peer{where}")
            got += k
            deadline = max(deadline, time.monotonic() + rest)
        return buf

    def ack(self, end: int) -> None:
        self.consumed = end
        self.sock.settimeout(self.send_timeout)  # reads shorten it
        self.send(wire.encode_ack(end))

    def offer_direct(self, nbytes: int, regions: tuple[tuple[int, int], ...]) -> None:
        """Ask the sender to write the rest of the current tensor straight into ``regions`` (registered, filled in
        order by the whole tensor); no regions: tell it not to wait for an offer."""
        self.sock.settimeout(self.send_timeout)
        self.send(wire.encode_direct(self.tensor_seq, nbytes, regions))


class _Idle(Exception):
    """No frame started before the deadline."""


_TCP_ESTABLISHED = 1  # tcp_info.tcpi_state
