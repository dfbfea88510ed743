"""MooncakePipe: a tensor FIFO between two processes over Mooncake Transfer Engine registered buffers: a TCP side
channel carries the frames (``kv_pipe.wire``), the engine writes the bytes one-sided into the receiver's staging ring
or straight into its result. This module holds the link itself (making it, taking the peer's connection, closing);
the sending half is ``kv_pipe.sending``, the receiving half ``kv_pipe.receiving``.

How a tensor travels: docs/architecture.md (The pipe's data path); the API: docs/api.md.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import torch

from kv_pipe import auth, handshake
from kv_pipe.addresses import join_host_port, parse_host_port
from kv_pipe.base import KVPipeBase
from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.connections import Inbound, Outbound
from kv_pipe.errors import PeerDisconnected, PipeClosed
from kv_pipe.handshake import DEFAULT_CHANNEL
from kv_pipe.node import Node
from kv_pipe.receiving import Receiver
from kv_pipe.sending import Sender

logger = logging.getLogger(__name__)


class MooncakePipe(Sender, Receiver, KVPipeBase):
    """One end of a full-duplex tensor pipe: a link between two ``PipeEndpoint``s.

    ``MooncakePipe(local_rank, kv_rank, config)`` (vLLM v0's signature) makes an endpoint of its own on this side's
    mooncake.json address and links it to the other side's: kv_rank 0 is the producer end (``prefill_url`` port +
    local_rank), kv_rank 1 the consumer end (``decode_url`` port + local_rank); only that peer is admitted.
    ``PipeEndpoint.link(peer, channel)`` makes links to any number of peers (XpYd). ``config=None`` reads
    MOONCAKE_CONFIG_PATH. Received tensors are placed on ``device`` (``cuda``: received into pinned host memory,
    then copied onto the device on the caller's current stream). Thread-safe: concurrent senders (or receivers)
    are serialized.
    """

    def __init__(self, local_rank: int = 0, kv_rank: int = 0, config: MooncakeTransferEngineConfig | None = None,
                 device: str | torch.device = "cpu") -> None:
        config = config if config is not None else MooncakeTransferEngineConfig.load_from_env()
        host, port = config.pipe_address(kv_rank, local_rank)
        peer = join_host_port(*config.pipe_address(1 - kv_rank, local_rank))
        endpoint: Node[MooncakePipe] = Node(config, host, port, link=MooncakePipe.linked, kv_rank=kv_rank,
                                            local_rank=local_rank, device=device, peers={peer}, start=False)
        try:
            self._init_link(endpoint, peer, DEFAULT_CHANNEL, owns_endpoint=True)
            endpoint.adopt(self)
            endpoint.start()  # only now: a peer connecting earlier would have made a link of its own
        except BaseException:
            endpoint.close()
            raise

    @classmethod
    def linked(cls, endpoint: Node[MooncakePipe], peer: str, channel: str) -> MooncakePipe:
        """The link of ``endpoint`` to the peer endpoint at ``peer`` on ``channel`` (use ``PipeEndpoint.link``)."""
        pipe = cls.__new__(cls)
        pipe._init_link(endpoint, peer, channel, owns_endpoint=False)
        return pipe

    def _init_link(self, endpoint: Node[MooncakePipe], peer: str, channel: str, owns_endpoint: bool) -> None:
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
        self._closing = False  # close() began
        self.link_id = auth.nonce()  # this link among all this endpoint makes to the peer: HELLO and WELCOME name it
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._state = threading.Condition()  # guards _inbound / _outbound replacement and the ring
        self._inbound: Inbound | None = None
        self._read_from: Inbound | None = None  # the connection the last recv_tensor read from
        self._outbound: Outbound | None = None
        self._ring: torch.Tensor | None = None  # where the peer writes chunks: taken when it first connects
        self._stage: torch.Tensor | None = None
        self._peer_was_up = False  # a refused connection then means "down", not "still starting"
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

    # ---------------------------------------------------------------- accepting
    def attach_inbound(self, sock: socket.socket, who: str, session: str, link: str) -> None:
        """The peer connected to send to us (its HELLO, naming the peer's ``link``, was checked by the endpoint):
        welcome it, telling it where our ring is (registered on its first connection), and make it this link's
        inbound connection. If the peer's link is not the one our outbound connection reaches, the peer made a new
        link (it closed the old one): our outbound connection is ended, as the peer's end of it is or soon will be,
        and our next send connects to the new link (an answer sent before that peer's FIN arrived would be lost)."""
        with self._state:
            self._check_open()
            out = self._outbound
            if out is not None and out.alive and out.peer_link != link:
                logger.info("pipe %s -> %s (%s): the peer made a new link; the connection to its old one is ended",
                            self.endpoint.address, self.peer, self.channel)
                out.fail(PeerDisconnected(f"peer {self.peer} made a new link: the connection to its old one ended"))
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
            handshake.welcome(sock, self.config.timeout, session=self._engine.session, ring_addr=self._ring.data_ptr(),
                              ring_size=self._ring.numel(), max_chunk=self.config.chunk_size,
                              inline_max=self.config.inline_max, direct_recv=self.endpoint.offers,
                              link=self.link_id)
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
    @property
    def closing(self) -> bool:
        """``close()`` began (the link shows ``closed`` once its connections are ended)."""
        return self._closing

    def wait_closed(self, timeout: float) -> bool:
        return self._closed.wait(timeout)

    def _check_open(self) -> None:
        if self._closing or self._closed.is_set():
            raise PipeClosed("the pipe is closed")

    def close(self) -> None:
        """Close this link (and the endpoint, if the pipe made its own). Idempotent."""
        with self._state:
            if self._closing:
                return
            self._closing = True
            conns = [c for c in (self._outbound, self._inbound) if c is not None]
        # Their ends reach the peer before this link shows as closed: a new link to the peer is made only then, and
        # the peer, seeing them ended, answers on the new one (an answer sent on an old one would be lost unseen).
        try:
            for conn in conns:
                conn.close(join=False)
        finally:
            self._closed.set()
            with self._state:
                conns += [c for c in (self._outbound, self._inbound) if c is not None and c not in conns]
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
