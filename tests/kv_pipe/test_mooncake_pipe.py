"""MooncakePipe between two real processes over the real Mooncake Transfer Engine (TCP, P2PHANDSHAKE, 127.0.0.1).

The test process is one end (kv_rank 1 unless said otherwise); a spawned child is the other.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import pytest
import torch

from harness.pipes import make_config, open_pipe
from kv_pipe import PeerDisconnected, PipeClosed, PipeStalled, PipeTimeout, ProtocolError, TransferError, wire
from kv_pipe.connections import DIRECT_MIN
from kv_pipe.devices import canonical
from kv_pipe.scatter import Scatter
from kv_pipe.wire import Chunk, Kind
from tests.devices import CUDA
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, same
from tests.kv_pipe.side_channel import (
    announce_and_vanish,
    assert_still_serves,
    hello_fields,
    large_tensors,
    raw_connect,
    raw_welcome,
    resident_bytes,
)

pytestmark = pytest.mark.pipes

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture
def cfg():
    return make_config()


def echoed(cfg, items: list, stats: dict | None = None, lockstep: bool = False, device: str = "cpu"
           ) -> tuple[list, int]:
    """Send ``items`` to a peer process that sends each back; returns what came back and how many tensors it saw
    (and fills ``stats`` with this end's receive counters). ``lockstep``: wait for each echo before sending the
    next item, so this end is already receiving when an echo starts (else the echoes of large items may fill the
    ring before this end reads them, and rightly go without a direct offer), and the peer waits up to 2 s for this
    end's offer (on a loaded machine its answer can take longer than the pipe's default wait). ``device``: this end's pipe and the
    tensors it sends are there (the peer's are on the host)."""
    peer = Peer(peers.echo, cfg, 0, len(items), 2.0 if lockstep else None)
    with open_pipe(cfg, 1, device=device) as pipe:
        back = []
        for item in items:
            pipe.send_tensor(None if item is None else item.to(device))
            if lockstep:
                back.append(pipe.recv_tensor())
        back += [pipe.recv_tensor() for _ in range(len(items) - len(back))]
        pipe.send_tensor(None)
        if stats is not None:
            stats.update(pipe.stats)
    return back, peer.result()


# zero-copy: TCP writes straight from the sender's tensor into the receiver's result (large tensors);
# staged: through both staging areas, the path RDMA and device tensors take.
PATHS = pytest.mark.parametrize("path", [{"zero_copy_send": True, "zero_copy_recv": True},
                                         {"zero_copy_send": False, "zero_copy_recv": False}], ids=["zero-copy", "staged"])


@PATHS
def test_round_trip_both_ways(path, device):
    cfg = make_config(**path)
    big = torch.randn(3 << 20)  # 12 MiB: three chunks
    items = [torch.randn(5, 6), None, torch.arange(12, dtype=torch.int64).reshape(3, 4), torch.tensor(3.5), big,
             big.view(-1, 1024).t()]  # and a non-contiguous one
    stats: dict = {}
    back, tensors = echoed(cfg, items, stats, lockstep=True, device=device)
    assert tensors == 5
    assert all(same(a, b) for a, b in zip(items, back, strict=True))
    assert all(t.device == canonical(device) for t in back if t is not None)
    if path["zero_copy_recv"]:  # a first small chunk of each big tensor goes through the ring, the rest direct
        assert stats["direct_bytes"] >= 2 * 4 * MiB, stats
    else:
        assert stats["direct_bytes"] == 0 and stats["ring_bytes"] == 2 * 12 * MiB, stats


def test_direct_writes_are_few_and_large():
    # Each write's completion wakes the sending thread, which in a busy process waits for the GIL: the part of a
    # large tensor written straight into the result goes in at most max_chunks_in_flight writes, not chunk by chunk.
    cfg = make_config(chunk_size=4 * MiB, max_chunks_in_flight=4)
    items = [torch.arange(16 << 20, dtype=torch.int32)]  # 64 MiB: 16 chunks
    stats: dict = {}
    back, _ = echoed(cfg, items, stats)
    assert same(items[0], back[0])
    assert stats["direct_bytes"] >= 60 * MiB and stats["direct_writes"] <= 4, stats


def test_direct_receive_offer_is_ignored_by_a_staged_sender():
    # The receiver offers its result, but a sender that stages (RDMA, device tensors) keeps to the ring.
    cfg = make_config(zero_copy_send=False, zero_copy_recv=True)
    stats: dict = {}
    items = [torch.arange(5 << 20, dtype=torch.int32), torch.arange(9 << 20, dtype=torch.uint8)]
    back, _ = echoed(cfg, items, stats)
    assert all(same(a, b) for a, b in zip(items, back, strict=True))
    assert stats["direct_bytes"] == 0 and stats["ring_bytes"] == 29 * MiB, stats


@pytest.mark.parametrize("registered", [True, False], ids=["direct", "ring"])
def test_scatter_target_fills_its_regions_in_order(registered):
    """A tensor received into regions scattered over memory (as KV cache blocks are): written there directly by the
    sender when the memory is registered with the pipe, else copied out of the ring into them; the result is a meta
    tensor. A tensor that does not fill whole leading regions comes back as a tensor of its own."""
    cfg = make_config()
    sent = torch.randint(0, 255, (24 * MiB,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    small = torch.arange(8 * 1024, dtype=torch.int32)  # 32 KiB, inline: the first 32 regions' worth of 1 KiB
    odd = torch.randn(1000)
    peer = Peer(peers.echo, cfg, 0, 3)
    arena = torch.zeros(32 * MiB, dtype=torch.uint8)
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(4))[:24].tolist()
    with open_pipe(cfg, 1) as pipe:
        if registered:
            pipe.register_receive_region(arena)
        pipe.send_tensor(sent.view(24, MiB))
        got = pipe.recv_tensor(out=Scatter.of([(arena.data_ptr() + s * MiB, MiB) for s in slots], [arena]))
        assert got.device.type == "meta" and got.shape == (24, MiB) and got.dtype == torch.uint8
        assert all(torch.equal(arena[s * MiB:(s + 1) * MiB], sent[i * MiB:(i + 1) * MiB]) for i, s in enumerate(slots))
        kib = [(arena.data_ptr() + (2 * i + 1) * 1024, 1024) for i in range(40)]  # every other KiB
        pipe.send_tensor(small)
        got = pipe.recv_tensor(out=Scatter.of(kib, [arena]))
        assert got.device.type == "meta" and got.shape == small.shape
        assert all(torch.equal(arena[(2 * i + 1) * 1024:(2 * i + 2) * 1024], small.view(torch.uint8)[i * 1024:(i + 1) * 1024])
                   for i in range(32))
        pipe.send_tensor(odd)  # 4000 bytes: not a whole number of 1 KiB regions
        assert same(pipe.recv_tensor(out=Scatter.of(kib, [arena])), odd)
        pipe.send_tensor(None)
        stats = dict(pipe.stats)
    assert peer.result() == 3
    if registered:
        assert stats["direct_bytes"] >= 20 * MiB, stats
    else:
        assert stats["direct_bytes"] == 0 and stats["ring_bytes"] == 24 * MiB, stats


@PATHS
def test_dtype_and_shape_matrix_is_bit_exact(path, device):
    """Every dtype and shape, received on ``device`` and sent back from there."""
    cfg = make_config(**path)
    peer = Peer(peers.send_cases, cfg, 0)
    expected = peers.dtype_cases()
    with open_pipe(cfg, 1, device=device) as pipe:
        got = [pipe.recv_tensor() for _ in expected]
        for t in got:
            pipe.send_tensor(t)
        pipe.send_tensor(None)
        assert pipe.recv_tensor() is None  # the peer read them all
    echoes = peer.result()
    assert echoes["sent"] == len(expected)
    mismatches = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if not same(a, b)]
    assert not mismatches, f"cases {mismatches} differ"
    assert echoes["echoes_differ"] == [], "sent back from the device"
    assert all(t.is_contiguous() and t.device == canonical(device) for t in got if t is not None)


def test_none_is_not_confused_with_any_tensor(cfg):
    # v0 encoded None as a magic tensor value; here a tensor holding any value stays a tensor.
    items = [torch.tensor([-1.0]), None, torch.tensor([]), torch.tensor(float("nan")), torch.zeros(0, dtype=torch.bool)]
    back, _ = echoed(cfg, items)
    assert [b is None for b in back] == [False, True, False, False, False]
    assert all(same(a, b) for a, b in zip(items, back, strict=True))


def test_stress_300_rounds_changing_sides(cfg):
    """Both ends send ~4 MB tensors and Nones, the sending side changing every 1-5 rounds (103 changes, 15 Nones in
    this schedule): every tensor arrives, in order, on the right side."""
    seed, rounds = 7, 300
    peer = Peer(peers.stress, cfg, 0, seed, rounds)
    mine = peers.stress(cfg, 1, seed, rounds)
    theirs = peer.result(timeout=300)
    schedule = peers.stress_schedule(seed, rounds)
    by_rank = {r: sum(1 for s, n in schedule if s == r and not n) for r in (0, 1)}
    nones = sum(1 for _, n in schedule if n)
    assert theirs["sent"] == mine["received"] == by_rank[0]
    assert mine["sent"] == theirs["received"] == by_rank[1]
    assert theirs["nones_sent"] + mine["nones_sent"] == nones >= 10
    assert sum(1 for i in range(1, rounds) if schedule[i][0] != schedule[i - 1][0]) > 100


def test_one_gib_tensor_with_bounded_memory():
    cfg = make_config(timeout=60.0)
    receiver = Peer(peers.big_receiver, cfg, 1, GiB)
    sender = Peer(peers.big_sender, cfg, 0, GiB)
    got = receiver.result(timeout=300)
    sent = sender.result(timeout=300)
    assert (got["numel"], got["dtype"], got["bad_blocks"]) == (GiB, "torch.uint8", 0)
    # Each side holds the tensor itself, its staging areas (64 MiB each) and nothing that grows with the tensor.
    slack = 300 * MiB
    assert got["peak"] - got["base"] < GiB + slack, f"receiver grew by {(got['peak'] - got['base']) / MiB:.0f} MiB"
    assert sent["peak"] - sent["base"] < GiB + slack, f"sender grew by {(sent['peak'] - sent['base']) / MiB:.0f} MiB"


def test_sender_killed_mid_transfer_raises_quickly():
    cfg = make_config(timeout=20.0)
    peer = Peer(peers.send_then_hang, cfg, 0, 512 * MiB, 60)
    with open_pipe(cfg, 1) as pipe:
        assert pipe.recv_tensor(timeout=120) is None  # the sender is connected
        time.sleep(3.0)  # the sender has filled our 64 MiB ring and waits for room
        peer.kill()
        start = time.monotonic()
        with pytest.raises(PeerDisconnected, match="disconnected|closed"):
            pipe.recv_tensor()
        assert time.monotonic() - start < 5.0


def test_receiver_killed_mid_transfer_raises_quickly(cfg):
    ready = peers.ctx().Event()
    peer = Peer(peers.sink, cfg, 0, 60, ready)
    big = torch.ones(512 * MiB, dtype=torch.uint8)
    with open_pipe(cfg, 1) as pipe:
        assert ready.wait(120)
        pipe.send_tensor(None)  # linked: what follows times the send alone
        threading.Timer(1.0, peer.kill).start()  # the ring fills within ~0.1 s; the kill lands mid-send
        start = time.monotonic()
        with pytest.raises((PeerDisconnected, TransferError)):
            pipe.send_tensor(big)
        # blocked until the kill, then raised well before the pipe's timeout (10 s) would have
        assert 0.9 < time.monotonic() - start < 1.0 + cfg["timeout"] / 2


def test_frozen_peer_times_out_both_ways():
    timeout = 4.0
    cfg = make_config(timeout=timeout)
    peer = Peer(peers.send_then_hang, cfg, 0, 256 * MiB, 60)
    try:
        with open_pipe(cfg, 1) as pipe:
            assert pipe.recv_tensor(timeout=120) is None  # the sender is connected
            time.sleep(1.0)  # ring full, sender blocked (it would give up after `timeout`)
            os.kill(peer.proc.pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(PipeTimeout):
                pipe.recv_tensor()  # copies what sits in the ring, then waits for more that never comes
            assert time.monotonic() - start < timeout + 3.0
            start = time.monotonic()
            with pytest.raises((PipeTimeout, TransferError)):
                pipe.send_tensor(torch.ones(256 * MiB, dtype=torch.uint8))  # the frozen side never reads
            assert time.monotonic() - start < max(timeout, 5.0) + 5.0  # the engine's own transfer timeout is >= 5 s
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.kill()


def poll(pipe, seconds: float, within: float = 20.0):
    """``recv_tensor(timeout=seconds)`` until something arrives (a caller's poll loop): (what came, how long the
    call that got it took); bare ``PipeTimeout``s are idleness and polled on."""
    deadline = time.monotonic() + within
    while True:
        start = time.monotonic()
        try:
            return pipe.recv_tensor(timeout=seconds), time.monotonic() - start
        except PipeStalled:
            raise
        except PipeTimeout:
            if time.monotonic() > deadline:
                raise


def test_a_short_poll_never_cuts_a_tensor_whose_bytes_come_late():
    # Issue #24: the poll timeout bounds the wait for a tensor to start. Once its header came, its bytes may take
    # up to the configured timeout per wait: here they come 0.7 s after the header and 0.7 s after the first chunk
    # (a timeout of 3 s: under the full suite a 0.7 s gap was once seen to take over 1.5 s).
    cfg = make_config(timeout=3.0, chunk_size=MiB)
    frozen = peers.ctx().Event()
    peer = Peer(peers.send_late_bytes, cfg, 0, 3 * MiB, 0.7, frozen)
    try:
        with open_pipe(cfg, 1) as pipe:
            assert pipe.recv_tensor(timeout=120) is None  # the sender is connected
            got, took = poll(pipe, 0.2)
            assert same(got, peers.late_tensor(3 * MiB)) and took > 1.3
            # The next one breaks off for real (the sender froze after its header): that is no idle poll.
            start = time.monotonic()
            with pytest.raises(PipeStalled, match="broke off"):
                poll(pipe, 0.2)
            assert frozen.is_set() and time.monotonic() - start < 3 * 3.0  # by the pipe's timeout (plus a loaded box's delays)
            with pytest.raises(PipeTimeout) as idle:  # the connection it came on is gone: nothing more arrives
                pipe.recv_tensor(timeout=0.2)
            assert not isinstance(idle.value, PipeStalled)
    finally:
        peer.kill()


def test_no_peer_gives_a_clear_timeout(cfg):
    """Each call ends with its own 1 s timeout, not the pipe's 10 s (the bound leaves room for a loaded machine)."""
    assert cfg["timeout"] == 10.0
    with open_pipe(cfg, 1) as pipe:
        start = time.monotonic()
        with pytest.raises(PipeTimeout, match="could not reach the peer pipe.*listening on that address"):
            pipe.send_tensor(torch.ones(3), timeout=1.0)
        assert time.monotonic() - start < 8.0
        start = time.monotonic()
        with pytest.raises(PipeTimeout, match="no peer connected"):
            pipe.recv_tensor(timeout=1.0)
        assert time.monotonic() - start < 8.0


def test_a_peer_that_went_away_fails_fast_and_is_found_again_when_back(cfg):
    first = Peer(peers.echo, cfg, 0, 1)
    with open_pipe(cfg, 1) as pipe:
        pipe.send_tensor(torch.ones(3))
        assert same(pipe.recv_tensor(), torch.ones(3))
        first.kill()
        time.sleep(0.5)
        start = time.monotonic()
        with pytest.raises(PeerDisconnected):
            pipe.send_tensor(torch.ones(3))  # the old connection is dead, and nothing listens any more
        with pytest.raises(PeerDisconnected, match="is down"):
            pipe.send_tensor(torch.ones(3))
        assert time.monotonic() - start < 2.0  # not the 10 s connect timeout
        back, tensors = [], None
        second = Peer(peers.echo, cfg, 0, 1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the restarted peer is found by a later send
            try:
                pipe.send_tensor(torch.full((2,), 5.0))
                break
            except PeerDisconnected:
                time.sleep(0.2)
        try:
            back.append(pipe.recv_tensor())
        except PeerDisconnected:  # the old connection's death is reported once, unless the new one replaced it first
            back.append(pipe.recv_tensor())
        pipe.send_tensor(None)
        tensors = second.result()
    assert same(back[0], torch.full((2,), 5.0)) and tensors == 1


def test_abandoning_a_receive_spares_a_connection_the_peer_made_since(cfg):
    """Hardening: ``abandon_receive`` (a caller gave up on a message in the middle) drops the connection the last
    ``recv_tensor`` read from; if the peer has connected afresh since, the new connection and what it carries stay."""
    first = Peer(peers.echo, cfg, 0, 1)
    with open_pipe(cfg, 1) as pipe:
        pipe.send_tensor(torch.ones(3))
        assert same(pipe.recv_tensor(), torch.ones(3))  # read from the first connection
        first.kill()
        second = Peer(peers.echo_until_none, cfg, 0)
        deadline = time.monotonic() + 120
        old = pipe._read_from
        sent = 0.0
        while pipe._inbound is old or pipe._inbound is None:  # the echo comes on a connection of its own
            assert time.monotonic() < deadline, "the restarted peer never connected back"
            if time.monotonic() - sent > 3.0:
                # again after a while: a small tensor goes inline, and written before the killed peer's socket
                # reported its end, it went nowhere
                try:
                    pipe.send_tensor(torch.full((2,), 5.0))
                    sent = time.monotonic()
                except PeerDisconnected:
                    pass
            time.sleep(0.05)
        pipe.abandon_receive("test: the message on the first connection broke off")
        assert same(pipe.recv_tensor(timeout=30), torch.full((2,), 5.0))
        pipe.send_tensor(None)
        assert second.result() >= 1


def test_close_unblocks_recv_and_is_idempotent(cfg):
    pipe = open_pipe(cfg, 1)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            pipe.recv_tensor(timeout=60)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.5)
    start = time.monotonic()
    pipe.close()
    thread.join(timeout=5)
    assert not thread.is_alive() and time.monotonic() - start < 3.0
    assert len(errors) == 1 and isinstance(errors[0], PipeClosed)
    pipe.close()
    with pytest.raises(PipeClosed):
        pipe.send_tensor(None)


def test_side_channel_binds_only_the_configured_host(cfg):
    with open_pipe(cfg, 1) as pipe:
        other = [a for a in _local_addresses() if not a.startswith("127.")]
        if not other:
            pytest.skip("this machine has no non-loopback address to probe")
        with pytest.raises(OSError):
            socket.create_connection((other[0], pipe.port), timeout=1.0).close()
        socket.create_connection(("127.0.0.1", pipe.port), timeout=1.0).close()


def _local_addresses() -> list[str]:
    import psutil

    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]


# ----------------------------------------------------------------------------- hostile input
@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    os.urandom(4096),
    wire.encode(Kind.HELLO, b'{"kv_rank": 0'),
    wire.encode_json(Kind.HELLO, {"kv_rank": 1, "local_rank": 0, "session": "x"}),  # same role as the pipe
    b"MKVP",
])
def test_garbage_on_the_side_channel_is_refused_and_the_pipe_keeps_serving(cfg, garbage, caplog):
    caplog.set_level(logging.DEBUG, logger="kv_pipe.handshake")  # (refusals are told at WARNING only now and then)
    with open_pipe(cfg, 1) as pipe:
        with raw_connect(pipe) as sock:
            try:
                sock.sendall(garbage)
                sock.shutdown(socket.SHUT_WR)
                sock.settimeout(15)
                reply = sock.recv(65536)
            except OSError:  # refused so fast that the connection was already reset
                reply = b""
        assert reply == b"" or wire.decode_header(reply[:wire.HEADER.size])[0] == Kind.ERROR
        assert "rejected a side-channel connection" in caplog.text
        assert_still_serves(cfg, pipe)


