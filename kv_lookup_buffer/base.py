"""The contract of a KV lookup buffer: the producer inserts KV by tokens, the consumer takes it out by tokens.

Same names as vLLM v0's ``kv_transfer.kv_lookup_buffer.base.KVLookupBufferBase``.
"""

from __future__ import annotations

import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


def entry_key(tokens: torch.Tensor | list[int]) -> bytes:
    """The key of an entry: SHA-256 of its tokens as little-endian int64."""
    t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1).contiguous()
    return hashlib.sha256(t.numpy().tobytes()).digest()


class BufferClosed(RuntimeError):
    """The buffer, or the other side of it, was closed."""


class BufferFull(ValueError):
    """An evicting buffer cannot take an entry: what it holds is held for consumers (leases), none may be evicted."""


class AnswerAbandoned(TimeoutError):
    """``drop_select`` gave up at its deadline while the answer was still being received: its bytes may go on
    landing in ``key_out`` until ``landed`` is set (the receive ended, and no write the producer started can land any
    more). Until then ``key_out`` must not be reused."""

    def __init__(self, message: str, landed: threading.Event) -> None:
        super().__init__(message)
        self.landed = landed


class Counts(dict[str, int]):
    """A buffer's counters (a dict, read as one); ``add`` also tells ``on_count(name, n)``, if set, as it happens, so
    that a caller records its own statistics where they happen instead of diffing these. ``on_count`` may be called
    under the buffer's lock: it must not call back into the buffer."""

    def __init__(self, names: tuple[str, ...], on_count: Callable[[str, int], None] | None = None) -> None:
        super().__init__(dict.fromkeys(names, 0))
        self.on_count = on_count

    def add(self, name: str, n: int = 1) -> None:
        self[name] += n
        if self.on_count is not None:
            self.on_count(name, n)


class KVLookupBufferBase(ABC):
    """A buffer shared by a producer process (``insert``) and a consumer process (``drop_select``)."""

    @abstractmethod
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor | None, key: torch.Tensor | None,
               value: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """Producer side: store an entry (a copy: the caller may reuse its tensors at once).

        ``roi`` is a boolean mask over ``input_tokens`` (None: all tokens) selecting the tokens the entry is
        keyed by. Blocks while the buffer is over its size threshold, until a ``drop_select`` frees room; raises
        ``TimeoutError`` if none does within the timeout, ``ValueError`` at once for an entry larger than the
        whole threshold.
        """

    @abstractmethod
    def drop_select(self, input_tokens: torch.Tensor | None,
                    roi: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Consumer side: ask the producer for an entry matching these tokens, and take it.

        Matches when one of the roi-masked token sequences is a prefix of the other. On a match the producer
        sends ``[input_tokens, roi, key, value, hidden]`` as inserted and forgets the entry; otherwise the
        result is five ``None``. ``drop_select(None, None)`` takes any entry (the oldest).
        """

    @abstractmethod
    def close(self) -> None:
        """Stop serving and tell the other side, which gets a clear error if it is blocked on us. Idempotent."""


class KVStoreBufferBase(ABC):
    """A buffer every instance writes and reads by key, with no peer to ask (vLLM v0's ``KVStoreBufferBase``:
    ``put`` / ``get``), batched: a prompt's blocks are one object each, asked for together. Keys address content (the
    same KV under the same key on any instance), so a put of a key that is there already is not needed, and any
    object may be gone (evicted, its holder dead) by the time it is asked for."""

    @abstractmethod
    def contains(self, keys: list[str], timeout: float) -> int:
        """How many of ``keys``, from the first, the store holds now."""

    @abstractmethod
    def put(self, keys: list[str], values: torch.Tensor, timeout: float) -> int:
        """Store ``values[i]`` under ``keys[i]``; how many were stored, from the first."""

    @abstractmethod
    def get_into(self, keys: list[str], out: torch.Tensor, timeout: float) -> int:
        """Write the objects of ``keys`` into ``out[i]``; how many, from the first, arrived whole and checked (the
        rows after them are undefined)."""

    @abstractmethod
    def close(self) -> None:
        """Leave the store (objects in this process's memory go with it). Idempotent."""
