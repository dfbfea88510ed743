"""An index from token sequences to buffer entries whose lookups do not scan the entries.

Each entry is indexed under a rolling hash of every prefix of its (roi-masked) tokens. A query hashes its own
prefixes once, then needs only dictionary look-ups: O(query length + distinct entry lengths), whatever the
number of entries. Hash hits are confirmed by comparing the tokens, so a collision can never return a wrong entry.
The index costs one dictionary slot per held token; the KV those tokens stand for is thousands of times larger.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # FNV-style odd multiplier


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """h[i] is the hash of tokens[:i + 1]."""
    out = []
    h = 0xCBF29CE484222325
    for t in tokens:
        h = ((h ^ (t & _MASK)) * _BASE + 1) & _MASK
        out.append(h)
    return out


@dataclass
class _Item(Generic[T]):
    tokens: tuple[int, ...]
    hashes: list[int]
    value: T


@dataclass
class TokenIndex(Generic[T]):
    """Entries keyed by token sequences; ``pop_match`` removes and returns the best match for a query."""

    _items: dict[int, _Item[T]] = field(default_factory=dict)  # by insertion id: oldest first
    _full: dict[tuple[int, int], dict[int, None]] = field(default_factory=dict)  # (length, hash) -> ids
    _prefix: dict[tuple[int, int], dict[int, None]] = field(default_factory=dict)  # (length, hash) -> ids
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
        for length, h in enumerate(item.hashes[:-1], start=1):
            self._prefix.setdefault((length, h), {})[ident] = None
        self._lengths[n] += 1
        return ident

    def remove(self, ident: int) -> T:
        item = self._items.pop(ident)
        n = len(item.tokens)
        _discard(self._full, (n, item.hashes[-1] if n else 0), ident)
        for length, h in enumerate(item.hashes[:-1], start=1):
            _discard(self._prefix, (length, h), ident)
        self._lengths[n] -= 1
        if not self._lengths[n]:
            del self._lengths[n]
        return item.value

    def values(self) -> list[T]:
        return [item.value for item in self._items.values()]

    def find(self, query: Sequence[int] | None, hashes: list[int] | None = None) -> int | None:
        """The id of the best match, or None (``hashes``: ``prefix_hashes(query)`` if computed beforehand).

        ``None`` matches the oldest entry. Otherwise, in this order: an entry with exactly these tokens; the longest
        entry whose tokens are a prefix of the query; the oldest entry that the query is a prefix of.
        Among equals, the oldest wins.
        """
        if query is None:
            return next(iter(self._items), None)
        query = tuple(query)
        m = len(query)
        if hashes is None:
            hashes = prefix_hashes(query)
        for length in sorted((n for n in self._lengths if n <= m), reverse=True):
            key = (length, hashes[length - 1] if length else 0)
            for ident in self._full.get(key, ()):
                if self._items[ident].tokens == query[:length]:
                    return ident
        if m:
            for ident in self._prefix.get((m, hashes[-1]), ()):
                if self._items[ident].tokens[:m] == query:
                    return ident
        return None


def _discard(index: dict[tuple[int, int], dict[int, None]], key: tuple[int, int], ident: int) -> None:
    ids = index.get(key)
    if ids is not None:
        ids.pop(ident, None)
        if not ids:
            del index[key]
