"""An index from token sequences to buffer entries whose lookups do not scan the entries.

Each entry is indexed under a polynomial hash of every prefix of its (roi-masked) tokens. A query hashes its own
prefixes once, then needs only dictionary look-ups: O(query length + distinct entry lengths), whatever the
number of entries. Hash hits are confirmed by comparing the tokens, so a collision can never return a wrong entry.
The index costs one dictionary slot per held token; the KV those tokens stand for is thousands of times larger.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")
_BASE = 0x100000001B3  # odd, so invertible modulo 2**64
_INV = pow(_BASE, -1, 1 << 64)
_SEED = np.uint64(0xCBF29CE484222325)  # the empty sequence's hash: keeps [x] and [-1, x] apart
_powers = (np.ones(1, dtype=np.uint64), np.ones(1, dtype=np.uint64))  # BASE**i and BASE**-i, grown on demand


def _powers_for(n: int) -> tuple[np.ndarray, np.ndarray]:
    global _powers
    if len(_powers[0]) < n:
        size = max(n, 2 * len(_powers[0]))
        with np.errstate(over="ignore"):
            _powers = tuple(np.concatenate((np.ones(1, dtype=np.uint64), np.cumprod(np.full(size - 1, b, dtype=np.uint64))))
                            for b in (_BASE, _INV))
    return _powers


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """h[i] is the hash of tokens[:i + 1]: SEED * BASE**(i + 1) + sum over j <= i of (tokens[j] + 1) * BASE**(i - j),
    modulo 2**64 (the polynomial form of h = h * BASE + token + 1, starting from SEED).

    Vectorised: the sum is BASE**i * cumsum((tokens[j] + 1) * BASE**-j); numpy's uint64 arithmetic wraps modulo 2**64.
    """
    n = len(tokens)
    if not n:
        return []
    up, down = _powers_for(n + 1)
    try:
        t = np.asarray(tokens, dtype=np.int64).view(np.uint64)
    except OverflowError:  # ids beyond int64 (not from a tensor): their low 64 bits
        t = np.asarray([x & 0xFFFFFFFFFFFFFFFF for x in tokens], dtype=np.uint64)
    t = t + np.uint64(1)
    with np.errstate(over="ignore"):
        return (np.cumsum(t * down[:n]) * up[:n] + _SEED * up[1:n + 1]).tolist()


@dataclass
class _Item(Generic[T]):
    tokens: tuple[int, ...]
    hashes: list[int]
    value: T


@dataclass
class TokenIndex(Generic[T]):
    """Entries keyed by token sequences; ``find`` returns the id of the best match for a query."""

    _items: dict[int, _Item[T]] = field(default_factory=dict)  # by insertion id: oldest first
    _full: dict[tuple[int, int], dict[int, None]] = field(default_factory=dict)  # (length, hash) -> ids
    # hash of a proper prefix -> the id of the one entry holding it, or the ids (oldest first) when several do
    _prefix: dict[int, int | dict[int, None]] = field(default_factory=dict)
    _lengths: Counter[int] = field(default_factory=Counter)  # entry length -> how many entries
    _next_id: int = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, tokens: Sequence[int], value: T, hashes: list[int] | None = None) -> int:
        """Index ``value`` under ``tokens``; ``hashes`` (``prefix_hashes(tokens)``) may be computed beforehand,
        e.g. outside a lock."""
        tokens = tuple(tokens)
        item = _Item(tokens, prefix_hashes(tokens) if hashes is None else hashes, value)
        ident = self._next_id
        self._next_id += 1
        self._items[ident] = item
        n = len(tokens)
        self._full.setdefault((n, item.hashes[-1] if n else 0), {})[ident] = None
        keys = set(item.hashes[:-1])
        shared = keys & self._prefix.keys()  # prefixes other entries hold too (a shared system prompt, say)
        for h in shared:
            ids = self._prefix[h]
            if isinstance(ids, int):
                self._prefix[h] = {ids: None, ident: None}
            else:
                ids[ident] = None
        self._prefix.update(dict.fromkeys(keys - shared if shared else keys, ident))  # the rest in one C-level call
        self._lengths[n] += 1
        return ident

    def remove(self, ident: int) -> T:
        item = self._items.pop(ident)
        n = len(item.tokens)
        _discard(self._full, (n, item.hashes[-1] if n else 0), ident)
        keys = list(set(item.hashes[:-1]))
        if list(map(self._prefix.get, keys)).count(ident) == len(keys):  # no prefix shared: drop them in C
            deque(map(self._prefix.pop, keys), maxlen=0)
        else:
            for h in keys:
                ids = self._prefix[h]
                if isinstance(ids, int):
                    del self._prefix[h]
                else:
                    ids.pop(ident, None)
                    if not ids:
                        del self._prefix[h]
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        return item.value

    def peek(self, ident: int) -> T:
        """The value indexed under ``ident`` (left in the index)."""
        return self._items[ident].value

    def values(self) -> list[T]:
        return [item.value for item in self._items.values()]

    def find(self, query: Sequence[int] | None, hashes: list[int] | None = None,
             accept: Callable[[T], bool] | None = None) -> int | None:
        """The id of the best match, or None (``hashes``: ``prefix_hashes(query)`` if computed beforehand;
        ``accept``: only entries whose value it accepts take part).

        ``None`` matches the oldest entry. Otherwise, in this order: an entry with exactly these tokens; the longest
        entry whose tokens are a prefix of the query; the oldest entry that the query is a prefix of.
        Among equals, the oldest wins.
        """
        def ok(ident: int) -> bool:
            return accept is None or accept(self._items[ident].value)

        if query is None:
            return next((ident for ident in self._items if ok(ident)), None)
        query = tuple(query)
        m = len(query)
        if hashes is None:
            hashes = prefix_hashes(query)
        for length in sorted((n for n in self._lengths if n <= m), reverse=True):
            key = (length, hashes[length - 1] if length else 0)
            for ident in self._full.get(key, ()):
                if self._items[ident].tokens == query[:length] and ok(ident):
                    return ident
        if m:
            ids = self._prefix.get(hashes[-1], ())
            for ident in (ids,) if isinstance(ids, int) else ids:
                if len(self._items[ident].tokens) > m and self._items[ident].tokens[:m] == query and ok(ident):
                    return ident
        return None

    def tokens(self, ident: int) -> tuple[int, ...]:
        """The tokens ``ident`` is indexed under."""
        return self._items[ident].tokens


def _discard(index: dict[tuple[int, int], dict[int, None]], key: tuple[int, int], ident: int) -> None:
    ids = index.get(key)
    if ids is not None:
        ids.pop(ident, None)
        if not ids:
            del index[key]
