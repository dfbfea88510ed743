"""End-to-end KV digests: the blocks a consumer's request attends to hold the bytes its producer saved. The producer
hashes each block it saves or pushes (XXH3-64, per block or per KV head of each block) and packs the digests, sealed
with a secret; the consumer reads a load's blocks back from its KV cache and compares (``kv_digest``).

What is hashed, the packed format, the seal and what it guards against: docs/architecture.md (The KV digest).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
from collections.abc import Sequence

import numpy as np
import torch
import xxhash


class DigestMismatch(ValueError):
    """What landed in the blocks is not what the producer saved (or its digests' seal does not verify)."""


class DigestUnusable(DigestMismatch):
    """The producer's digests cannot be read: none, malformed, of another format (another release), or unsealed
    although a secret is set. Like no digests: ``always`` fails the load, ``sampled`` uses it unchecked."""


TAG = 0x4D4B5644_00000001  # "MKVD", format 1: the first word of packed digests
SEAL_WORDS = 4  # the seal: HMAC-SHA256, as int64 words after the digests
_SEAL_LABEL = b"mooncake-kv-digests\0"
_HEADER = 2  # words before the digests: TAG, groups


def _mac(body: torch.Tensor, context: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, _SEAL_LABEL + context + body.contiguous().numpy().tobytes(), hashlib.sha256).digest()


def seal_context(key: bytes, descriptor: torch.Tensor | None) -> bytes:
    """What a seal binds the digests to: the entry ``key`` (``kv_lookup_buffer.entry_key`` of its tokens) and the layout
    descriptor it travels with (the model, and the TP rank's head span: another rank's digests do not verify)."""
    data = b"" if descriptor is None else descriptor.contiguous().view(torch.uint8).numpy().tobytes()
    return key + hashlib.sha256(data).digest()


def packed_size(num_blocks: int, groups: int, secret: bytes) -> int:
    """The length of ``pack``'s tensor for ``num_blocks`` x ``groups`` digests."""
    return _HEADER + num_blocks * groups + (SEAL_WORDS if secret else 0)


def pack(digests: torch.Tensor, context: bytes, secret: bytes) -> torch.Tensor:
    """The ``[blocks, groups]`` digests of an entry as they travel: one int64 tensor ``[TAG, groups, *digests,
    *seal]``, the seal (an HMAC-SHA256 under ``secret`` of ``context``, a ``seal_context``, and the rest) only with a
    secret."""
    body = torch.cat([torch.tensor([TAG, digests.shape[1]], dtype=torch.int64), digests.reshape(-1)])
    if not secret:
        return body
    return torch.cat([body, torch.frombuffer(bytearray(_mac(body, context, secret)), dtype=torch.int64)])


def groups_of(packed: torch.Tensor) -> int | None:
    """The grouping a packed tensor says it has (unverified), or None if it is not one."""
    if packed.dtype != torch.int64 or packed.dim() != 1 or packed.numel() < _HEADER or int(packed[0]) != TAG:
        return None
    groups = int(packed[1])
    return groups if groups >= 1 else None


def unpack(packed: torch.Tensor, context: bytes, secret: bytes) -> torch.Tensor:
    """The ``[blocks, groups]`` digests of a ``pack``ed tensor sealed with ``context``; ``DigestUnusable`` if it is
    not such a tensor (or bears no seal though a secret is set), ``DigestMismatch`` if its seal does not verify."""
    words = SEAL_WORDS if secret else 0
    groups = groups_of(packed)
    if groups is None or (packed.numel() - _HEADER - words) % groups or packed.numel() < _HEADER + words:
        raise DigestUnusable("the producer's KV digests are not in this release's format")
    if secret and not hmac.compare_digest(_mac(packed[:-words], context, secret),
                                          packed[-words:].contiguous().numpy().tobytes()):
        raise DigestMismatch("the seal of the producer's KV digests does not verify under the secret: the digests "
                             "were changed after the producer made them, or belong to another entry or rank")
    return packed[_HEADER:packed.numel() - words].reshape(-1, groups)


def overwrite(packed: torch.Tensor, first: int, positions: Sequence[int], got: torch.Tensor) -> torch.Tensor:
    """Test switch ``forged_digest``: ``packed`` with the digests of blocks ``first + p`` replaced by ``got`` (as
    whoever could write into the transfer buffers could), its seal kept."""
    groups = groups_of(packed)
    out = packed.clone()
    if groups is not None:
        for row, p in zip(got, positions, strict=True):
            at = _HEADER + (first + p) * groups
            out[at:at + groups] = row
    return out


# A block's digest (one per group: the whole block, or one KV head) is the XXH3-64 of its layers' XXH3-64 digests in
# layer order: each layer's rows hash on their own, in whatever order they come (a push's pieces).
def _combine(per_layer: np.ndarray) -> torch.Tensor:
    """``[blocks, groups, layers]`` uint64 layer digests -> ``[blocks, groups]`` int64 block digests."""
    n, g, layers = per_layer.shape
    if n * g == 0:
        return torch.empty(n, g, dtype=torch.int64)
    flat = np.ascontiguousarray(per_layer).reshape(n * g, layers)
    out = np.fromiter((xxhash.xxh3_64_intdigest(row) for row in flat), dtype=np.uint64, count=n * g)
    return torch.from_numpy(out.view(np.int64).reshape(n, g).copy())


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes, as numpy uint8 (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _row_digests(data: np.ndarray) -> np.ndarray:
    """XXH3-64 of each ``data[i, g]`` of a ``[rows, groups, bytes]`` uint8 array: uint64 ``[rows, groups]``."""
    out = np.empty(data.shape[:2], dtype=np.uint64)
    for i in range(data.shape[0]):
        for g in range(data.shape[1]):
            out[i, g] = xxhash.xxh3_64_intdigest(data[i, g])
    return out


def block_digests(kv: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """The digests of each row of the block-major host tensor ``kv`` (``[blocks, layers, *block]``: a block of every
    layer), int64 ``[blocks, groups]``: of the whole row (``groups`` 1), or of each head (``block[0]``, the heads of a
    ``heads_split`` layout: ``groups`` of them)."""
    n, layers = kv.shape[0], kv.shape[1]
    if n == 0:
        return torch.empty(0, groups, dtype=torch.int64)
    if not kv.is_contiguous():
        kv = kv.contiguous()
    data = _bytes(kv).reshape(n, layers, groups, -1)
    per_layer = np.empty((n, groups, layers), dtype=np.uint64)
    for layer in range(layers):
        per_layer[:, :, layer] = _row_digests(data[:, layer])
    return _combine(per_layer)


def cache_digests(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int],
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """``block_digests`` of blocks ``ids`` of a host KV cache, hashed where they lie (no gathered copy):
    ``[len(ids), 1]``, or per head ``heads[0]`` .. ``heads[1] - 1`` (a ``heads_split`` layout: the first dimension of
    a block, blocks along dimension 0)."""
    lo, hi = (0, 1) if heads is None else heads
    per_layer = np.empty((len(ids), hi - lo, len(layers)), dtype=np.uint64)
    for k, layer in enumerate(layers):
        if block_dim == 0 and layer.is_contiguous() and ids:
            data = _bytes(layer).reshape(layer.shape[0], 1 if heads is None else layer.shape[1], -1)
            for i, b in enumerate(ids):
                for g in range(lo, hi):
                    per_layer[i, g - lo, k] = xxhash.xxh3_64_intdigest(data[b, g])
        else:  # blocks inside the layer's outer dimensions (FlashAttention's [2, blocks, ...]), or not contiguous
            for i, b in enumerate(ids):
                block = layer.select(block_dim, b)
                for g in range(lo, hi):
                    state = xxhash.xxh3_64()
                    _update(state, block if heads is None else block[g])
                    per_layer[i, g - lo, k] = state.intdigest()
    return _combine(per_layer)


class BlockHasher:
    """The ``[num_blocks, groups]`` digests of an entry of ``num_layers`` layers, fed a layer's rows at a time (a
    push's pieces, as they are sent, in any order): equal to ``block_digests`` of the same blocks gathered. One
    thread at a time."""

    def __init__(self, num_blocks: int, num_layers: int, groups: int = 1) -> None:
        self.groups = groups
        self._per_layer = np.zeros((num_blocks, groups, num_layers), dtype=np.uint64)
        self._seen = np.zeros((num_blocks, num_layers), dtype=bool)

    def update(self, first: int, layer: int, rows: torch.Tensor) -> None:
        """Add ``layer``'s rows (``[n, *block]``) of blocks ``first`` .. ``first + n - 1``."""
        n = rows.shape[0]
        data = _bytes(rows if rows.is_contiguous() else rows.contiguous()).reshape(n, self.groups, -1)
        self._per_layer[first:first + n, :, layer] = _row_digests(data)
        self._seen[first:first + n, layer] = True

    def digests(self) -> torch.Tensor | None:
        """The digests, or None if some block's layer never came (a push cut short: no digests rather than wrong
        ones)."""
        return _combine(self._per_layer) if self._seen.all() else None


def _update(state: xxhash.xxh3_64, part: torch.Tensor) -> None:
    if part.is_contiguous():
        state.update(_bytes(part))
    else:
        for sub in part.unbind(0):
            _update(state, sub)


def compare(expected: torch.Tensor | None, got: torch.Tensor, first: int,
            positions: Sequence[int] | None = None, part: tuple[int, int] | None = None) -> str | None:
    """Why the prompt's blocks ``first + p`` for each ``p`` of ``positions`` (default: ``first`` ..
    ``first + len(got) - 1``; ``got``: their ``[n, groups]`` digests as landed) do not match the producer's
    ``expected`` digests of the whole prompt, or None if they match. ``part``: ``got`` holds heads ``part`` of the
    producer's blocks only (its digests per head)."""
    at = list(range(got.shape[0])) if positions is None else list(positions)
    if expected is None:
        return "the producer sent no KV digests (its kv_digest is \"off\")"
    last = first + (max(at) if at else -1)
    if expected.dim() != 2 or expected.shape[0] <= last:
        return f"the producer's KV digests do not cover blocks {first}-{last} ({expected.shape[0]} blocks)"
    columns = expected if part is None else expected[:, part[0]:part[1]]
    if columns.shape[1] != got.shape[1]:
        return (f"the producer's KV digests come in groups of {expected.shape[1]} per block, not "
                f"{got.shape[1]}{'' if part is None else f' (heads {part[0]}-{part[1] - 1})'}")
    bad = (columns[[first + p for p in at]] != got).any(dim=1).nonzero().flatten()
    if bad.numel():
        return (f"{bad.numel()} of {got.shape[0]} loaded blocks differ from what the producer saved (first: block "
                f"{first + at[int(bad[0])]} of the prompt)")
    return None


class Sampler:
    """Which loads are checked: none, every one, or one in ``every`` (thread-safe)."""

    def __init__(self, mode: str, every: int) -> None:
        self.mode, self.every = mode, every
        self._count = itertools.count()
        self._lock = threading.Lock()

    def due(self) -> bool:
        if self.mode == "off":
            return False
        if self.mode == "always":
            return True
        with self._lock:
            return next(self._count) % self.every == 0
