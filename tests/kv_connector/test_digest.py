"""kv_connector/digest.py: a block's digest is the same whether hashed from the producer's gathered copy or where it
lies in a KV cache (every attention layout the connector moves), and any changed byte or misplaced block shows.
The end-to-end checks run in test_data_path.py (real processes and pipes) and test_load_failure_policy.py (vLLM)."""

from __future__ import annotations

import pytest
import torch

from kv_connector import block_copy, digest
from tests.kv_connector.worker_peers import LAYOUTS, caches


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_a_block_hashes_alike_gathered_or_in_place(layout_name):
    layout = LAYOUTS[layout_name]
    cache = list(caches(layout, 1, 0, 3, "cpu").values())
    ids = [5, 2, 9]
    gathered = digest.block_digests(block_copy.gather(cache, layout.block_dim, ids))
    assert torch.equal(gathered, digest.cache_digests(cache, layout.block_dim, ids))
    assert len(set(gathered.tolist())) == 3
    assert digest.compare(gathered, digest.cache_digests(cache, layout.block_dim, [5, 2, 9]), 0) is None
    assert "2 of 3 loaded blocks differ" in digest.compare(gathered, digest.cache_digests(cache, layout.block_dim,
                                                                                          [5, 9, 2]), 0)
    part = cache[-1].select(layout.block_dim, 2).view(torch.uint8)  # one byte of block 2, last layer
    part[(0,) * (part.dim() - 1) + (7,)] ^= 1
    changed = digest.cache_digests(cache, layout.block_dim, ids)
    assert (changed != gathered).tolist() == [False, True, False]


def test_the_sampler_picks_one_load_in_n():
    sampled = digest.Sampler("sampled", 4)
    assert [sampled.due() for _ in range(8)] == [True, False, False, False] * 2
    assert not digest.Sampler("off", 1).due() and digest.Sampler("always", 99).due()
    assert "sent no KV digests" in digest.compare(None, torch.zeros(2, dtype=torch.int64), 0)
    assert "do not cover" in digest.compare(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 2)


def test_positions_compare_only_the_blocks_named():
    expected = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64)
    assert digest.compare(expected, torch.tensor([3, 5]), 1, [1, 3]) is None  # prompt blocks 2 and 4
    assert "first: block 4 of the prompt" in digest.compare(expected, torch.tensor([3, 9]), 1, [1, 3])
    assert "do not cover" in digest.compare(expected, torch.tensor([3]), 1, [4])


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_blocks_hashed_a_layer_at_a_time_as_a_push_sends_them_hash_as_gathered(layout_name):
    """``BlockHasher``, fed each layer's rows of some blocks at a time (a push's pieces, prefilled in chunks): the
    same digests as the whole blocks gathered."""
    layout = LAYOUTS[layout_name]
    cache = list(caches(layout, 1, 0, 3, "cpu").values())
    ids = [5, 2, 9, 4]
    hasher = digest.BlockHasher(len(ids))
    for first, upto in ((0, 1), (1, 4)):  # two steps: block 0, then blocks 1-3, every layer in each
        for layer in range(len(cache)):
            piece = block_copy.gather([cache[layer]], layout.block_dim, ids[first:upto])  # [n, 1, *block]
            hasher.update(first, piece[:, 0])
    assert torch.equal(hasher.digests(), digest.block_digests(block_copy.gather(cache, layout.block_dim, ids)))


def test_a_seal_under_the_secret_binds_the_digests_to_their_entry():
    """With a secret the digests carry an HMAC of the entry's key and themselves: changed digests, another entry's key
    or another secret do not verify; digests without a seal are refused; without a secret nothing is sealed."""
    secret, key = b"s" * 32, bytes(range(32))
    sums = torch.tensor([1, -2, 3], dtype=torch.int64)
    sealed = digest.seal(sums, key, secret)
    assert sealed.numel() == digest.sealed_size(3, secret) == 3 + digest.SEAL_WORDS
    assert torch.equal(digest.unseal(sealed, key, secret), sums)
    forged = sealed.clone()
    forged[1] = 7
    for tensor, k, s, why in [(forged, key, secret, "does not verify"), (sealed, bytes(32), secret, "does not verify"),
                              (sealed, key, b"t" * 32, "does not verify"), (sums[:2], key, secret, "no seal"),
                              (sealed.to(torch.int32), key, secret, "no seal")]:
        with pytest.raises(digest.DigestMismatch, match=why):
            digest.unseal(tensor, k, s)
    assert digest.seal(sums, key, b"") is sums and digest.unseal(sums, key, b"") is sums
    assert digest.sealed_size(3, b"") == 3
