"""Fuzzing the side channel with a fixed seed: mutated frames through the real frame reader, mutated handshakes
against a live pipe, then its real peer still exchanges tensors.

Every case must end in a parsed frame or a ``PipeError`` (never another exception, never a hang); every hostile
connection must end with an ERROR frame or a closed connection, and the pipe's accept loop must live on.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch

from harness.pipes import make_config, open_pipe
from kv_pipe import PipeError, ProtocolError, auth, wire
from kv_pipe.connections import Inbound
from kv_pipe.wire import Chunk, Kind
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, same

pytestmark = pytest.mark.pipes

SEED = 20261123


def mutate(rng: random.Random, frame: bytes) -> bytes:
    """One random change: flip bytes, truncate, cut a piece out, repeat a piece, or splice random bytes in."""
    data = bytearray(frame)
    op = rng.randrange(5)
    if op == 0 or not data:
        for _ in range(rng.randint(1, 4)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
    elif op == 1:
        del data[rng.randrange(len(data)):]
    elif op == 2:
        start = rng.randrange(len(data))
        del data[start:start + rng.randint(1, 16)]
    elif op == 3:
        start = rng.randrange(len(data))
        data[start:start] = data[start:start + rng.randint(1, 16)]
    else:
        start = rng.randrange(len(data) + 1)
        data[start:start] = rng.randbytes(rng.randint(1, 24))
    return bytes(data)


def valid_frames() -> list[bytes]:
    return [
        wire.encode_tensor(torch.float32, (4, 8), 128),
        wire.encode_tensor(torch.bfloat16, (2, 3, 5), 60),
        wire.encode_tensor_inline(torch.int64, (3,), bytes(24)),
        wire.encode_tensor_inline(torch.uint8, (0,), b""),
        wire.encode_chunk(Chunk(0, 4096, 4096)),
        wire.encode_dchunk(0, 1 << 20),
        wire.encode_direct(1, 1 << 24, ((4096, 1 << 23), (1 << 30, 1 << 23))),
        wire.encode_ack(4096),
        wire.encode(Kind.NONE),
        wire.encode(Kind.BYE),
    ]


def test_thousands_of_mutated_frames_end_in_a_frame_or_a_pipe_error():
    rng = random.Random(SEED)
    frames = valid_frames()
    outcomes = {"parsed": 0, "malformed": 0, "ended": 0}  # frames parsed; cases ended by a ProtocolError / EOF
    start = time.monotonic()
    for _ in range(5000):
        case = mutate(rng, rng.choice(frames))
        if rng.random() < 0.3:  # several frames in a row, the second one mutated
            case = rng.choice(frames) + mutate(rng, rng.choice(frames))
        ours, theirs = socket.socketpair()
        with ours, theirs:
            theirs.sendall(case)
            theirs.shutdown(socket.SHUT_WR)
            inbound = Inbound(ours, "fuzz", threading.Event(), max_tensor_size=1 << 30, inline_max=1 << 16)
            try:
                for _ in range(3):
                    inbound.next_frame(0.5)
                    outcomes["parsed"] += 1
            except ProtocolError:
                outcomes["malformed"] += 1
            except PipeError:  # the truncated rest of a frame, or the end of the bytes
                outcomes["ended"] += 1
            except Exception as e:  # the finding: anything else escapes a reader thread
                raise AssertionError(f"{type(e).__name__}: {e} for {case!r:.300}") from e
    print(outcomes, f"{time.monotonic() - start:.1f} s")
    assert outcomes["malformed"] > 1000 and outcomes["parsed"] > 1000


def test_mutated_handshakes_against_a_live_pipe_then_its_real_peer_is_served(caplog):
    rng = random.Random(SEED + 1)
    cfg = make_config(timeout=5.0)
    with open_pipe(cfg, 1) as pipe:
        hello = {"kv_rank": 0, "local_rank": 0, "address": pipe.peer, "to": pipe.endpoint.address,
                 "channel": "kv", "nonce": auth.nonce(), "link": auth.nonce()}
        seeds = [wire.encode_json(Kind.HELLO, hello), wire.encode_json(Kind.AUTH, {"session": "x:1", "proof": "0" * 64}),
                 wire.encode_json(Kind.HELLO, {**hello, "kv_rank": 10 ** 30}), wire.encode(Kind.HELLO, b"[" * 64)]
        ended = {"error": 0, "closed": 0, "challenged": 0}
        start = time.monotonic()
        for _ in range(1500):
            case = mutate(rng, rng.choice(seeds))
            with socket.create_connection(("127.0.0.1", pipe.port), timeout=5.0) as sock:
                try:
                    sock.sendall(case)
                    sock.shutdown(socket.SHUT_WR)
                    kind, _ = wire.recv_frame(sock)
                    ended["challenged" if kind == Kind.CHALLENGE else "error"] += 1
                    assert kind in (Kind.ERROR, Kind.CHALLENGE)
                except (ConnectionError, PipeError, OSError):
                    ended["closed"] += 1
        print(ended, f"{time.monotonic() - start:.1f} s")
        assert "WELCOME" not in caplog.text and ended["error"] > 500
        peer = Peer(peers.echo, cfg, 0, 1)
        pipe.send_tensor(torch.arange(6.0))
        assert same(pipe.recv_tensor(timeout=30), torch.arange(6.0))
        pipe.send_tensor(None)
        assert peer.result() == 1
