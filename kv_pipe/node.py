"""Node: the workings of a pipe endpoint - a Transfer Engine, a side-channel listener on the instance's own address,
and links to any number of peer endpoints, one per peer and channel, made on first use - whatever class its links
are. ``PipeEndpoint`` (``kv_pipe.endpoint``) is the node whose links are ``MooncakePipe``s; the link class is handed in
(``link``) rather than imported, so the pipe module builds on this one and not the other way round.

Links, channels and connections: docs/architecture.md (XpYd: endpoints, links and params); the API: docs/api.md.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, Self, TypeVar

import torch

from kv_pipe import handshake
from kv_pipe.acceptor import Acceptor
from kv_pipe.addresses import is_loopback, join_host_port, parse_host_port
from kv_pipe.config import MooncakeTransferEngineConfig, physical_memory
from kv_pipe.devices import canonical
from kv_pipe.errors import ConfigError, PipeError, ProtocolError
from kv_pipe.handshake import DEFAULT_CHANNEL, check_channel
from kv_pipe.memory import ResultPool
from kv_pipe.scatter import Region
from kv_pipe.transfer_engine import MooncakeEngine

logger = logging.getLogger(__name__)


class Link(Protocol):
    """What a node asks of its links (``MooncakePipe`` is one)."""

    peer: str
    channel: str
    last_used: float

    @property
    def closed(self) -> bool: ...

    @property
    def closing(self) -> bool: ...

    def wait_closed(self, timeout: float) -> bool: ...

    @property
    def has_ring(self) -> bool: ...

    @property
    def busy(self) -> bool: ...

    def attach_inbound(self, sock: socket.socket, who: str, session: str, link: str) -> None: ...

    def close(self) -> None: ...


L = TypeVar("L", bound=Link)


class Node(Generic[L]):
    """See the module docstring. ``link(node, peer, channel)`` makes the link of this node to ``peer`` on
    ``channel``. ``kv_rank`` 0 (producer) or 1 (consumer): links join a producer and a consumer with the same
    ``local_rank`` (TP rank), or any ranks with ``any_peer_rank`` (instances of different TP sizes).
    ``peers``: the only peer endpoints (``host:port``) admitted, None for any.
    ``link_idle``: seconds after which an unused link is closed (None: never). ``start=False``: accept nothing until
    ``start()``."""

    def __init__(self, config: MooncakeTransferEngineConfig, host: str, port: int, *,
                 link: Callable[[Node[L], str, str], L], kv_rank: int, local_rank: int = 0,
                 device: str | torch.device = "cpu", peers: set[str] | None = None,
                 link_idle: float | None = None, start: bool = True, any_peer_rank: bool = False) -> None:
        if kv_rank not in (0, 1):
            raise ConfigError(f"kv_rank must be 0 (producer) or 1 (consumer), got {kv_rank!r}")
        self.config = config
        self.host, self.port = host, port
        self.address = join_host_port(host, port)
        self.kv_rank, self.local_rank = kv_rank, local_rank
        self.any_peer_rank = any_peer_rank
        self.device = canonical(device)
        self.peers = None if peers is None else {self._normalize(p) for p in peers}
        self.link_idle = link_idle
        self.closed = threading.Event()
        self._make_link = link
        self._lock = threading.Lock()
        self._links: dict[tuple[str, str], L] = {}
        self._on_link: Callable[[L], None] | None = None
        self._receiving = 0  # bytes of the tensors being received by the links now, and of those held (see reserve)
        self._held: deque[tuple[float, int, torch.Tensor]] = deque()  # failed receives' results: (until, bytes, it)
        self._expiry: threading.Timer | None = None  # lets held results go when due
        # Zero-copy receive over TCP into host memory (see mooncake_pipe): offered to senders; with P2PHANDSHAKE also
        # into fresh results (registered per tensor), elsewhere only into regions registered once.
        # (A device pipe receives into pinned host memory too, then copies that onto the device.)
        self.offers = config.zero_copy_recv and config.protocol == "tcp"
        self.direct_recv = self.offers and config.metadata.backend == "p2p"
        self.regions: list[tuple[Region, torch.Tensor]] = []
        # Memory kept mapped for the results of recv_tensor() without out=, shared by every link (host results
        # only: a device result is allocated on the device, as before).
        self.results = ResultPool(config.result_pool_size if self.device.type == "cpu" else 0, config.huge_pages)
        self._acceptor = Acceptor(host, port, self.closed, self._handshake)
        try:
            self.engine = MooncakeEngine(config, host, port, local_rank)
            # The ring of the next link a peer opens, made in advance: fresh registered memory is slow to fault in
            # (far slower on a busy core), which a link's first request would otherwise wait for.
            self._spare: torch.Tensor | None = self._allocate_ring()
        except BaseException:
            self._acceptor.close()
            raise
        self._threads = [threading.Thread(target=self._acceptor.loop, name=f"kv-pipe-accept-{port}", daemon=True)]
        if link_idle is not None:
            self._threads.append(threading.Thread(target=self._reap_loop, name=f"kv-pipe-reaper-{port}", daemon=True))
        if start:
            self.start()
        logger.info("pipe endpoint kv_rank=%d local_rank=%d listening on %s, engine session %s", kv_rank, local_rank,
                    self.address, self.engine.session)
        if not config.secret:
            logger.warning("pipe endpoint %s runs WITHOUT a secret: any process that reaches %s can link to it and "
                           "read or plant KV (and the Transfer Engine's ports listen on every interface). Set "
                           "auth_secret in mooncake.json or MOONCAKE_KV_SECRET (see docs/deployment.md, Security)%s",
                           self.address, host, "" if is_loopback(host) else "; allow_unauthenticated is set")

    def start(self) -> None:
        """Start accepting peers (``start=False`` defers it, e.g. until a link made outside was adopted)."""
        for t in self._threads:
            if not t.is_alive() and t.ident is None:
                t.start()

    # ------------------------------------------------------------------ links
    def link(self, peer: str, channel: str = DEFAULT_CHANNEL) -> L:
        """The link to the endpoint listening at ``peer`` (``host:port``) on ``channel``, made if there is none (its
        connections open on first use)."""
        peer = self._normalize(peer)
        check_channel(channel)
        if self.peers is not None and peer not in self.peers:
            raise ConfigError(f"{peer} is not a peer of the pipe endpoint {self.address} (admitted: "
                              f"{', '.join(sorted(self.peers))})")
        if peer == self.address:
            raise ConfigError(f"{peer} is this endpoint's own address: a pipe links two endpoints")
        return self._live_link(peer, channel)[0]

    def _live_link(self, peer: str, channel: str) -> tuple[L, bool]:
        """(the link, whether it was made now). A link whose close is under way is waited for (up to the timeout),
        then made again: it shows closed only once its connections are ended, and a new link made before that
        could have its answers sent on them (``MooncakePipe.close``)."""
        for _ in range(2):
            with self._lock:
                if self.closed.is_set():
                    raise PipeError("the pipe endpoint is closed")
                pipe, new = self._link_locked(peer, channel)
            if not pipe.closing:
                break
            pipe.wait_closed(self.config.timeout)
        return pipe, new

    def _link_locked(self, peer: str, channel: str) -> tuple[L, bool]:
        """(the link, whether it was made now); under the lock."""
        pipe = self._links.get((peer, channel))
        if pipe is not None and not pipe.closed:
            return pipe, False
        pipe = self._make_link(self, peer, channel)
        self._links[(peer, channel)] = pipe
        return pipe, True

    def adopt(self, pipe: L) -> None:
        """Take a link made outside ``link`` (a ``MooncakePipe`` built with vLLM v0's signature makes its endpoint)."""
        with self._lock:
            self._links[(pipe.peer, pipe.channel)] = pipe

    def on_link(self, callback: Callable[[L], None] | None) -> None:
        """Call ``callback(pipe)`` for each link a peer makes (its first connection to this endpoint on a channel),
        in the handshake thread, before the peer's first frame is read. Set it before peers can connect (make the
        endpoint with ``start=False``, then ``start()``): a link made before is not reported."""
        self._on_link = callback

    def links(self) -> list[L]:
        with self._lock:
            return [p for p in self._links.values() if not p.closed]

    def forget(self, pipe: L) -> None:
        """A link closed: drop it (the next ``link`` makes a new one)."""
        with self._lock:
            if self._links.get((pipe.peer, pipe.channel)) is pipe:
                del self._links[(pipe.peer, pipe.channel)]

    def register_receive_region(self, region: torch.Tensor) -> None:
        """Keep this contiguous host tensor registered with the engine for the endpoint's lifetime, so that scatter
        targets inside it are written directly by senders (e.g. a KV cache). A peer's writes land in it only where a
        link of this endpoint offered them (see ``MooncakePipe.recv_tensor``)."""
        if region.device.type != "cpu" or not region.is_contiguous():
            raise ValueError("a receive region must be a contiguous host tensor")
        nbytes = region.numel() * region.element_size()
        if not self.engine.register_region(region.data_ptr(), nbytes):
            raise PipeError(f"the Transfer Engine refused to register {nbytes} bytes")
        self.regions.append(((region.data_ptr(), nbytes), region))

    def take_ring(self, pipe: L) -> torch.Tensor:
        """A registered, prefaulted staging ring for the inbound direction of ``pipe``: the spare one, made again in
        the background for the next link (an endpoint open to any peer; one with a fixed peer links once). At most
        ``max_links`` links hold one: beyond that the least recently used link not in use is closed first (its ring
        freed; either side makes the link again when needed), and if every one is in use the new link is refused."""
        with self._lock:
            holding = [p for p in self._links.values() if p.has_ring and p is not pipe and not p.closed]
            victim = None
            if len(holding) >= self.config.max_links:
                idle = [p for p in holding if not p.busy]
                if not idle:
                    raise PipeError(f"{len(holding)} links of {self.address} are in use (max_links): try again later")
                victim = min(idle, key=lambda p: p.last_used)
        if victim is not None:
            logger.info("closing the link %s -> %s (%s), unused for %.1f s, to make room for a new one (max_links %d)",
                        self.address, victim.peer, victim.channel, time.monotonic() - victim.last_used,
                        self.config.max_links)
            victim.close()
        with self._lock:
            ring, self._spare = self._spare, None
        if ring is None:
            ring = self._allocate_ring()
        if self.peers is None:
            threading.Thread(target=self._refill_spare, name=f"kv-pipe-ring-{self.port}", daemon=True).start()
        return ring

    def _allocate_ring(self) -> torch.Tensor:
        return self.engine.allocate(self.config.staging_buffer_size)

    def _refill_spare(self) -> None:
        if self.closed.is_set():
            return
        try:
            ring: torch.Tensor | None = self._allocate_ring()
        except Exception as e:  # e.g. the endpoint closed meanwhile: the next link allocates its own
            logger.debug("no spare ring made: %s", e)
            return
        with self._lock:
            if self._spare is None and not self.closed.is_set():
                self._spare, ring = ring, None
        if ring is not None:
            self.engine.release(ring)

    @staticmethod
    def _normalize(address: str) -> str:
        return join_host_port(*parse_host_port(address, "peer address"))

    # ---------------------------------------------------------------- accepting
    def _handshake(self, sock: socket.socket, source: str, who: str) -> None:
        """One incoming connection, start to end of its handshake (in a thread of the acceptor's); any failure closes
        this connection only."""
        try:
            hello, peer, session = handshake.authenticate(sock, source, self)
            self._acceptor.ended(sock, source)  # proved: its place is free for the next one
            pipe, new = self._live_link(peer, hello["channel"])
            if new and self._on_link is not None:
                self._on_link(pipe)
            pipe.attach_inbound(sock, who, session, hello["link"])
        except Exception as e:  # whatever a stranger sends, this connection ends and we go on
            handshake.refuse(sock, who, e)
        finally:
            self._acceptor.ended(sock, source)

    # ------------------------------------------------------------------ closing
    def _reap_loop(self) -> None:
        assert self.link_idle is not None
        while not self.closed.wait(min(self.link_idle / 4, 5.0)):
            # memory short: links unused for a tenth of link_idle give their rings back
            idle = self.link_idle / 10 if memory_short() else self.link_idle
            cutoff = time.monotonic() - idle
            for pipe in self.links():
                if pipe.last_used < cutoff and not pipe.busy:
                    logger.info("closing the idle link %s -> %s (%s; unused for %.0f s%s)", self.address, pipe.peer,
                                pipe.channel, time.monotonic() - pipe.last_used,
                                "; memory is short" if idle < self.link_idle else "")
                    try:
                        pipe.close()
                    except Exception:  # one link's failure must not end the reaping of the others
                        logger.exception("closing the idle link %s -> %s failed", self.address, pipe.peer)

    # ------------------------------------------------------------------ receive budget
    def reserve(self, nbytes: int, peer: str) -> None:
        """Count ``nbytes`` of a tensor about to be received against ``receive_budget`` (what all the links of this
        endpoint may be receiving or holding at once: a result's pages are mapped as its bytes arrive, so peers
        announcing large tensors together could otherwise commit far more than any one may send); ``ProtocolError``
        if it does not fit. ``release`` it when the receive ended, either way."""
        with self._lock:
            self._expire_locked()
            if self._receiving + nbytes > self.config.receive_budget:
                raise ProtocolError(f"{peer} announces a {nbytes}-byte tensor while this endpoint is receiving or "
                                    f"holding {self._receiving} bytes (receive_budget {self.config.receive_budget})")
            self._receiving += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._receiving -= nbytes

    def hold(self, result: torch.Tensor, seconds: float) -> None:
        """Keep the memory of a failed receive alive for ``seconds`` (writes its sender started may land in it until
        then), counted against ``receive_budget`` until it is let go: a peer that fails receives on purpose cannot
        make this endpoint hold more than the budget."""
        nbytes = result.numel() * result.element_size()
        with self._lock:
            self._held.append((time.monotonic() + seconds, nbytes, result))
            self._receiving += nbytes
            if self._expiry is None:
                self._arm_locked()

    def _arm_locked(self) -> None:
        """Let the first held result go when it is due (not only at the next receive's reservation)."""
        self._expiry = None
        if self._held and not self.closed.is_set():
            self._expiry = threading.Timer(max(self._held[0][0] - time.monotonic(), 0.0) + 0.01, self._expire_due)
            self._expiry.daemon = True
            self._expiry.start()

    def _expire_due(self) -> None:
        with self._lock:
            self._expire_locked()
            self._arm_locked()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        while self._held and self._held[0][0] <= now:
            _, nbytes, _ = self._held.popleft()
            self._receiving -= nbytes

    def close(self) -> None:
        """Close every link, the listener and the engine. Idempotent."""
        if self.closed.is_set():
            return
        self.closed.set()
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for pipe in links:
            pipe.close()
        self._acceptor.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2.0)
        self.engine.close()
        self.results.clear()
        with self._lock:
            if self._expiry is not None:
                self._expiry.cancel()
            self._held.clear()
        logger.info("pipe endpoint %s closed", self.address)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def memory_short(fraction: float = 0.1) -> bool:
    """Less than ``fraction`` of this machine's RAM is available (Linux's MemAvailable; False if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 < fraction * physical_memory()
    except (OSError, KeyError, ValueError):
        return False
