"""The shape of the KV that moves: this instance's paged KV cache, and the descriptor every entry carries.

An entry's KV is block-major, ``[blocks, layers, *block_shape]`` (``block_copy``): row ``i`` is block ``i`` of the
prompt in every layer, K and V together as the attention backend stores them. Blocks are copied whole, so both
instances must run the same model with the same KV layout; the descriptor (model fingerprint, layers, block shape,
dtype, and the span of KV heads this TP rank holds) rides with every entry and is checked on every load.

Instances of different TP sizes hold different spans of heads per block (``heads``): a consumer rank then reads
parts of blocks, which needs vLLM's logical layout ``[blocks, heads, tokens, ...]`` (one head's slots contiguous
within a block, as on the CPU); other layouts serve equal TP sizes only.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from kv_connector.cache import block_copy
from kv_pipe import Scatter

MAX_DESCRIPTOR = 16384  # bytes


class LayoutMismatch(RuntimeError):
    """The producer's KV blocks do not fit this instance's KV cache (another model, dtype or block size)."""


def _scales(kv_scales: list[list[Any]] | None) -> Any:
    """The descriptor's form of per-layer KV scales: None (not quantized), ``{"every layer": [k, v]}``, the list, or
    for a list too long to carry, its digest."""
    if kv_scales is None:
        return None
    if all(s == kv_scales[0] for s in kv_scales):
        return {"every layer": kv_scales[0]}
    text = json.dumps(kv_scales)
    if len(text) > MAX_DESCRIPTOR // 2:
        return {"sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}
    return kv_scales


def parse_descriptor(t: torch.Tensor | None) -> dict[str, Any]:
    """Decode and type-check a peer's layout descriptor (JSON; nothing in it is executed)."""
    try:
        if t is None or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_DESCRIPTOR:
            raise ValueError("not a small 1-D uint8 tensor")
        layout = json.loads(bytes(t.tolist()).decode())
        if not (isinstance(layout, dict) and isinstance(layout.get("model"), str) and isinstance(layout.get("layers"), int)
                and isinstance(layout.get("block"), list) and isinstance(layout.get("dtype"), str)):
            raise ValueError(f"unexpected content {layout!r}")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise LayoutMismatch(f"the producer sent no valid layout descriptor ({e}): is it running this connector?") from None
    return layout


