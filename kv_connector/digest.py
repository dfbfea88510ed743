"""End-to-end KV digests: the blocks a consumer's request attends to hold the bytes its producer saved.

The producer hashes each block it saves (every layer's rows of that block, laid out as ``block_copy.gather`` lays
them out) with xxHash's XXH3-64 (a fast non-cryptographic hash, as storage systems use for checksums), one int64
per block; the digests travel with the entry (the buffer's ``hidden`` tensor, over the pipe, whose peers proved the
secret if one is set). The consumer, once a load's blocks are written into its KV cache and before vLLM may run
the request, reads those blocks back and hashes them: a difference (a byte changed in flight or in a buffer, a block
written into the wrong place, blocks left holding what they held before) fails the load, which vLLM recomputes (or
ends the request: ``kv_load_failure_policy`` "fail"). Modes (``kv_digest``): ``off``, ``sampled`` (one load in
``kv_digest_sample``), ``always``. Pushed entries carry their digests in their commit: the producer's push sender
hashes each piece as it sends it (``BlockHasher``). Checked: loads of whole blocks (equal TP sizes, MLA), pulled or
pushed; not yet: parts of blocks (a consumer of another TP size).

With a secret, the producer seals the digests (``seal``: an HMAC-SHA256 under the secret of the entry's key and its
digests, appended) and the consumer checks the seal first (``unseal``). XXH3 catches accidents, not an attacker:
whoever can write into the Transfer Engine's buffers (they take writes from anyone who reaches their port, secret or
not) could change a block and its digest alike; with the seal they cannot make digests that match what they wrote.
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


def _mac(digests: torch.Tensor, key: bytes, secret: bytes) -> bytes:
    data = digests.contiguous().numpy().tobytes()
    return hmac.new(secret, _SEAL_LABEL + key + data, hashlib.sha256).digest()


def sealed_size(num_blocks: int, secret: bytes) -> int:
    """The length of ``seal``'s tensor for ``num_blocks`` digests."""
    return num_blocks + (SEAL_WORDS if secret else 0)


def seal(digests: torch.Tensor, key: bytes, secret: bytes) -> torch.Tensor:
    """``digests`` of the entry ``key`` (``push_wire.entry_key`` of its tokens), with their seal under ``secret``
    appended (as they are without a secret)."""
    if not secret:
        return digests
    return torch.cat([digests, torch.frombuffer(bytearray(_mac(digests, key, secret)), dtype=torch.int64)])


def unseal(sealed: torch.Tensor, key: bytes, secret: bytes) -> torch.Tensor:
    """The digests of a ``seal``ed tensor of the entry ``key``; ``DigestMismatch`` if its seal does not verify under
    ``secret`` (as it is without a secret)."""
    if not secret:
        return sealed
    if sealed.dtype != torch.int64 or sealed.dim() != 1 or sealed.numel() < SEAL_WORDS:
        raise DigestMismatch("the producer's KV digests carry no seal, but a secret is set")
    digests = sealed[:-SEAL_WORDS]
    if not hmac.compare_digest(_mac(digests, key, secret), sealed[-SEAL_WORDS:].contiguous().numpy().tobytes()):
        raise DigestMismatch("the seal of the producer's KV digests does not verify under the secret: the digests "
                             "were changed after the producer made them, or belong to another entry")
    return digests


def block_digests(kv: torch.Tensor) -> torch.Tensor:
    """XXH3-64 of each row of the block-major host tensor ``kv`` (a block of every layer), as int64."""
    if kv.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64)
    rows = kv.reshape(kv.shape[0], -1)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    data = rows.view(torch.uint8).numpy()
    out = torch.empty(kv.shape[0], dtype=torch.int64)
    for i in range(kv.shape[0]):
        out[i] = _signed(xxhash.xxh3_64_intdigest(data[i]))
    return out


def cache_digests(layers: Sequence[torch.Tensor], block_dim: int, ids: Sequence[int]) -> torch.Tensor:
    """``block_digests`` of blocks ``ids`` of a host KV cache, hashed where they lie (no gathered copy: a block's
    bytes are streamed into the hash layer by layer, in ``block_copy.gather``'s order)."""
    out = torch.empty(len(ids), dtype=torch.int64)
    for i, block in enumerate(ids):
        state = xxhash.xxh3_64()
        for layer in layers:
            _update(state, layer.select(block_dim, block))
        out[i] = _signed(state.intdigest())
    return out


class BlockHasher:
    """The digests of an entry's ``num_blocks`` blocks, fed a layer's rows at a time (a push's pieces, as they are
    sent): equal to ``block_digests`` of the same blocks gathered, if each block's layers come in order. One thread
    at a time."""

    def __init__(self, num_blocks: int) -> None:
        self._states = [xxhash.xxh3_64() for _ in range(num_blocks)]

    def update(self, first: int, rows: torch.Tensor) -> None:
        """Add one layer's rows of blocks ``first`` .. ``first + len(rows) - 1``."""
        for i, row in enumerate(rows.unbind(0)):
            _update(self._states[first + i], row)

    def digests(self) -> torch.Tensor:
        return torch.tensor([_signed(state.intdigest()) for state in self._states], dtype=torch.int64)


def _update(state: xxhash.xxh3_64, part: torch.Tensor) -> None:
    if part.is_contiguous():
        state.update(part.reshape(-1).view(torch.uint8).numpy())
    else:
        for sub in part.unbind(0):
            _update(state, sub)


def compare(expected: torch.Tensor | None, got: torch.Tensor, first: int,
            positions: Sequence[int] | None = None) -> str | None:
    """Why the prompt's blocks ``first + p`` for each ``p`` of ``positions`` (default: ``first`` ..
    ``first + len(got) - 1``; ``got``: their digests as landed) do not match the producer's ``expected`` digests of the
    whole prompt, or None if they match."""
    at = list(range(got.numel())) if positions is None else list(positions)
    if expected is None:
        return "the producer sent no KV digests (its kv_digest is \"off\")"
    last = first + (max(at) if at else -1)
    if expected.dtype != torch.int64 or expected.dim() != 1 or expected.numel() <= last:
        return f"the producer's KV digests do not cover blocks {first}-{last} ({expected.numel()} digests)"
    bad = (expected[[first + p for p in at]] != got).nonzero().flatten()
    if bad.numel():
        return (f"{bad.numel()} of {got.numel()} loaded blocks differ from what the producer saved (first: block "
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