def test_hostile_hellos_do_not_kill_the_accept_loop(cfg, caplog):
    """Hardening finding 1: a hello holding a 5,000-digit integer or JSON nested 20,000 deep (40 KB) raised out of the
    accept loop, which died: the real peer could never connect again. Each is refused now, and the real peer served."""
    hellos = [b'{"kv_rank": ' + b"9" * 5000 + b"}", b"[" * 20_000 + b"]" * 20_000,
              b'{"kv_rank": 0, "local_rank": 0, "session": "' + b"x" * 60_000 + b'"}']
    caplog.set_level(logging.DEBUG, logger="kv_pipe.handshake")
    with open_pipe(cfg, 1) as pipe:
        for hello in hellos:
            with raw_connect(pipe) as sock:
                try:
                    sock.sendall(wire.encode(Kind.HELLO, hello))
                    sock.settimeout(15)
                    reply = sock.recv(65536)
                except OSError:
                    reply = b""
            assert reply == b"" or wire.decode_header(reply[:wire.HEADER.size])[0] == Kind.ERROR
        assert caplog.text.count("rejected a side-channel connection") >= len(hellos)
        assert_still_serves(cfg, pipe)


@pytest.mark.parametrize("frame, message", [
    (lambda w: wire.encode_tensor(torch.uint8, (1 << 40,), 1 << 40), "exceeds max_tensor_size"),
    (lambda w: wire.encode_tensor(torch.uint8, (100,), 100) + wire.encode_chunk(Chunk(w["ring_size"] - 10, 100, 100)),
     "lies outside"),
    (lambda w: wire.encode_tensor(torch.uint8, (100,), 100) + wire.encode_chunk(Chunk(0, 0, 0)), "chunk of 0 bytes"),
    (lambda w: wire.encode_tensor(torch.uint8, (100,), 100) + wire.encode_chunk(Chunk(0, 200, 200)), "chunk of 200 bytes"),
    (lambda w: wire.encode_tensor(torch.uint8, (100,), 100) + wire.encode_dchunk(0, 100), "not offered for direct"),
    (lambda w: wire.encode_tensor(torch.uint8, (DIRECT_MIN,), DIRECT_MIN) + wire.encode_dchunk(4, 100), r"DCHUNK \[4, "),
    (lambda w: wire.encode_tensor(torch.uint8, (DIRECT_MIN,), DIRECT_MIN) + wire.encode_dchunk(0, DIRECT_MIN + 1),
     "DCHUNK"),
    (lambda w: wire.encode_tensor(torch.uint8, (DIRECT_MIN,), DIRECT_MIN) + wire.encode_direct(0, 1, ((1, 1),)),
     "unexpected DIRECT"),
    (lambda w: wire.encode_chunk(Chunk(0, 8, 8)), "expected a TENSOR or NONE frame"),
    (lambda w: wire.encode(Kind.WELCOME, b"{}"), "unexpected WELCOME frame"),
    (lambda w: wire.HEADER.pack(wire.MAGIC, wire.VERSION, Kind.TENSOR, 0, 0xFFFFFFFF), "exceeds its limit"),
    (lambda w: wire.encode_tensor_inline(torch.uint8, (w["inline_max"] + 1,), bytes(w["inline_max"] + 1)),
     "exceeds inline_max"),
    (lambda w: wire.encode_tensor_inline(torch.float32, (4,), bytes(16))[:-4], "disconnected"),
    (lambda w: wire.encode(Kind.TENSOR_INLINE, wire.encode_tensor_inline(torch.float32, (4,), bytes(16))[12:-4]),
     "need 40"),
    (lambda w: wire.encode_tensor(torch.float32, (3,), 12)[:20], "disconnected"),
    (lambda w: wire.encode_tensor(torch.uint8, (DIRECT_MIN,), DIRECT_MIN), "disconnected"),  # sender dies after the offer
    (lambda w: wire.encode_tensor(torch.uint8, (0, (1 << 64) - 1), 0), "has a dimension beyond"),  # finding 4: TypeError
])
def test_malformed_frames_after_handshake(cfg, frame, message):
    with open_pipe(cfg, 1) as pipe:
        with raw_connect(pipe) as sock:
            welcome = raw_welcome(sock, pipe)
            sock.sendall(frame(welcome))
            if message == "disconnected":
                sock.shutdown(socket.SHUT_WR)  # a truncated frame, then the peer goes away
            with pytest.raises((ProtocolError, PeerDisconnected), match=message):
                pipe.recv_tensor(timeout=5.0)
        assert_still_serves(cfg, pipe)


