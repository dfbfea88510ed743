"""The side-channel handshake, both halves: how a link's sender opens its connection to the peer endpoint
(``connect``: dial, HELLO, check the CHALLENGE, AUTH, read the WELCOME) and how the endpoint it dialed takes it
(``authenticate`` the HELLO and AUTH, then ``welcome`` or ``refuse``), with the names the two agree on.

The proofs are ``kv_pipe.auth``'s, the frames ``kv_pipe.wire``'s; every field is validated, and nothing about memory
is sent before the connecting side proved that it knows the secret.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kv_pipe import auth, wire
from kv_pipe.addresses import join_host_port, parse_host_port
from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.connections import tune
from kv_pipe.errors import ConfigError, PeerDisconnected, PipeError, PipeTimeout, ProtocolError
from kv_pipe.wire import Kind

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
HELLO_TIMEOUT = 3.0  # a peer sends its HELLO as soon as it connected: a silent connection frees its slot soon
DEFAULT_CHANNEL = "kv"
_CHANNEL = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
MAX_PEER_RANKS = 1024
# "link": the id of the link (one pair of connections, ``MooncakePipe``) that sends the HELLO / the WELCOME: a peer
# that made a new link to us is told from one reconnecting its old one (``MooncakePipe.attach_inbound``)
HELLO = {"kv_rank": int, "local_rank": int, "address": str, "to": str, "channel": str, "nonce": str, "link": str}
CHALLENGE = {"nonce": str, "proof": str}
AUTH = {"session": str, "proof": str}
WELCOME = {"session": str, "ring_addr": int, "ring_size": int, "max_chunk": int, "inline_max": int, "direct_recv": bool,
           "link": str}

T = TypeVar("T")


def check_channel(channel: str) -> str:
    if not isinstance(channel, str) or not _CHANNEL.match(channel):
        raise ValueError(f"channel must be 1-32 characters [a-z0-9_-] starting with a letter, got {channel!r}")
    return channel


# ------------------------------------------------------------------ connecting
def connect(peer_host: str, peer_port: int, hello: dict[str, Any], *, source_host: str, secret: bytes, session: str,
            timeout: float, peer_was_up: bool, check_open: Callable[[], None],
            use: Callable[[socket.socket, dict[str, Any]], T]) -> T:
    """Open the side channel to the peer endpoint (retrying while it starts up) and handshake: ``hello`` is what
    this side says of itself (kv_rank, local_rank, address, to, channel, link; each attempt adds a fresh nonce),
    ``session`` its engine session. ``use(sock, welcome)`` makes the connection of the checked WELCOME; what it
    raises counts as a failed handshake. ``peer_was_up``: the peer answered before, so a refused connection means
    that it is down, not starting. ``check_open`` raises once the pipe is closed."""
    peer = join_host_port(peer_host, peer_port)
    deadline = time.monotonic() + timeout
    last_error = "no attempt yet"  # text only: a kept exception would pin this frame (and the pipe) via its traceback
    while True:
        check_open()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise PipeTimeout(f"could not reach the peer pipe at {peer} within {timeout:.1f} s ({last_error}); "
                              f"is the kv_rank {1 - hello['kv_rank']} side running, listening on that address?")
        try:
            sock = socket.create_connection((peer_host, peer_port), timeout=min(remaining, 5.0),
                                            source_address=(source_host, 0))
        except OSError as e:
            if isinstance(e, ConnectionRefusedError) and peer_was_up:
                # It answered before and nothing listens now: it is down, not starting. Fail fast (the caller
                # may fall back, e.g. recompute); a later send tries again and finds it once it is back.
                raise PeerDisconnected(f"peer pipe at {peer} is down (connection refused)") from None
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
            welcome = _introduce(sock, peer, hello, secret, session, min(max(remaining, 0.1), HANDSHAKE_TIMEOUT))
            return use(sock, welcome)
        except OSError as e:
            sock.close()
            last_error = str(e)
            time.sleep(0.05)
        except PeerDisconnected:
            sock.close()
            raise
        except Exception as e:  # a malformed answer: refused, whatever broke on it
            sock.close()
            raise ProtocolError(f"handshake with {peer} failed: {e}") from None


def _introduce(sock: socket.socket, peer: str, hello: dict[str, Any], secret: bytes, session: str,
               handshake_timeout: float) -> dict[str, Any]:
    """HELLO, the peer's CHALLENGE checked, AUTH; returns the peer's checked WELCOME."""
    tune(sock)
    sock.settimeout(handshake_timeout)
    ours = auth.nonce()
    # "to": the endpoint we dialed. Both proofs cover it, so a handshake relayed to another endpoint fails there.
    frame = wire.encode_json(Kind.HELLO, {**hello, "nonce": ours})
    sock.sendall(frame)
    hello_payload = frame[wire.HEADER.size:]
    payload = _expect(sock, peer, Kind.CHALLENGE)
    # the peer proves that it knows the secret, then we do; nothing about our memory is sent (kv_pipe/auth.py)
    challenge = wire.decode_json(payload, CHALLENGE)
    theirs = auth.check_nonce(challenge["nonce"], "CHALLENGE")
    auth.verify(secret, "endpoint", challenge["proof"], hello_payload, theirs, who=f"the peer pipe at {peer}")
    sock.sendall(wire.encode_json(Kind.AUTH, {"session": session, "proof": auth.proof(
        secret, "link", hello_payload, theirs, session)}))
    payload = _expect(sock, peer, Kind.WELCOME)
    welcome = wire.decode_json(payload, WELCOME)
    if welcome["ring_size"] <= 0 or welcome["max_chunk"] <= 0 or welcome["ring_addr"] <= 0:
        raise ProtocolError(f"WELCOME announces an unusable ring: {welcome}")
    auth.check_nonce(welcome["link"], "WELCOME: the link id")
    return welcome


def _expect(sock: socket.socket, peer: str, expected: Kind) -> bytes:
    """The payload of the next handshake frame, which must be ``expected`` (an ERROR: the peer refused us)."""
    kind, payload = wire.recv_frame(sock)
    if kind == Kind.ERROR:
        sock.close()
        raise PeerDisconnected(f"peer {peer} refused the connection: {payload.decode('utf-8', 'replace')}")
    if kind != expected:
        raise ProtocolError(f"expected {expected.name}, got {kind.name}")
    return payload


# ------------------------------------------------------------------- accepting
class Listening(Protocol):
    """What a HELLO is checked against: the endpoint that accepted the connection."""

    config: MooncakeTransferEngineConfig
    host: str
    port: int
    kv_rank: int
    local_rank: int
    any_peer_rank: bool
    peers: set[str] | None


def authenticate(sock: socket.socket, source: str, me: Listening) -> tuple[dict[str, Any], str, str]:
    """The peer's checked HELLO, the endpoint address it names (normalized) and its engine session, once it
    proved that it knows the secret (see ``kv_pipe.auth``); nothing about memory is sent before."""
    tune(sock)
    deadline = time.monotonic() + min(HANDSHAKE_TIMEOUT, me.config.timeout)
    kind, payload = wire.recv_frame(sock, deadline=min(deadline, time.monotonic() + HELLO_TIMEOUT))
    if kind != Kind.HELLO:
        raise ProtocolError(f"expected HELLO, got {kind.name}")
    hello = wire.decode_json(payload, HELLO)
    try:
        check_channel(hello["channel"])
        host, port = parse_host_port(hello["address"], "address")
        to = parse_host_port(hello["to"], "to")
    except (ValueError, ConfigError) as e:
        raise ProtocolError(f"HELLO: {e}") from None
    if not names(me, *to):
        raise ProtocolError(f"the HELLO is meant for the pipe at {hello['to']}, not this one (a relayed handshake?)")
    auth.check_nonce(hello["nonce"], "HELLO")
    auth.check_nonce(hello["link"], "HELLO: the link id")
    address = join_host_port(host, port)
    if not same_host(host, source):
        raise ProtocolError(f"the peer says it listens on {address} but connects from {source}")
    # Whether this pipe takes the peer's rank and address is told only once the peer proved that it knows the
    # secret: until then every well-formed HELLO gets a CHALLENGE, so a stranger learns nothing of what is configured.
    unwelcome = _unwelcome(hello, address, source, me)
    secret, ours = me.config.secret, auth.nonce()
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    sock.sendall(wire.encode_json(Kind.CHALLENGE, {"nonce": ours,
                                                   "proof": auth.proof(secret, "endpoint", payload, ours)}))
    # a real peer answers the CHALLENGE at once: a silent one must not keep its place for the whole deadline
    kind, answer = wire.recv_frame(sock, deadline=min(deadline, time.monotonic() + HELLO_TIMEOUT))
    if kind != Kind.AUTH:
        raise ProtocolError(f"expected AUTH, got {kind.name}")
    proved = wire.decode_json(answer, AUTH)
    auth.verify(secret, "link", proved["proof"], payload, ours, proved["session"], who=f"the peer at {address}")
    if unwelcome is not None:
        raise unwelcome
    if len(proved["session"]) > 300:
        raise ProtocolError("AUTH: the session name is too long")
    return hello, address, proved["session"]


def _unwelcome(hello: dict[str, Any], address: str, source: str, me: Listening) -> ProtocolError | None:
    """Why this pipe does not take the peer of ``hello`` (its rank, or an address that is not a configured peer),
    with what the pipe takes; None if it does. Raised (and logged by ``refuse``) only once the peer proved that it
    knows the secret: nothing a stranger claims reaches the log before."""
    rank_ok = 0 <= hello["local_rank"] < MAX_PEER_RANKS if me.any_peer_rank else hello["local_rank"] == me.local_rank
    if hello["kv_rank"] != 1 - me.kv_rank or not rank_ok:
        ranks = f"below {MAX_PEER_RANKS}" if me.any_peer_rank else str(me.local_rank)
        return ProtocolError(f"kv_rank {hello['kv_rank']} local_rank {hello['local_rank']} is not taken here: check "
                             f"kv_role and the URLs in mooncake.json (this pipe takes kv_rank {1 - me.kv_rank} "
                             f"local_rank {ranks})")
    if me.peers is not None and address not in me.peers:
        return ProtocolError(f"{address} is not a configured peer of this pipe (it takes {' or '.join(sorted(me.peers))})")
    return None


def welcome(sock: socket.socket, timeout: float, *, session: str, ring_addr: int, ring_size: int, max_chunk: int,
            inline_max: int, direct_recv: bool, link: str) -> None:
    """Tell an authenticated peer where to write (our engine session and staging ring) and which of our links took
    its connection, then give the connection the pipe's ``timeout``."""
    sock.settimeout(min(HANDSHAKE_TIMEOUT, timeout))
    sock.sendall(wire.encode_json(Kind.WELCOME, {
        "session": session, "ring_addr": ring_addr, "ring_size": ring_size, "max_chunk": max_chunk,
        "inline_max": inline_max, "direct_recv": direct_recv, "link": link}))
    sock.settimeout(timeout)


