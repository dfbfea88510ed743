"""End-to-end KV digests: the blocks a consumer's request attends to hold the bytes its producer saved.

The producer hashes each block it saves (every layer's rows of that block, laid out as ``block_copy.gather`` lays
them out) with xxHash's XXH3-64 (a fast non-cryptographic hash, as storage systems use for checksums), one int64
per block (or per head of each block, below); the digests travel with the entry (the buffer's ``hidden`` tensor,
over the pipe, whose peers proved the secret if one is set). The consumer, once a load's blocks are written into its
KV cache and before vLLM may run the request, reads those blocks back and hashes them: a difference (a byte changed
in flight or in a buffer, a block written into the wrong place, blocks left holding what they held before) fails
the load, which vLLM recomputes (or ends the request: ``kv_load_failure_policy`` "fail"). Modes (``kv_digest``):
``off``, ``sampled`` (one load in ``kv_digest_sample``), ``always``. Pushed entries carry their digests in their
commit: the producer's push sender hashes each piece as it sends it (``BlockHasher``). Checked: every load, pulled
or pushed, of whole blocks or of some heads of each (a consumer of another TP size).

Digests travel packed (``pack``): ``[groups, *digests]``, one per block, or one per KV head of each block where the
layout holds a block's heads first (``heads_split``), so that a consumer of another TP size, which loads some heads
of each block, checks those. With a secret the producer seals them (an HMAC-SHA256 under the secret of the entry's
key and the digests, appended) and the consumer checks the seal first (``unpack``). XXH3 catches accidents, not an
attacker: whoever can write into the Transfer Engine's buffers (they take writes from anyone who reaches their port,
secret or not) could change a block and its digest alike; with the seal they cannot make digests that match what they
wrote.
(The seal cannot ride in the request's signed params: vLLM's scheduler answers the prefill, params included, before
the worker's output of that step - where the digests are - reaches the scheduler side.)
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
from collections.abc import Sequence

import torch
import xxhash

_SIGNED = 1 << 63


def _signed(value: int) -> int:
    """An unsigned 64-bit digest as the int64 a tensor holds."""
    return value - (1 << 64) if value >= _SIGNED else value


class DigestMismatch(ValueError):
    """What landed in the blocks is not what the producer saved."""


SEAL_WORDS = 4  # the seal: HMAC-SHA256, as int64 words after the digests
_SEAL_LABEL = b"mooncake-kv-digests\0"


def _mac(body: torch.Tensor, key: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, _SEAL_LABEL + key + body.contiguous().numpy().tobytes(), hashlib.sha256).digest()


def packed_size(num_blocks: int, groups: int, secret: bytes) -> int:
    """The length of ``pack``'s tensor for ``num_blocks`` x ``groups`` digests."""
    return 1 + num_blocks * groups + (SEAL_WORDS if secret else 0)


def pack(digests: torch.Tensor, key: bytes, secret: bytes) -> torch.Tensor:
    """The ``[blocks, groups]`` digests of the entry ``key`` (``push_wire.entry_key`` of its tokens) as they travel:
    one int64 tensor ``[groups, *digests, *seal]``, the seal (an HMAC-SHA256 under ``secret``) only with a secret."""
    body = torch.cat([torch.tensor([digests.shape[1]], dtype=torch.int64), digests.reshape(-1)])
    if not secret:
        return body
    return torch.cat([body, torch.frombuffer(bytearray(_mac(body, key, secret)), dtype=torch.int64)])