def test_a_chunked_tensor_after_an_unaligned_one_does_not_stall():
    # The ring must be freed chunk by chunk even when every chunk in flight is waiting for room (a past bug).
    cfg = make_config(staging_buffer_size=8 * MiB, chunk_size=4 * MiB, max_chunks_in_flight=8, timeout=10.0)
    items = [torch.ones(300_000, dtype=torch.uint8), torch.arange(16 * MiB, dtype=torch.int32)]
    back, _ = echoed(cfg, items)
    assert all(same(a, b) for a, b in zip(items, back, strict=True))


# the same device, spelled as users spell it: the pipe's name for it and the buffer's may differ
SPELLINGS = [("cpu", "cpu"), ("cpu", torch.device("cpu", 0)),
             pytest.param("cuda", "cuda:0", marks=CUDA), pytest.param("cuda:0", "cuda", marks=CUDA),
             pytest.param(torch.device("cuda", 0), "cuda", marks=CUDA)]


@pytest.mark.parametrize("pipe_device, buffer_device", SPELLINGS)
def test_receive_into_a_caller_buffer(cfg, pipe_device, buffer_device):
    items = [torch.arange(3 * MiB, dtype=torch.float32), torch.tensor([1.5, 2.5]), torch.arange(10, dtype=torch.int64)]
    peer = Peer(peers.echo, cfg, 0, len(items))
    buffer = torch.zeros(16 * MiB, dtype=torch.uint8, device=buffer_device)
    small = torch.zeros(8, dtype=torch.uint8, device=buffer_device)
    with open_pipe(cfg, 1, device=pipe_device) as pipe:
        for item in items:
            pipe.send_tensor(item)
        big = pipe.recv_tensor(out=buffer)
        inline = pipe.recv_tensor(out=buffer[-64:])
        fresh = pipe.recv_tensor(out=small)  # too small: a new tensor instead
        with pytest.raises(ValueError, match="contiguous"):
            pipe.recv_tensor(out=buffer[::2])
        pipe.send_tensor(None)
    peer.result()
    assert same(big, items[0]) and big.data_ptr() == buffer.data_ptr()
    assert same(inline, items[1]) and inline.data_ptr() == buffer[-64:].data_ptr()
    assert same(fresh, items[2]) and fresh.data_ptr() != small.data_ptr()


