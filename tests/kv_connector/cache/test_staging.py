"""KVStaging: copies between the paged cache and host memory. On the host they are block_copy's; on a GPU they run
on streams of their own, ordered after the forward stream's work by events, without a synchronizing CUDA call (the
``cuda`` cases, where a GPU is, run under ``torch.cuda.set_sync_debug_mode("error")``), from pinned memory taken
once. Sleep mode's gate; loader threads writing a cache vLLM made of inference tensors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_connector.cache import staging as staging_module
from kv_connector.cache.staging import CacheSuspended, KVStaging
from tests.kv_connector.cache.layers import IDS, LAYOUTS, make_layers, reference_gather
from tests.kv_connector.worker_peers import strict_sync

# a device copy goes in pieces of at most CHUNK_BYTES: the default, and one block row at a time
PIECES = pytest.mark.parametrize("piece_bytes", [staging_module.CHUNK_BYTES, 1], ids=["whole", "row-by-row"])


@PIECES
@pytest.mark.parametrize("block_dim, shape", LAYOUTS)
@pytest.mark.parametrize("ids", IDS)
def test_gather_gives_the_blocks_in_host_memory(block_dim, shape, ids, device, piece_bytes, monkeypatch):
    monkeypatch.setattr(staging_module, "CHUNK_BYTES", piece_bytes)
    host = make_layers(shape, torch.bfloat16)
    staging = KVStaging([t.to(device) for t in host], block_dim)
    with strict_sync(device):
        staged = staging.gather(ids, owner="r")
        one = staging.gather(ids, layer=1)
        staged.wait()
        one.wait()
    assert staged.tensor.device.type == "cpu" and torch.equal(staged.tensor, reference_gather(host, block_dim, ids))
    assert torch.equal(one.tensor, reference_gather(host[1:2], block_dim, ids))
    assert staging.sent(["r", "other"]) == {"r", "other"}  # its copy ended (waited for above)


@PIECES
@pytest.mark.parametrize("block_dim, shape", LAYOUTS)
def test_scatter_writes_the_blocks_it_names_and_nothing_else(block_dim, shape, device, piece_bytes, monkeypatch):
    monkeypatch.setattr(staging_module, "CHUNK_BYTES", piece_bytes)
    host = make_layers(shape, torch.float32)
    ids = [3, 4, 5, 9, 0]
    rows = torch.randn(6, 3, *reference_gather(host, block_dim, [0]).shape[2:])  # one row more than written
    layers = [t.clone().to(device) for t in host]
    staging = KVStaging(layers, block_dim)
    with strict_sync(device):
        staging.mark()
        staging.scatter(ids, rows)
        staging.scatter([7], rows[:1, 2:3], layer=2, wait=False).wait()
    expected = [t.clone() for t in host]
    for li, t in enumerate(expected):
        t.index_copy_(block_dim, torch.tensor(ids), rows[:5, li].movedim(0, block_dim))
    expected[2].index_copy_(block_dim, torch.tensor([7]), rows[:1, 2].movedim(0, block_dim))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(layers, expected, strict=True))


def test_scatter_of_some_heads(device):
    """A TP consumer rank's part of a producer's blocks: heads 1..2 of blocks along dimension 0."""
    host = make_layers((12, 4, 4, 8), torch.float32)
    layers = [t.clone().to(device) for t in host]
    rows = torch.randn(2, 3, 2, 4, 8)
    with strict_sync(device):
        KVStaging(layers, 0).scatter([6, 2], rows, heads=(1, 3))
    for li, t in enumerate(host):
        t[[6, 2], 1:3] = rows[:, li]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(layers, host, strict=True))


def test_readback_gives_what_lies_in_the_cache(device):
    host = make_layers((12, 2, 4, 2, 8), torch.float32)
    staging = KVStaging([t.to(device) for t in host], 0)
    with strict_sync(device):
        landed = staging.readback([5, 1])
    assert torch.equal(landed, reference_gather(host, 0, [5, 1]))


def test_loader_threads_write_a_cache_made_of_inference_tensors():
    """vLLM may allocate the KV cache in inference mode; a loader thread (not in it) must still write into it,
    whole blocks and parts of them (an in-place op on an inference tensor outside inference mode raises)."""
    with torch.inference_mode():
        layers = [torch.zeros(12, 4, 4, 8) for _ in range(3)]
    staging = KVStaging(layers, 0)
    rows = torch.randn(2, 3, 2, 4, 8)
    errors = []

    def load() -> None:
        try:
            staging.scatter([6, 2], rows, heads=(1, 3))
            staging.scatter([4], torch.randn(1, 3, 4, 4, 8))
        except Exception as e:
            errors.append(e)
    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    assert errors == []
    assert torch.equal(layers[1][[6, 2], 1:3], rows[:, 1])


def test_suspend_waits_for_copies_being_queued_and_lets_none_start_until_resumed():
    """Sleep mode: a copy already being queued ends before ``suspend`` returns; after it, no copy starts into or out
    of the cache (a load then fails, and is recomputed) until ``resume``."""
    layers = [torch.zeros(8, 2, 4) for _ in range(2)]
    staging = KVStaging(layers, 0)
    inside, leave = threading.Event(), threading.Event()

    def copying() -> None:
        with staging._copy():  # a copy being queued: sleep mode must not release the memory under it
            inside.set()
            leave.wait(10)
    thread = threading.Thread(target=copying)
    thread.start()
    inside.wait(10)
    suspended = threading.Event()
    waiter = threading.Thread(target=lambda: (staging.suspend(), suspended.set()))
    waiter.start()
    time.sleep(0.2)
    assert not suspended.is_set()  # waits for the copy in flight
    leave.set()
    thread.join(10)
    waiter.join(10)
    assert suspended.is_set()
    with pytest.raises(CacheSuspended, match="sleep mode"):
        staging.scatter([1], torch.ones(1, 2, 2, 4))
    with pytest.raises(CacheSuspended):
        staging.gather([1])
    assert not layers[0].any()
    staging.resume()
    staging.scatter([1], torch.ones(1, 2, 2, 4))
    assert layers[0][1].eq(1).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")
def test_device_copies_are_ordered_by_events_not_by_waiting():
    """A gather sees what the forward stream wrote before it (queued, not finished, when the gather was asked for);
    a request's blocks are ``sent`` only once its copy ended; ``protect`` (a preempted request) makes the forward
    stream's next writes wait for it. The forward pass's thread never waits."""
    layer = torch.zeros(8, 2, 16, 64, device="cuda")
    staging = KVStaging([layer], 0)
    big = torch.randn(4096, 4096, device="cuda")
    with strict_sync("cuda"):
        for _ in range(20):  # keep the forward stream busy for a while
            big = big @ big / 64
        layer[2].fill_(7.0)  # the forward pass writes block 2
        staged = staging.gather([2], owner="r")
        assert staging.sent(["r"]) == set()  # still queued behind the forward stream's work
        staging.protect(["r"])
        layer[2].fill_(9.0)  # the next step's write into the same block
    staged.wait()
    assert torch.all(staged.tensor == 7.0)
    torch.cuda.synchronize()
    assert torch.all(layer[2] == 9.0)
    assert staging.sent(["r"]) == {"r"}