def unpack(packed: torch.Tensor, key: bytes, secret: bytes) -> torch.Tensor:
    """The ``[blocks, groups]`` digests of a ``pack``ed tensor of the entry ``key``; ``DigestMismatch`` if it is
    malformed or (with a secret) its seal does not verify."""
    words = SEAL_WORDS if secret else 0
    if packed.dtype != torch.int64 or packed.dim() != 1 or packed.numel() < 1 + words:
        raise DigestMismatch("the producer's KV digests are malformed" + (" or carry no seal" if secret else ""))
    body = packed[:packed.numel() - words]
    if secret and not hmac.compare_digest(_mac(body, key, secret), packed[-words:].contiguous().numpy().tobytes()):
        raise DigestMismatch("the seal of the producer's KV digests does not verify under the secret: the digests "
                             "were changed after the producer made them, or belong to another entry")
    groups = int(body[0])
    if groups < 1 or (body.numel() - 1) % groups:
        raise DigestMismatch(f"the producer's KV digests are malformed ({body.numel() - 1} digests in groups of "
                             f"{groups})")
    return body[1:].reshape(-1, groups)


def block_digests(kv: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """XXH3-64 of each row of the block-major host tensor ``kv`` (``[blocks, layers, *block]``: a block of every
    layer), as int64 ``[blocks, groups]``: of the whole row (``groups`` 1), or of each head (``block[0]``, the heads
    of a ``heads_split`` layout: ``groups`` of them) over every layer."""
    n = kv.shape[0]
    if groups > 1:
        return torch.tensor([[_digest(kv[i, :, h].unbind(0)) for h in range(groups)] for i in range(n)],
                            dtype=torch.int64).reshape(n, groups)
    if n == 0:
        return torch.empty(0, 1, dtype=torch.int64)
    rows = kv.reshape(n, -1)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    data = rows.view(torch.uint8).numpy()
    out = torch.empty(n, 1, dtype=torch.int64)
    for i in range(n):
        out[i, 0] = _signed(xxhash.xxh3_64_intdigest(data[i]))
    return out


def cache_digests(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int],
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """``block_digests`` of blocks ``ids`` of a host KV cache, hashed where they lie (no gathered copy: a block's
    bytes are streamed into the hash layer by layer, in ``block_copy.gather``'s order): ``[len(ids), 1]``, or per head
    ``heads[0]`` .. ``heads[1] - 1`` (a ``heads_split`` layout: the first dimension of a block)."""
    if heads is None:
        return torch.tensor([[_digest([layer.select(block_dim, b) for layer in layers])] for b in ids],
                            dtype=torch.int64).reshape(len(ids), 1)
    lo, hi = heads
    return torch.tensor([[_digest([layer.select(block_dim, b)[h] for layer in layers]) for h in range(lo, hi)]
                         for b in ids], dtype=torch.int64).reshape(len(ids), hi - lo)


def _digest(parts: Sequence[torch.Tensor]) -> int:
    state = xxhash.xxh3_64()
    for part in parts:
        _update(state, part)
    return _signed(state.intdigest())


class BlockHasher:
    """The ``[num_blocks, groups]`` digests of an entry, fed a layer's rows at a time (a push's pieces, as they are
    sent): equal to ``block_digests`` of the same blocks gathered, if each block's layers come in order. One thread
    at a time."""

    def __init__(self, num_blocks: int, groups: int = 1) -> None:
        self.groups = groups
        self._states = [[xxhash.xxh3_64() for _ in range(groups)] for _ in range(num_blocks)]

    def update(self, first: int, rows: torch.Tensor) -> None:
        """Add one layer's rows (``[n, *block]``) of blocks ``first`` .. ``first + n - 1``."""
        for i, row in enumerate(rows.unbind(0)):
            states = self._states[first + i]
            if self.groups == 1:
                _update(states[0], row)
            else:
                for h, state in enumerate(states):
                    _update(state, row[h])

    def digests(self) -> torch.Tensor:
        return torch.tensor([[_signed(state.intdigest()) for state in states] for states in self._states],
                            dtype=torch.int64).reshape(len(self._states), self.groups)


def _update(state: xxhash.xxh3_64, part: torch.Tensor) -> None:
    if part.is_contiguous():
        state.update(part.reshape(-1).view(torch.uint8).numpy())
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