def test_a_newer_connection_that_proves_the_same_replaces_the_live_one(cfg, caplog):
    """A second connection naming the peer used to be refused while the first was alive: whoever came first (an
    impostor, or a stale connection of a peer whose host vanished) locked the peer out. Now a newer connection that
    proves the same (here, without a secret, anyone) takes its place; with a secret only the peer itself can (see
    test_only_a_peer_that_knows_the_secret_joins_the_pipe, and tests/kv_pipe/test_endpoint.py)."""
    peer = Peer(peers.echo, cfg, 0, 1)
    with open_pipe(cfg, 1) as pipe:
        pipe.send_tensor(torch.ones(2))
        assert same(pipe.recv_tensor(), torch.ones(2))
        with raw_connect(pipe) as sock:
            # naming the peer's live link, as the peer reconnecting it does (one naming a new link also ends our
            # connection to the old one: tests/kv_pipe/test_endpoint.py)
            hello = hello_fields(pipe, link=pipe._outbound.peer_link)
            kind, _ = peers.raw_handshake(sock, hello, session="newer:1")
        assert kind == Kind.WELCOME and "its older connection from" in caplog.text
        pipe.send_tensor(None)
    assert peer.result() == 1


def test_failed_receives_free_their_memory():
    """Finding 4: a failed receive's result was never freed: it stayed alive through the error kept for the
    connection (result <- closure cell <- the receive's frame <- traceback <- error <- Inbound.error <- the pipe);
    8 rounds of 96 MiB kept 744 MiB. Here a sender announces 96 MiB, sends CHUNK frames for 92 MiB of it (which
    the receiver copies out of its ring) and vanishes, 8 times: memory and live tensors go back to where they were."""
    import gc

    size, chunk = 96 * MiB, 4 * MiB
    cfg = make_config(zero_copy_recv=False, result_pool_size=0, timeout=5.0)
    with open_pipe(cfg, 1) as pipe:
        gc.collect()
        base, tensors = resident_bytes(), large_tensors(size)
        for _ in range(8):
            with raw_connect(pipe) as sock:
                announce_and_vanish(sock, pipe, size, chunk)
                with pytest.raises(PeerDisconnected):
                    pipe.recv_tensor(timeout=10)
        gc.collect()
        grown = (resident_bytes() - base) / MiB
        assert large_tensors(size) == tensors and grown < 96, f"{grown:.0f} MiB more than before"


