"""KVStaging: copies between the paged cache and host memory. On the host they are block_copy's; on a GPU they run
on streams of their own, ordered after the forward stream's work by events, without a synchronizing CUDA call (the
``cuda`` cases, where a GPU is, run under ``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import pytest
import torch

from kv_connector import staging as staging_module
from kv_connector.staging import KVStaging
from tests.kv_connector.test_block_copy import IDS, LAYOUTS, make_layers, reference_gather
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
        staging.fence()
        staged = staging.gather(ids)
        one = staging.gather(ids, layer=1)
        staged.wait()
        one.wait()
    assert staged.tensor.device.type == "cpu" and torch.equal(staged.tensor, reference_gather(host, block_dim, ids))
    assert torch.equal(one.tensor, reference_gather(host[1:2], block_dim, ids))


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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")
def test_device_copies_are_ordered_by_events_not_by_waiting():
    """A gather sees what the forward stream wrote before it (queued, not finished, when the gather was asked for);
    after ``fence`` the forward stream's next writes wait for the gather; a scatter after ``mark`` lands after the
    forward stream's queued reads. The forward pass's thread never waits."""
    layer = torch.zeros(8, 2, 16, 64, device="cuda")
    staging = KVStaging([layer], 0)
    big = torch.randn(4096, 4096, device="cuda")
    with strict_sync("cuda"):
        for _ in range(20):  # keep the forward stream busy for a while
            big = big @ big / 64
        layer[2].fill_(7.0)  # the forward pass writes block 2
        staged = staging.gather([2])
        staging.fence()
        layer[2].fill_(9.0)  # the next step's write into the same block
    staged.wait()
    assert torch.all(staged.tensor == 7.0)
    torch.cuda.synchronize()
    assert torch.all(layer[2] == 9.0)
