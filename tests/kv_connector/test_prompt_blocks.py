"""The block arithmetic of loads and pushes: a load writes exactly the blocks the consumer lacks, a push sends a block
once it is complete, and only blocks whose tokens agree with the prompt are used."""

from __future__ import annotations

import itertools

import pytest

from kv_connector import prompt_blocks as blocks


@pytest.mark.parametrize("tokens, size, n", [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (1000, 128, 8)])
def test_num_blocks_counts_a_partial_last_block(tokens, size, n):
    assert blocks.num_blocks(tokens, size) == n


def test_a_load_spans_exactly_the_blocks_the_consumer_lacks():
    """Every combination of prompt length, block-aligned prefix hit, recompute tail and block size: the load starts at
    the first block not cached here and ends with the block holding the last claimed token."""
    for size, prompt_len, recompute in itertools.product((1, 4, 16), range(0, 70), (1, 2, 5)):
        for local in range(0, prompt_len + 1, size):
            claimed = blocks.claim_tokens(prompt_len, local, recompute)
            if claimed <= 0:
                assert local + recompute >= prompt_len
                continue
            first, end = blocks.load_span(local, claimed, size)
            assert first * size == local  # nothing cached is loaded again
            assert (end - 1) * size < local + claimed <= end * size  # the last block holds the last claimed token
            assert local + claimed == prompt_len - recompute  # the tail is computed here, not loaded
            assert end <= blocks.num_blocks(prompt_len, size)


def test_recompute_is_at_least_one_token():
    assert blocks.claim_tokens(10, 0, 0) == blocks.claim_tokens(10, 0, 1) == 9
    assert blocks.claim_tokens(10, 0, -3) == 9


@pytest.mark.parametrize("computed, prompt_len, n", [
    (0, 40, 0), (15, 40, 0), (16, 40, 1), (39, 40, 2), (40, 40, 3), (64, 40, 3), (32, 32, 2),
])
def test_a_push_sends_a_block_once_complete_and_the_partial_last_one_at_the_end(computed, prompt_len, n):
    assert blocks.complete_blocks(computed, prompt_len, 16) == n


def test_pushes_over_a_chunked_prefill_cover_every_block_once():
    for prompt_len, chunk in itertools.product(range(1, 80), (1, 7, 16, 33)):
        sent, computed = 0, 0
        while computed < prompt_len:
            computed = min(computed + chunk, prompt_len)
            upto = blocks.complete_blocks(computed, prompt_len, 16)
            assert upto >= sent
            sent = upto
        assert sent == blocks.num_blocks(prompt_len, 16)


@pytest.mark.parametrize("first, wanted, claimed, agree, received, usable", [
    (0, 3, 40, 41, 3, 3),  # the entry agrees beyond the claim: every block
    (0, 3, 40, 40, 3, 3),  # up to its end exactly
    (0, 3, 40, 39, 3, 2),  # not to the end: the wholly agreeing blocks only
    (0, 3, 40, 16, 3, 1),
    (0, 3, 40, 15, 3, 0),  # not even the first block: nothing (a miss)
    (2, 2, 30, 62, 2, 2),  # loaded from block 2 (prefix hit of 32): agreement in tokens of the whole prompt
    (2, 2, 30, 61, 2, 1),
    (2, 2, 30, 31, 2, 0),  # disagrees inside the cached blocks: nothing past them is usable
    (0, 3, 40, 41, 2, 2),  # the entry was shorter than wanted: only what came
    (0, 3, 40, 41, 0, 0),
])
def test_only_received_blocks_whose_tokens_agree_are_used(first, wanted, claimed, agree, received, usable):
    assert blocks.usable_blocks(first, wanted, claimed, agree, received, 16) == usable


@pytest.mark.parametrize("piece_first, piece_len, first, end, shared", [
    (0, 4, 0, 4, (0, 4)), (0, 4, 2, 4, (2, 4)), (2, 4, 0, 3, (2, 3)), (0, 2, 2, 4, None), (4, 2, 0, 4, None),
    (0, 0, 0, 4, None),
])
def test_a_pushed_piece_is_written_where_it_meets_the_loaded_blocks(piece_first, piece_len, first, end, shared):
    assert blocks.overlap(piece_first, piece_len, first, end) == shared
