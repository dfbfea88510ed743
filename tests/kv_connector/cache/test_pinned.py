"""PinnedArena: memory taken once, handed out in pieces that go back when the last tensor viewing them is gone, and
not before the copy recorded on them ended. (Here on plain host memory; on a GPU machine ``pinned=True``, the same
bookkeeping: ``scripts/gpu_check.sh``.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_connector.cache.pinned import ALIGN, ArenaFull, PinnedArena


class Copy:
    """Stands in for a CUDA event of a copy into or out of a piece (the arena only asks ``query``)."""

    def __init__(self) -> None:
        self.ended = False

    def query(self) -> bool:
        return self.ended


def test_pieces_are_disjoint_aligned_and_come_back_when_their_last_view_is_gone():
    arena = PinnedArena(8 * ALIGN, pinned=False)
    a, b = arena.take(100), arena.take(ALIGN + 1)
    assert a.tensor.numel() == ALIGN and b.tensor.numel() == 2 * ALIGN
    assert b.tensor.data_ptr() - a.tensor.data_ptr() == ALIGN
    a.view([5, 5], torch.float32).fill_(1.0)
    b.tensor.fill_(2)
    assert a.tensor[:100].view(torch.float32).eq(1.0).all() and b.tensor.eq(2).all()
    rows = b.view([4, 8], torch.int64)[1:3]  # a view of a view keeps the piece
    del b
    assert arena.stats()["used"] == 3 * ALIGN
    del rows
    assert arena.stats()["used"] == ALIGN
    del a
    assert arena.stats() == {"capacity": 8 * ALIGN, "used": 0, "pending": 0, "largest_free": 8 * ALIGN}


def test_freed_ranges_merge_so_a_large_piece_fits_again():
    arena = PinnedArena(4 * ALIGN, pinned=False)
    pieces = [arena.take(ALIGN) for _ in range(4)]
    with pytest.raises(ArenaFull, match="no room for 1 bytes"):
        arena.take(1)
    first, second, third, _fourth = pieces
    del pieces
    del third, first, second  # out of order: the merges join each side
    assert arena.stats()["largest_free"] == 3 * ALIGN
    whole = arena.take(3 * ALIGN)
    assert whole.tensor.numel() == 3 * ALIGN


def test_a_piece_whose_copy_still_runs_is_not_handed_out_again():
    arena = PinnedArena(ALIGN, pinned=False)
    piece = arena.take(ALIGN)
    copy = Copy()
    piece.after(copy)
    del piece  # nobody holds it, but the copy may still write into it
    assert arena.stats()["pending"] == 1
    with pytest.raises(ArenaFull):
        arena.take(1)
    copy.ended = True
    assert arena.take(ALIGN).tensor.numel() == ALIGN


def test_take_waits_for_room_up_to_its_timeout():
    arena = PinnedArena(ALIGN, pinned=False)
    held = [arena.take(ALIGN)]
    threading.Timer(0.1, held.clear).start()
    start = time.monotonic()
    again = arena.take(ALIGN, timeout=5.0)
    assert again.tensor.numel() == ALIGN
    assert 0.05 < time.monotonic() - start < 2.0
    with pytest.raises(ArenaFull):
        arena.take(1, timeout=0.1)
    with pytest.raises(ArenaFull, match="larger than the whole pinned arena"):
        arena.take(2 * ALIGN, timeout=5.0)  # never fits: at once


def test_pieces_taken_in_inference_mode_are_written_outside_it():
    """The forward pass runs in inference mode; the threads that fill or read pieces do not."""
    arena = PinnedArena(ALIGN, pinned=False)
    with torch.inference_mode():
        piece = arena.take(64)
    assert not piece.tensor.is_inference()
    piece.view([8], torch.int64).add_(1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")
def test_a_real_pinned_piece_is_copied_into_without_a_wait_and_kept_until_its_copy_ended():
    arena = PinnedArena(64 << 20)
    piece = arena.take(32 << 20)
    assert piece.tensor.is_pinned()  # a part of one cudaHostAlloc: CUDA copies it without staging
    src = torch.full((32 << 20,), 5, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # the copy runs a while after it was queued
        piece.tensor.copy_(src, non_blocking=True)
        done = torch.cuda.Event(blocking=True)
        done.record(stream)
    piece.after(done)
    view = piece.tensor
    del piece, view
    if not done.query():
        assert arena.stats()["pending"] == 1
        with pytest.raises(ArenaFull):
            arena.take(64 << 20)
    done.synchronize()
    assert arena.take(64 << 20).tensor.numel() == 64 << 20