def test_tensors_announced_together_stay_within_the_receive_budget():
    """Finding 4: a result's pages are mapped as its chunks arrive, so several links announcing large tensors at once
    could make an endpoint commit up to max_tensor_size each. All links of an endpoint may be receiving at most
    ``receive_budget`` bytes at once: a tensor announced beyond it is refused (its connection dropped) before any of
    its memory is touched, and the pipe goes on serving."""
    cfg = make_config(receive_budget=64 * MiB, zero_copy_recv=False, timeout=5.0)
    with open_pipe(cfg, 1) as pipe:
        with raw_connect(pipe) as sock:
            raw_welcome(sock, pipe)
            sock.sendall(wire.encode_tensor(torch.uint8, (65 * MiB,), 65 * MiB))
            with pytest.raises(ProtocolError, match=r"announces a 68157440-byte tensor .*receive_budget 67108864"):
                pipe.recv_tensor(timeout=10)
        assert_still_serves(cfg, pipe)


def test_failed_receives_count_in_the_receive_budget_while_they_are_held():
    """Issue #37: a peer announced 256 MiB tensors and sent CHUNK frames only, five times, each receive failing: a
    failed zero-copy receive's result is kept ``timeout`` + 5 s (writes the sender started may still land in it),
    and those were held outside ``receive_budget`` (RSS 326 -> 1,594 MiB against a 300 MiB budget). They count now
    until let go: a tensor announced while they fill the budget is refused before any of its memory is touched, the
    memory stays within the budget plus a chunk, and once they are let go the real peer is served."""
    import gc

    size, chunk = 40 * MiB, 4 * MiB
    cfg = make_config(receive_budget=100 * MiB, result_pool_size=0, timeout=2.0)
    with open_pipe(cfg, 1) as pipe:
        with raw_connect(pipe) as sock:
            raw_welcome(sock, pipe)  # the link and its ring are made (and kept) before the memory is measured
        gc.collect()
        base, grown, outcomes, tensors = resident_bytes(), 0, [], large_tensors(size)
        for _ in range(5):
            with raw_connect(pipe) as sock:
                announce_and_vanish(sock, pipe, size, chunk)
                with pytest.raises((PeerDisconnected, ProtocolError)) as failed:
                    pipe.recv_tensor(timeout=10)
                outcomes.append("refused" if "receive_budget" in str(failed.value) else "held")
            grown = max(grown, resident_bytes() - base)
        # two 40 MiB results fit in 100 MiB and are held; every later one is refused while they are
        assert outcomes == ["held", "held", "refused", "refused", "refused"], outcomes
        assert grown < 100 * MiB + chunk, f"{grown / MiB:.0f} MiB more than before"
        time.sleep(cfg["timeout"] + 5.5)  # the held results are let go when due: the budget is free again
        gc.collect()
        assert large_tensors(size) == tensors  # without waiting for another receive to notice
        assert_still_serves(cfg, pipe)
