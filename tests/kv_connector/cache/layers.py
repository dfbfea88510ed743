"""KV-cache layers for the block copy and staging tests: vLLM's cache layouts in small, seeded tensors, the block ids
to move, and what torch's own indexing gathers from them. Imports nothing but torch (the GPU machines run these tests
with torch only)."""

from __future__ import annotations

import torch

LAYOUTS = [
    (0, (12, 2, 4, 8)),     # CPU backend: [num_blocks, kv_heads, block_size, 2 * head_dim]
    (1, (2, 12, 4, 3, 8)),  # flash-attention style: [2 (K, V), num_blocks, block_size, kv_heads, head_dim]
    (2, (2, 3, 12, 16)),
]
IDS = [[5], [3, 4, 5, 9, 0, 1], [11, 10, 9], list(range(12)), []]


def make_layers(shape: tuple[int, ...], dtype: torch.dtype, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(-100, 100, shape, generator=g).to(dtype) for _ in range(n)]


def reference_gather(layers: list[torch.Tensor], block_dim: int, ids: list[int]) -> torch.Tensor:
    """Block-major [blocks, layers, *block] by torch's own indexing."""
    index = torch.tensor(ids, dtype=torch.long)
    return torch.stack([layer.index_select(block_dim, index).movedim(block_dim, 0) for layer in layers], dim=1)
