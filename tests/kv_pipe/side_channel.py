"""Helpers of the tests that speak the side channel from this process: free addresses, raw connections and HELLOs,
and a real peer's round trip through an endpoint (helpers that run in a child process are in ``peers``)."""

from __future__ import annotations

import socket
import time

import torch

from harness.ports import free_port
from kv_pipe import auth, wire
from kv_pipe.wire import Kind
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer


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
