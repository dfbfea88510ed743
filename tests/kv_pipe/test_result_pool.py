"""Received tensors served from the endpoint's pool of reused memory (``result_pool_size``, ``ResultPool``).

Real processes and the real Transfer Engine (TCP, P2PHANDSHAKE, 127.0.0.1): the test process receives (kv_rank 1),
a spawned echo peer sends each tensor back. The pool itself is also driven directly where only it is under test
(threads, storage hand-offs). Nothing here measures time: bench_pipe does.
"""

from __future__ import annotations

import gc
import io
import socket
import threading
import weakref

import pytest
import torch

from harness.pipes import make_config, open_pipe
from kv_pipe import PeerDisconnected, wire
from kv_pipe.connections import DIRECT_MIN
from kv_pipe.memory import ResultPool
from kv_pipe.wire import Kind
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, same

pytestmark = pytest.mark.pipes

MiB = 1 << 20
BIG = 12 * MiB  # above DIRECT_MIN: written straight into the result (zero-copy receive), in three chunks
assert BIG >= DIRECT_MIN


def tensor(seed: int, nbytes: int = BIG, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct, deterministic contents per seed (any dtype: random bytes viewed as it, NaN payloads included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(4, -1)


class Echo:
    """The test process's pipe end and an echo peer: ``round_trip(t)`` sends ``t`` and returns what came back
    (the receive starts before the echo is sent, so large tensors get a direct offer)."""

    def __init__(self, cfg: dict) -> None:
        self.peer = Peer(peers.echo_until_none, cfg, 0)
        self.pipe = open_pipe(cfg, 1)
        self.pool = self.pipe.endpoint.results

    def round_trip(self, t: torch.Tensor) -> torch.Tensor:
        self.pipe.send_tensor(t)
        got = self.pipe.recv_tensor()
        assert got is not None
        return got

    def close(self) -> None:
        try:
            self.pipe.send_tensor(None)
        finally:
            self.pipe.close()
        self.peer.result()


@pytest.fixture
def echo(request):
    cfg = make_config(**getattr(request, "param", {}))
    ends = Echo(cfg)
    yield ends
    ends.close()


PATHS = pytest.mark.parametrize("echo", [
    {"zero_copy_recv": True, "huge_pages": True},
    {"zero_copy_recv": True, "huge_pages": False},
    {"zero_copy_recv": False, "huge_pages": True},
], ids=["direct", "direct-no-huge-pages", "ring"], indirect=True)


@PATHS
def test_results_come_from_the_pool_bit_exact_and_a_dropped_ones_slot_is_reused(echo):
    sent = [tensor(1), tensor(2, dtype=torch.bfloat16), tensor(3, 2 * MiB, torch.int64), tensor(4, dtype=torch.bool)]
    first = echo.round_trip(sent[0])
    assert same(first, sent[0])
    addr = first.data_ptr()
    assert [(a, n) for a, n, _ in echo.pool.slots()] == [(addr, BIG)]
    del first
    second = echo.round_trip(sent[1])  # the same size: the same slot, now that nothing holds the first result
    assert same(second, sent[1]) and second.data_ptr() == addr
    small = echo.round_trip(sent[2])  # a smaller one gets a slot of its own size (12 MiB is over twice as large)
    assert same(small, sent[2]) and small.data_ptr() != addr
    del second
    third = echo.round_trip(sent[3])
    assert same(third, sent[3]) and third.data_ptr() == addr
    assert echo.pool.stats == {"pooled": 4, "fresh": 0, "made": 2, "dropped": 0}
    direct = echo.pipe.config.zero_copy_recv
    assert (echo.pipe.stats["direct_bytes"] > 0) == direct, echo.pipe.stats


@pytest.mark.parametrize("echo", [{}], indirect=True)
def test_a_result_still_referenced_through_a_view_slice_storage_or_array_is_never_overwritten(echo):
    originals = [tensor(10 + i) for i in range(4)]
    results = [echo.round_trip(t) for t in originals]
    holders = [results[0][1:, 100:], results[1].view(torch.int32)[2], results[2].untyped_storage(), results[3].numpy()]
    addrs = [r.data_ptr() for r in results]
    del results
    later = [echo.round_trip(tensor(20 + i)) for i in range(2)]  # the same size, while every earlier one is held
    assert not {r.data_ptr() for r in later} & set(addrs)
    assert same(holders[0], originals[0][1:, 100:]) and same(holders[1], originals[1].view(torch.int32)[2])
    kept = torch.empty(0, dtype=torch.float32).set_(holders[2], 0, originals[2].shape)
    assert same(kept, originals[2]) and same(torch.from_numpy(holders[3]), originals[3])
    del kept
    assert all(not free for _, _, free in echo.pool.slots())
    del holders, later
    gc.collect()
    assert all(free for _, _, free in echo.pool.slots())  # every slot is free again once nothing holds it
    again = echo.round_trip(tensor(30))
    assert same(again, tensor(30)) and echo.pool.stats["made"] == 6  # a slot reused, none made


def test_a_result_that_fits_no_slot_falls_back_to_a_fresh_tensor():
    ends = Echo(make_config(result_pool_size=28 * MiB))
    try:
        too_big = ends.round_trip(tensor(1, 32 * MiB))  # larger than the whole pool
        assert same(too_big, tensor(1, 32 * MiB)) and ends.pool.slots() == []
        first, second = ends.round_trip(tensor(2)), ends.round_trip(tensor(3))  # 24 of the 28 MiB, in use
        third = ends.round_trip(tensor(4))  # no room while those are held: fresh
        assert same(third, tensor(4)) and third.data_ptr() not in [a for a, _, _ in ends.pool.slots()]
        assert ends.pool.stats == {"pooled": 2, "fresh": 2, "made": 2, "dropped": 0}
        del first
        fourth = ends.round_trip(tensor(5))
        assert same(fourth, tensor(5)) and ends.pool.stats["pooled"] == 3
        # An idle slot that does not fit gives its room to one that does: 12 MiB in use + 16 MiB new = 28 MiB.
        del fourth
        bigger = ends.round_trip(tensor(6, 16 * MiB))
        assert same(bigger, tensor(6, 16 * MiB))
        assert ends.pool.stats["dropped"] == 1 and ends.pool.held == 28 * MiB
        assert same(second, tensor(3)) and same(third, tensor(4))
    finally:
        ends.close()


def test_no_pool_and_small_results_are_allocated_as_before():
    ends = Echo(make_config(result_pool_size=0))
    try:
        big = ends.round_trip(tensor(1))
        assert same(big, tensor(1)) and ends.pool.stats["pooled"] == 0 and ends.pool.slots() == []
    finally:
        ends.close()
    ends = Echo(make_config())
    try:
        # below ResultPool.MIN_BYTES, inline or not: from the allocator, the pool is not even asked
        for t in (torch.arange(10), tensor(2, ResultPool.MIN_BYTES - 4096)):
            assert same(ends.round_trip(t), t)
        assert ends.pool.stats == {"pooled": 0, "fresh": 0, "made": 0, "dropped": 0}
    finally:
        ends.close()


@pytest.mark.parametrize("echo", [{}], indirect=True)
def test_a_pooled_result_is_registered_only_while_it_is_received(echo):
    """Zero-copy receive registers the result with the engine for that receive only: a slot is never left open to
    the peer's writes while it is the caller's, and its next receive can register it again."""
    engine = echo.pipe.endpoint.engine
    for seed in (1, 2, 3):
        direct = False
        for _ in range(5):  # a sender that waited past OFFER_WAIT for the offer (a busy machine) used the ring
            before = echo.pipe.stats["direct_bytes"]
            got = echo.round_trip(tensor(seed))
            assert same(got, tensor(seed))
            direct = echo.pipe.stats["direct_bytes"] > before
            # registering it again succeeds (the engine refuses overlapping registrations): it is not registered now
            assert engine.register_region(got.data_ptr(), BIG)
            engine.unregister_region(got.data_ptr())
            del got  # its slot back to the pool before the next receive (else that one needs a slot of its own)
            if direct:
                break
        assert direct, echo.pipe.stats
    assert echo.pool.stats["made"] == 1


def test_a_result_shows_only_its_own_bytes_and_its_storage_dies_with_it():
    """A result served from a larger slot (an earlier, larger result's bytes in the rest of it) has a storage of
    exactly its own size: saving it or reading its storage never shows those bytes, and weak references to the
    storage die with the result (then the slot is free)."""
    pool = ResultPool(64 * MiB)
    first, _ = pool.take(torch.uint8, (8 * MiB,), 8 * MiB)
    first.fill_(0xAB)
    del first
    second, _ = pool.take(torch.float32, (MiB,), 4 * MiB)  # fits the 8 MiB slot (within SLACK)
    assert pool.stats["made"] == 1 and pool.stats["pooled"] == 2
    second.fill_(1.0)
    assert second.untyped_storage().nbytes() == 4 * MiB
    saved = io.BytesIO()
    torch.save(second, saved)
    assert saved.tell() < 4 * MiB + 64 * 1024 and b"\xab" * 64 not in saved.getvalue()
    ref = weakref.ref(second.untyped_storage())
    assert not pool.slots()[0][2]
    del second
    gc.collect()
    assert ref() is None and pool.slots()[0][2]


@pytest.mark.parametrize("echo", [{}], indirect=True)
def test_a_result_moved_to_shared_memory_leaves_the_pool(echo):
    got = echo.round_trip(tensor(1))
    slot = got.data_ptr()
    got.share_memory_()  # its storage now owns shared memory, which another process may use: never reuse it
    assert got.data_ptr() != slot and same(got, tensor(1))
    assert echo.pool.slots() == [] or echo.pool.slots()[0][0] == slot
    later = echo.round_trip(tensor(2))
    assert same(later, tensor(2)) and same(got, tensor(1))
    assert [a for a, _, _ in echo.pool.slots()] == [later.data_ptr()]


def test_a_failed_direct_receive_takes_its_slot_out_of_the_pool():
    """A sender that got the direct offer and went away may still have writes on their way into the result: the
    pipe keeps that result (quarantine) for the sender's timeout, and its slot leaves the pool for good, so it is
    never handed to another receive, not even once the pipe (and its quarantine) is gone."""
    cfg = make_config(timeout=5.0)
    with open_pipe(cfg, 1) as pipe:
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                pipe.recv_tensor()
            except BaseException as e:  # the test asserts on it
                errors.append(e)

        with socket.create_connection(("127.0.0.1", pipe.port), timeout=5.0) as sock:
            hello = {"kv_rank": 0, "local_rank": 0, "address": pipe.peer, "to": pipe.endpoint.address,
                     "channel": "kv"}
            kind, _ = peers.raw_handshake(sock, hello)
            assert kind == Kind.WELCOME
            receiver = threading.Thread(target=receive)
            receiver.start()
            sock.sendall(wire.encode_tensor(torch.uint8, (BIG,), BIG))
            kind, payload = wire.recv_frame(sock)  # the offer of a pooled slot
            assert kind == Kind.DIRECT
            offered = wire.decode_direct(payload).regions
        receiver.join(timeout=30)
        assert len(errors) == 1 and isinstance(errors[0], PeerDisconnected), errors
        assert pipe.endpoint.results.slots() == [] and pipe.endpoint.results.stats["made"] == 1
        assert [r.data_ptr() for _, _, r in pipe.endpoint._held] == [offered[0][0]]  # kept alive until no write can land
        # the region is unregistered all the same: a late write is refused by the engine
        assert pipe.endpoint.engine.register_region(*offered[0])
        pipe.endpoint.engine.unregister_region(offered[0][0])


def test_concurrent_takes_never_share_a_slot():
    """Links of one endpoint receive in their own threads and share its pool."""
    pool = ResultPool(64 * MiB)
    failures: list[str] = []

    def user(seed: int) -> None:
        for i in range(200):
            taken = pool.take(torch.uint8, (2 * MiB,), 2 * MiB)
            if taken is None:
                continue
            t = taken[0]
            del taken
            t.fill_(seed)
            held = t[: 4096 * (i % 3 + 1)]  # sometimes only a slice outlives the result
            del t
            if not bool((held == seed).all()):
                failures.append(f"user {seed}: its result was handed to another user")

    threads = [threading.Thread(target=user, args=(s,)) for s in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert pool.stats["pooled"] > 0 and pool.held <= 64 * MiB and len(pool.slots()) <= 8
