"""Helpers of the tests that speak the side channel from this process: free addresses, raw connections, HELLOs and
handshakes, a sender that announces a tensor and vanishes, a real peer's round trip through an endpoint or a pipe,
and the process's memory those tests measure (helpers that run in a child process are in ``peers``)."""

from __future__ import annotations

import socket
import time

import torch

from harness.ports import free_port
from kv_pipe import auth, handshake, wire
from kv_pipe.wire import Chunk, Kind
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, same


def free_address() -> str:
    return f"127.0.0.1:{free_port()}"


def hello_frame(endpoint, **fields) -> bytes:
    """A HELLO frame to ``endpoint`` from 127.0.0.1:1 as a producer, with ``fields`` changed."""
    hello = {"kv_rank": 0, "local_rank": 0, "address": "127.0.0.1:1", "to": endpoint.address, "channel": "kv",
             "nonce": auth.nonce(), "link": auth.nonce(), **fields}
    return wire.encode_json(Kind.HELLO, hello)


def raw_connect(pipe) -> socket.socket:
    return socket.create_connection(("127.0.0.1", pipe.port), timeout=5.0)


def hello_fields(pipe, **fields) -> dict:
    """A valid HELLO from the pipe's configured peer, with ``fields`` changed (a nonce is added when sent)."""
    return {"kv_rank": 1 - pipe.kv_rank, "local_rank": 0, "address": pipe.peer,
            "to": pipe.endpoint.address, "channel": "kv", **fields}


def real_peer_round_trip(cfg, endpoint, server: str, address: str | None = None) -> None:
    """A real peer process (listening at ``address``) links to ``endpoint`` (at ``server``) and a tensor goes each
    way."""
    address = address or free_address()
    client = Peer(peers.endpoint_client, cfg, address, [server], 1.0, 1)
    start, link = time.monotonic(), None
    while link is None and time.monotonic() - start < 30:
        link = next((p for p in endpoint.links() if p.peer == address and p.has_ring), None)
        time.sleep(0.01)
    assert link is not None and float(link.recv_tensor(timeout=20)[0]) == 1.0
    link.send_tensor(torch.tensor([2.0]))
    assert link.recv_tensor(timeout=20) is None
    assert client.result() == [2.0]


def closed_by_the_endpoint(sock: socket.socket) -> bool:
    """Whether the endpoint closed ``sock`` (whatever it sent first is read), without waiting."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def raw_welcome(sock: socket.socket, pipe) -> dict:
    """The pipe's WELCOME to a valid HELLO sent on ``sock``: its fields."""
    kind, payload = peers.raw_handshake(sock, hello_fields(pipe))
    assert kind == Kind.WELCOME
    return wire.decode_json(payload, handshake.WELCOME)


def assert_still_serves(cfg, pipe) -> None:
    """A real peer process (``peers.echo``) still gets a tensor through ``pipe`` and back."""
    peer = Peer(peers.echo, cfg, 0, 1)
    pipe.send_tensor(torch.full((4, 4), 7.0))
    assert same(pipe.recv_tensor(), torch.full((4, 4), 7.0))
    pipe.send_tensor(None)
    assert peer.result() == 1


def announce_and_vanish(sock: socket.socket, pipe, size: int, chunk: int) -> None:
    """Handshake on ``sock``, announce a ``size``-byte tensor, send CHUNK frames for all of it but its last chunk
    (which the receiver copies out of its ring) and stop sending."""
    ring = raw_welcome(sock, pipe)["ring_size"]
    frames = wire.encode_tensor(torch.uint8, (size,), size)
    for k in range(size // chunk - 1):
        frames += wire.encode_chunk(Chunk(k * chunk % ring, chunk, (k + 1) * chunk))
    sock.sendall(frames)
    sock.shutdown(socket.SHUT_WR)


def resident_bytes() -> int:
    """This process's resident memory, in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def large_tensors(nbytes: int) -> int:
    """How many tensors of at least ``nbytes`` are alive in this process."""
    import gc

    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.nbytes >= nbytes)
