"""The TP head arithmetic (kv_connector/cache/heads.py): which heads each rank holds, who saves, and what a consumer rank
reads from which producer rank, for equal and different TP sizes, GQA and MLA."""

from __future__ import annotations

import pytest

from kv_connector.cache.heads import HeadSplit, Piece, first_replica, plan, rank_heads


def test_heads_split_evenly_or_replicated():
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # fewer heads than ranks
    assert [rank_heads(1, 2, r, replicated=True) for r in range(2)] == [(0, 1), (0, 1)]  # MLA's latent
    assert [first_replica(2, 4, r) for r in range(4)] == [True, False, True, False]
    assert [first_replica(1, 2, r, replicated=True) for r in range(2)] == [True, False]
    for bad in ((6, 4, 0), (2, 3, 0), (2, 2, 2)):
        with pytest.raises(ValueError):
            rank_heads(*bad)


def test_equal_tp_reads_the_same_rank_whole():
    assert [plan(8, 2, 2, r) for r in range(2)] == [[Piece(0, (0, 4), 0, 1, True)], [Piece(1, (0, 4), 0, 1, True)]]
    assert plan(2, 1, 1, 0) == [Piece(0, (0, 2), 0, 1, True)]


def test_producer_tp2_to_consumer_tp1_reads_half_of_each_block_from_each_rank():
    assert plan(8, 2, 1, 0) == [Piece(0, (0, 4), 0, 1, False), Piece(1, (0, 4), 4, 1, False)]


def test_producer_tp1_to_consumer_tp2_shares_one_entry():
    assert [plan(8, 1, 2, r) for r in range(2)] == [[Piece(0, (0, 4), 0, 2, False)], [Piece(0, (4, 8), 0, 2, False)]]


def test_mla_is_saved_once_and_read_whole_by_every_rank():
    for producer_tp in (1, 2):
        for consumer_tp in (1, 2):
            for r in range(consumer_tp):
                assert plan(1, producer_tp, consumer_tp, r, replicated=True) == [Piece(0, (0, 1), 0, consumer_tp, True)]
    assert [HeadSplit(1, 2, r, True).saves for r in range(2)] == [True, False]


def test_every_head_is_read_exactly_once_per_consumer_rank():
    for total in (1, 2, 4, 8):
        for ptp in (1, 2, 4, 8):
            for ctp in (1, 2, 4, 8):
                if (total % ptp and ptp % total) or (total % ctp and ctp % total):
                    continue
                for r in range(ctp):
                    mine = rank_heads(total, ctp, r)
                    got = sorted((p.at, p.at + p.part[1] - p.part[0]) for p in plan(total, ptp, ctp, r))
                    covered = [h for lo, hi in got for h in range(lo, hi)]
                    assert covered == list(range(mine[1] - mine[0])), (total, ptp, ctp, r, got)