def refuse(sock: socket.socket, who: str, error: Exception) -> None:
    """The handshake with ``who`` failed: log why, tell the peer (an ERROR frame, best effort) and close. What a peer
    sent is cut to ``LOGGED_MAX`` characters, and the warnings are thinned out (``Tally``): a stranger cannot fill
    the log."""
    seen = REFUSED.add()
    logger.log(logging.WARNING if REFUSED.tells(seen) else logging.DEBUG, "rejected a side-channel connection from "
               "%s: %s (%d such so far)", who, clip(str(error)), seen)
    # our own errors describe what the peer sent; anything else stays in our log
    said = str(error) if isinstance(error, PipeError) else (
        f"the handshake failed here ({type(error).__name__}): see its log")
    try:
        sock.settimeout(1.0)
        sock.sendall(wire.encode(Kind.ERROR, said.encode()[:4000]))
    except OSError:
        pass
    sock.close()


LOGGED_MAX = 300  # characters of what a peer sent that a log line quotes


def clip(text: str) -> str:
    return text if len(text) <= LOGGED_MAX else f"{text[:LOGGED_MAX]}... ({len(text)} characters)"


class Tally:
    """A count of like events whose warnings are thinned out: the 1st, 10th, 100th and every 1,000th are told (the
    others go to the debug log)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self) -> int:
        with self._lock:
            self.count += 1
            return self.count

    @staticmethod
    def tells(count: int) -> bool:
        return count in (1, 10, 100) or count % 1000 == 0


REFUSED = Tally()  # side-channel connections refused at the handshake


def names(me: Listening, host: str, port: int) -> bool:
    """``host:port`` names the endpoint ``me``: its port, and its host or a name of it."""
    return port == me.port and (host == me.host or bool(addresses_of(host) & addresses_of(me.host)))


def addresses_of(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IP addresses ``host`` (an IP or a hostname) stands for; empty if it does not resolve."""
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        return {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
        return set()


def same_host(claimed: str, source: str) -> bool:
    """Whether ``source`` (the connection's address) is one of the addresses ``claimed`` (an IP or a hostname)
    resolves to. A peer always connects from the host it listens on (it binds its source address to it)."""
    return ipaddress.ip_address(source) in addresses_of(claimed)
