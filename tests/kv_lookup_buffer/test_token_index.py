"""TokenIndex: prefix matching by hashed prefixes, confirmed by the tokens themselves."""

from __future__ import annotations

import random

import pytest

from kv_lookup_buffer import token_index
from kv_lookup_buffer.token_index import TokenIndex

pytestmark = pytest.mark.pipes


def test_match_order_exact_then_longest_prefix_then_extension():
    idx: TokenIndex[str] = TokenIndex()
    idx.add([1, 2], "ab")
    idx.add([1, 2, 3], "abc")
    idx.add([1, 2, 3, 4, 5], "abcde")
    assert idx.values() == ["ab", "abc", "abcde"]
    assert idx.remove(idx.find([1, 2, 3])) == "abc"  # exact
    assert idx.remove(idx.find([1, 2, 3, 9])) == "ab"  # longest entry that prefixes the query
    assert idx.remove(idx.find([1, 2, 3])) == "abcde"  # the query prefixes the entry
    assert idx.find([1]) is None and len(idx) == 0


def test_oldest_wins_among_equals_and_none_takes_the_oldest():
    idx: TokenIndex[int] = TokenIndex()
    for i in range(3):
        idx.add([7, 7], i)
    assert idx.remove(idx.find([7, 7])) == 0
    assert idx.remove(idx.find(None)) == 1
    assert idx.remove(idx.find([7])) == 2
    assert idx.find(None) is None


def test_hash_collisions_never_return_a_wrong_entry(monkeypatch):
    monkeypatch.setattr(token_index, "prefix_hashes", lambda tokens: [0] * len(tokens))  # everything collides
    idx: TokenIndex[str] = TokenIndex()
    idx.add([1, 2, 3], "x")
    idx.add([4, 5, 6], "y")
    assert idx.find([4, 5, 6]) is not None and idx.remove(idx.find([4, 5, 6])) == "y"
    assert idx.find([9, 9, 9]) is None and idx.find([1, 2, 4]) is None


def test_against_a_brute_force_scan():
    rng = random.Random(3)
    idx: TokenIndex[int] = TokenIndex()
    held: dict[int, tuple[int, ...]] = {}
    for step in range(3000):
        tokens = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 6)))
        if rng.random() < 0.5:
            held[idx.add(tokens, step)] = tokens
            continue
        found = idx.find(tokens)
        exact = [i for i, t in held.items() if t == tokens]
        prefixes = [i for i, t in held.items() if len(t) < len(tokens) and tokens[:len(t)] == t]
        longer = [i for i, t in held.items() if len(t) > len(tokens) and t[:len(tokens)] == tokens and tokens]
        if exact:
            assert found == min(exact)
        elif prefixes:
            best = max(len(held[i]) for i in prefixes)
            assert found == min(i for i in prefixes if len(held[i]) == best)
        elif longer:
            assert found == min(longer)
        else:
            assert found is None
        if found is not None:
            idx.remove(found)
            del held[found]
    assert len(idx) == len(held)


def test_prefix_hashes_match_their_recurrence():
    """The vectorised hash equals h = h * BASE + token + 1 (mod 2**64) from SEED, at every prefix and any length
    (including lengths that grow the cached power tables, negative ids and ids beyond int64)."""
    mask = (1 << 64) - 1

    def recurrence(tokens: list[int]) -> list[int]:
        h, out = int(token_index._SEED), []
        for t in tokens:
            h = (h * token_index._BASE + t + 1) & mask
            out.append(h)
        return out

    rng = random.Random(5)
    for n in (0, 1, 2, 3, 1000, 3000, 70_000):
        tokens = [rng.randint(-3, 1 << 40) for _ in range(n)]
        assert token_index.prefix_hashes(tokens) == recurrence(tokens)
    assert token_index.prefix_hashes([(1 << 64) - 1]) == token_index.prefix_hashes([-1])
    assert token_index.prefix_hashes([-1, 5])[-1] != token_index.prefix_hashes([5])[-1]
