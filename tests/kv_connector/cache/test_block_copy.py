"""block_copy's memmove gather/scatter give exactly what torch's indexed copies give, for vLLM's cache layouts."""

from __future__ import annotations

import pytest
import torch

from kv_connector.cache import block_copy
from tests.kv_connector.cache.layers import IDS, LAYOUTS, make_layers, reference_gather


def test_runs():
    assert block_copy.runs([3, 4, 5, 9, 0, 1]) == [(0, 3, 3), (3, 9, 1), (4, 0, 2)]
    assert block_copy.runs([]) == []
    assert block_copy.runs([2, 2]) == [(0, 2, 1), (1, 2, 1)]


@pytest.mark.parametrize("block_dim, shape", LAYOUTS)
@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_gather_matches_index_select(block_dim, shape, ids, dtype, device):
    layers = make_layers(shape, dtype)
    got = block_copy.gather([t.to(device) for t in layers], block_dim, ids)
    assert torch.equal(got.cpu(), reference_gather(layers, block_dim, ids))


@pytest.mark.parametrize("block_dim, shape", LAYOUTS)
@pytest.mark.parametrize("ids", IDS)
def test_scatter_matches_index_copy(block_dim, shape, ids, device):
    expected = make_layers(shape, torch.bfloat16)
    layers = [layer.clone().to(device) for layer in expected]
    block = [n for d, n in enumerate(shape) if d != block_dim]
    kv = torch.randn(len(ids), len(layers), *block).to(torch.bfloat16)
    index = torch.tensor(ids, dtype=torch.long)
    for li, layer in enumerate(expected):
        layer.index_copy_(block_dim, index, kv[:, li].movedim(0, block_dim))
    block_copy.scatter(layers, block_dim, ids, kv)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(layers, expected, strict=True))


def test_scatter_takes_the_first_blocks_of_a_longer_entry():
    layers = make_layers((6, 2, 4), torch.float32)
    kv = block_copy.gather(layers, 0, [0, 1, 2, 3])
    targets = [layer.clone() for layer in layers]
    block_copy.scatter(targets, 0, [5, 4], kv)
    for layer, target in zip(layers, targets, strict=True):
        assert torch.equal(target[5], layer[0]) and torch.equal(target[4], layer[1])


def test_non_contiguous_layers_use_torch():
    base = make_layers((8, 12, 4), torch.float32)
    layers = [t.transpose(0, 1) for t in base]  # blocks along dim 0 of a non-contiguous view
    ids = [1, 7, 2]
    expected = reference_gather(layers, 0, ids)
    assert torch.equal(block_copy.gather(layers, 0, ids), expected)
    block_copy.scatter(layers, 0, [0, 3, 4], expected)
    assert torch.equal(layers[0][3], expected[1][0])


def test_bad_ids_and_shapes_are_refused():
    layers = make_layers((6, 2, 4), torch.float32)
    with pytest.raises(ValueError, match="out of range"):
        block_copy.gather(layers, 0, [6])
    with pytest.raises(ValueError, match="holds 1 blocks, 2 wanted"):
        block_copy.scatter(layers, 0, [0, 1], block_copy.gather(layers, 0, [0]))
    with pytest.raises(ValueError, match="does not fit"):
        block_copy.scatter(layers, 0, [0], torch.zeros(1, 3, 2, 5))


def test_gather_into_scratch_memory():
    layers = make_layers((12, 2, 4, 8), torch.float32)
    scratch = torch.zeros(3 * 5 * 2 * 4 * 8 * 4 + 100, dtype=torch.uint8)
    got = block_copy.gather(layers, 0, [5, 6, 7, 0, 1], scratch)
    assert got.data_ptr() == scratch.data_ptr()
    assert torch.equal(got, torch.stack([layer[[5, 6, 7, 0, 1]] for layer in layers], dim=1))
    small = torch.zeros(10, dtype=torch.uint8)
    assert block_copy.gather(layers, 0, [1], small).data_ptr() != small.data_ptr()  # too small: a new tensor


@pytest.mark.parametrize("block_dim, shape", LAYOUTS)
def test_a_slice_of_rows_scatters_to_the_blocks_it_names(block_dim, shape):
    """Partial loads: rows [2, 5) of an entry gathered from blocks 0..5 land in the consumer's blocks for them."""
    source = make_layers(shape, torch.float32)
    entry = block_copy.gather(source, block_dim, [0, 1, 2, 3, 4, 5])
    part = entry[2:5]
    assert part.is_contiguous()
    targets = [torch.zeros_like(layer) for layer in source]
    block_copy.scatter(targets, block_dim, [9, 7, 8], part)
    for src, dst in zip(source, targets, strict=True):
        for s, d in ((2, 9), (3, 7), (4, 8)):
            assert torch.equal(src.select(block_dim, s), dst.select(block_dim, d))
        assert not dst.select(block_dim, 0).any()