@dataclass
class KVCacheLayout:
    """This instance's KV cache: its layer tensors and where the block dimension is."""

    layers: list[torch.Tensor]
    layer_index: dict[str, int]  # vLLM's layer name -> position in ``layers``
    block_dim: int
    block_bytes: int  # one block of one layer
    descriptor: dict[str, Any]
    heads: tuple[int, int] = (0, 1)  # the span of the model's KV heads this rank's blocks hold
    heads_split: bool = False  # blocks are [heads, ...]: parts of them (some heads) can be loaded

    @classmethod
    def from_caches(cls, kv_caches: dict[str, torch.Tensor], num_blocks: int | None, fingerprint: str,
                    heads: tuple[int, int] = (0, 1), block_size: int | None = None, cache_dtype: str = "auto",
                    kv_scales: list[list[Any]] | None = None) -> KVCacheLayout:
        """``cache_dtype``: vLLM's ``--kv-cache-dtype``; ``kv_scales``: a quantized cache's [k_scale, v_scale] per
        layer (a float each, or a list of per-head floats): its bytes mean the same on two instances only with
        equal scales, so they are part of the descriptor."""
        layers = list(kv_caches.values())
        first = layers[0]
        odd = [name for name, t in kv_caches.items() if t.shape != first.shape or t.dtype != first.dtype]
        if odd:
            raise LayoutMismatch(f"the KV cache's layers differ in shape or dtype ({odd[0]}: "
                                 f"{list(kv_caches[odd[0]].shape)} {kv_caches[odd[0]].dtype} vs {list(first.shape)} "
                                 f"{first.dtype}; e.g. kv_cache_dtype_skip_layers): MooncakeConnector moves blocks of "
                                 "one layout for every layer")
        num_blocks = num_blocks or first.shape[0]
        block_dim = next((d for d, n in enumerate(first.shape) if n == num_blocks), 0)
        shape = block_copy.block_shape(first, block_dim)
        block_bytes = math.prod(shape) * first.element_size()
        descriptor = {"model": fingerprint, "layers": len(layers), "block": shape, "dtype": str(first.dtype),
                      "heads": list(heads), "cache_dtype": cache_dtype, "kv_scales": _scales(kv_scales)}
        # blocks are [heads, block size, ...]; not when another dimension could be the heads as well (FlashInfer's
        # [2 (K, V), block size, heads, ...] with 2 heads per rank)
        span = heads[1] - heads[0]
        split = (block_dim == 0 and len(shape) >= 2 and shape[0] == span and span not in shape[2:]
                 and (block_size is None or shape[1] == block_size))
        return cls(layers, {name: i for i, name in enumerate(kv_caches)}, block_dim, block_bytes, descriptor,
                   heads, split)

    @property
    def row_bytes(self) -> int:
        """Bytes of one entry row: one block of every layer."""
        return self.block_bytes * len(self.layers)

    def kv_bytes(self, nblocks: int) -> int:
        return nblocks * self.row_bytes

    @property
    def on_host(self) -> bool:
        """The cache is contiguous host memory: loads can be received straight into its blocks
        (``receive_into_cache``)."""
        return all(t.device.type == "cpu" and t.is_contiguous() for t in self.layers)

    def scatter(self, block_ids: list[int], at: int = 0, count: int | None = None) -> Scatter:
        """Where the rows of a block-major entry go: block ``block_ids[i]`` of every layer for row i, in the entry's
        byte order (row, layer, index before the block dimension). ``at``, ``count``: only heads ``at`` .. ``at +
        count - 1`` of each block (needs ``heads_split``): for an entry holding just those heads."""
        first = self.layers[0]
        if count is not None:
            if not self.heads_split:
                raise LayoutMismatch("this KV cache's blocks cannot be filled head by head")
            per_head = self.block_bytes // first.shape[1]
            regions = [(layer.data_ptr() + b * self.block_bytes + at * per_head, count * per_head)
                       for b in block_ids for layer in self.layers]
            return Scatter.of(regions, self.layers)
        outer = math.prod(first.shape[:self.block_dim])
        blocks = first.shape[self.block_dim]
        slab = self.block_bytes // outer
        regions = [(layer.data_ptr() + (o * blocks + b) * slab, slab)
                   for b in block_ids for layer in self.layers for o in range(outer)]
        return Scatter.of(regions, self.layers)

    def descriptor_tensor(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(self.descriptor, sort_keys=True).encode()), dtype=torch.uint8)

    def expected(self, heads: tuple[int, int] | None = None) -> dict[str, Any]:
        """The descriptor of a producer rank holding ``heads`` (default: ours) of this model."""
        if heads is None or tuple(heads) == self.heads:
            return self.descriptor
        block = [heads[1] - heads[0], *self.descriptor["block"][1:]]
        return {**self.descriptor, "block": block, "heads": list(heads)}

    def check(self, descriptor: torch.Tensor | None, kv: torch.Tensor | None = None,
              heads: tuple[int, int] | None = None, part: int | None = None) -> None:
        """Raise ``LayoutMismatch`` unless the producer's descriptor is the one a rank holding ``heads`` (default: our
        span) of this model sends, and ``kv`` (block-major rows, if given; ``part`` heads of each block, if given)
        agrees with it."""
        theirs = parse_descriptor(descriptor)
        if kv is not None:
            block = list(theirs["block"])
            if part is not None and block:
                block[0] = part  # the entry's blocks hold all the producer rank's heads; we asked for ``part``
            actual = {"layers": kv.shape[1] if kv.dim() > 1 else None, "block": list(kv.shape[2:]), "dtype": str(kv.dtype)}
            if actual != {"layers": theirs["layers"], "block": block, "dtype": theirs["dtype"]}:
                raise LayoutMismatch(f"the producer's entry contradicts its own layout ({theirs} vs tensor {actual})")
        diff = {k: (theirs.get(k), mine) for k, mine in self.expected(heads).items() if theirs.get(k) != mine}
        if diff:
            described = ", ".join(f"{k}: producer {a} vs this instance {b}" for k, (a, b) in diff.items())
            hint = ("run the same model, dtype, --kv-cache-dtype and block size on both instances" if "kv_scales" not in
                    diff else "a quantized KV cache's bytes mean the same only with the same k/v scales: load the "
                    "same checkpoint (its kv scales) on both instances")
            raise LayoutMismatch(f"the producer's KV layout differs from this instance's ({described}): {hint}")

    def check_piece(self, layer: int, piece: torch.Tensor) -> None:
        """A pushed piece: rows of one layer, ``[blocks, 1, *block_shape]``."""
        if not 0 <= layer < len(self.layers) or piece.dtype != self.layers[0].dtype or piece.dim() < 2 or \
                piece.shape[1] != 1 or list(piece.shape[2:]) != self.descriptor["block"]:
            raise LayoutMismatch(f"a pushed piece (layer {layer}, {list(piece.shape)} {piece.dtype}) does not fit this "
                                 "instance's KV cache")
