"""Copies between vLLM's paged KV cache and one dense, block-major tensor holding some blocks of every layer.

The dense tensor is ``[blocks, layers, *block_shape]`` (``block_shape``: a layer's shape without its block
dimension): block-major, so any range of blocks is a contiguous slice (a consumer fetching only the blocks it lacks
gets a slice the producer sends without copying). ``gather(layers, block_dim, ids)`` builds one from blocks ``ids``
(in that order); ``scatter`` writes one back into given blocks.

On the host the copies are plain memmoves, one per block and layer (and index before the block dimension), merged
into one per run of consecutive block ids where the dense side is contiguous too: ``index_select`` / ``index_copy_``
would fan out over the OpenMP pool that vLLM pins to the instance's core and busy-wait there afterwards. Device
tensors (or non-contiguous caches) use torch's indexed copies.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import torch


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Consecutive runs of block ids as (position in ids, first id, length)."""
    out: list[tuple[int, int, int]] = []
    for pos, block in enumerate(ids):
        if out and block == out[-1][1] + out[-1][2] and pos == out[-1][0] + out[-1][2]:
            first_pos, first, length = out[-1]
            out[-1] = (first_pos, first, length + 1)
        else:
            out.append((pos, block, 1))
    return out


def block_shape(layer: torch.Tensor, block_dim: int) -> list[int]:
    """One block of one layer: the layer's shape without its block dimension."""
    shape = list(layer.shape)
    del shape[block_dim]
    return shape


def _host_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _check_ids(ids: Sequence[int], blocks: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= blocks):
        raise ValueError(f"block ids {min(ids)}..{max(ids)} out of range for a cache of {blocks} blocks")


def _move(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int], dense: torch.Tensor,
          into_cache: bool) -> None:
    """memmove blocks ``ids`` between contiguous host layers and the block-major ``dense``, whose rows
    0..len(ids)-1 hold them."""
    first = layers[0]
    outer = math.prod(first.shape[:block_dim])
    blocks = first.shape[block_dim]
    slab = math.prod(first.shape[block_dim + 1:]) * first.element_size()  # bytes of one block under one outer index
    _check_ids(ids, blocks)
    nlayers = len(layers)
    row = nlayers * outer * slab  # bytes of one dense row (one block of every layer)
    base = dense.data_ptr()
    merge = nlayers * outer == 1  # consecutive blocks are then contiguous on both sides
    for li, layer in enumerate(layers):
        cache = layer.data_ptr()
        for o in range(outer):
            for pos, block, length in runs(ids):
                steps = ((pos, block, length),) if merge else ((pos + i, block + i, 1) for i in range(length))
                for p, b, n in steps:
                    at_cache = cache + (o * blocks + b) * slab
                    at_dense = base + p * row + (li * outer + o) * slab
                    if into_cache:
                        ctypes.memmove(at_cache, at_dense, n * slab)
                    else:
                        ctypes.memmove(at_dense, at_cache, n * slab)


def gather(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int],
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """A dense ``[len(ids), len(layers), *block_shape]`` tensor holding blocks ``ids`` of every layer: new, or a view
    of the host byte tensor ``scratch`` when it is large enough (reused memory: no page faults to fill)."""
    first = layers[0]
    size = [len(ids), len(layers), *block_shape(first, block_dim)]
    if not _host_contiguous(layers):
        index = torch.tensor(list(ids), dtype=torch.long, device=first.device)
        return torch.stack([layer.index_select(block_dim, index).movedim(block_dim, 0) for layer in layers], dim=1)
    nbytes = math.prod(size) * first.element_size()
    if scratch is not None and scratch.is_contiguous() and scratch.device.type == "cpu" and scratch.numel() >= nbytes:
        out = scratch.view(torch.uint8)[:nbytes].view(first.dtype).view(size)
    else:
        out = torch.empty(size, dtype=first.dtype)
    _move(layers, block_dim, ids, out, into_cache=False)
    return out


def scatter(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int], kv: torch.Tensor,
            heads: tuple[int, int] | None = None) -> None:
    """Write the first ``len(ids)`` rows of ``kv`` (block-major, as ``gather`` returns) into blocks ``ids`` of every
    layer; ``heads=(start, stop)``: ``kv`` holds only that range of each block's first dimension (blocks along
    dimension 0), written there."""
    n = len(ids)
    if not n:
        return
    first = layers[0]
    if heads is not None:
        if block_dim != 0:
            raise ValueError("a part of each block can only be written with blocks along dimension 0")
        layers = [layer.narrow(1, heads[0], heads[1] - heads[0]) for layer in layers]
        first = layers[0]
    if kv.dim() < 2 or kv.dtype != first.dtype or kv.shape[1] != len(layers) or \
            list(kv.shape[2:]) != block_shape(first, block_dim):
        raise ValueError(f"KV of shape {list(kv.shape)} {kv.dtype} does not fit {len(layers)} layers of "
                         f"{list(first.shape)} {first.dtype} (blocks along dim {block_dim})")
    if kv.shape[0] < n:
        raise ValueError(f"KV holds {kv.shape[0]} blocks, {n} wanted")
    if not _host_contiguous(layers) or kv.device.type != "cpu" or not kv.is_contiguous():
        index = torch.tensor(list(ids), dtype=torch.long, device=first.device)
        for li, layer in enumerate(layers):
            layer.index_copy_(block_dim, index, kv[:n, li].movedim(0, block_dim).to(layer.device))
        return
    _move(layers, block_dim, ids, kv, into_cache=True)
