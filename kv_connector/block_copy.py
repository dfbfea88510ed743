"""Copies between vLLM's paged KV cache and one dense tensor holding a request's blocks of every layer.

``gather(layers, block_dim, ids)`` returns ``[num_layers, *layer_shape]`` with the block dimension cut down to
``ids`` (in that order); ``scatter`` writes such a tensor back into the given blocks. On the host the copies are
plain memmoves of contiguous runs (one per run of consecutive block ids, per layer and per index before the block
dimension): ``index_select`` / ``index_copy_`` would fan out over the OpenMP pool that vLLM pins to the instance's
core and busy-wait there afterwards. Device tensors (or non-contiguous caches) use torch's indexed copies.
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


def _host_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _check_ids(ids: Sequence[int], blocks: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= blocks):
        raise ValueError(f"block ids {min(ids)}..{max(ids)} out of range for a cache of {blocks} blocks")


def _geometry(layer: torch.Tensor, block_dim: int) -> tuple[int, int, int]:
    """(outer count, blocks, bytes per block slab) of a contiguous layer seen as [outer, blocks, inner]."""
    outer = math.prod(layer.shape[:block_dim])
    inner = math.prod(layer.shape[block_dim + 1:])
    return outer, layer.shape[block_dim], inner * layer.element_size()


def _move(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int], dense: torch.Tensor, dense_blocks: int,
          into_cache: bool) -> None:
    """memmove blocks ``ids`` between contiguous host layers and ``dense`` ([layers, outer, dense_blocks, inner]
    bytes), whose positions 0..len(ids)-1 hold them, one run of consecutive ids at a time."""
    outer, blocks, slab = _geometry(layers[0], block_dim)
    _check_ids(ids, blocks)
    spans = runs(ids)
    base = dense.data_ptr()
    for li, layer in enumerate(layers):
        cache = layer.data_ptr()
        dense_layer = base + li * outer * dense_blocks * slab
        for o in range(outer):
            for pos, block, length in spans:
                at_cache = cache + (o * blocks + block) * slab
                at_dense = dense_layer + (o * dense_blocks + pos) * slab
                if into_cache:
                    ctypes.memmove(at_cache, at_dense, length * slab)
                else:
                    ctypes.memmove(at_dense, at_cache, length * slab)


def gather(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int],
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """A dense tensor ``[len(layers), *shape]`` holding blocks ``ids`` of every layer (block dim = len(ids)): new, or
    a view of the host byte tensor ``scratch`` when it is large enough (reused memory: no page faults to fill)."""
    first = layers[0]
    shape = list(first.shape)
    shape[block_dim] = len(ids)
    if not _host_contiguous(layers):
        index = torch.tensor(list(ids), dtype=torch.long, device=first.device)
        return torch.stack([layer.index_select(block_dim, index) for layer in layers])
    size = [len(layers), *shape]
    nbytes = math.prod(size) * first.element_size()
    if scratch is not None and scratch.is_contiguous() and scratch.device.type == "cpu" and scratch.numel() >= nbytes:
        out = scratch.view(torch.uint8)[:nbytes].view(first.dtype).view(size)
    else:
        out = torch.empty(size, dtype=first.dtype)
    _move(layers, block_dim, ids, out, len(ids), into_cache=False)
    return out


def scatter(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int], kv: torch.Tensor) -> None:
    """Write ``kv`` (as returned by ``gather``, block dim >= len(ids)) into blocks ``ids`` of every layer."""
    n = len(ids)
    if not n:
        return
    if not _host_contiguous(layers) or kv.device.type != "cpu" or not kv.is_contiguous():
        index = torch.tensor(list(ids), dtype=torch.long, device=layers[0].device)
        for layer, blocks in zip(layers, kv, strict=True):
            layer.index_copy_(block_dim, index, blocks.narrow(block_dim, 0, n).to(layer.device))
        return
    if kv.dtype != layers[0].dtype or kv.shape[0] != len(layers) or list(kv.shape[2 + block_dim:]) != list(
            layers[0].shape[block_dim + 1:]) or list(kv.shape[1:1 + block_dim]) != list(layers[0].shape[:block_dim]):
        raise ValueError(f"KV of shape {list(kv.shape)} {kv.dtype} does not fit layers of {list(layers[0].shape)} "
                         f"{layers[0].dtype} along dim {block_dim}")
    have = kv.shape[1 + block_dim]
    if have < n:
        raise ValueError(f"KV holds {have} blocks, {n} wanted")
    _move(layers, block_dim, ids, kv, have, into_cache=True)
