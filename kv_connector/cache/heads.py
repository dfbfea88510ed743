"""Which KV heads each tensor-parallel rank holds, and where a consumer rank reads its heads from when the two
instances run different TP sizes. Plain arithmetic (no torch, no vLLM), shared by the producer and the consumer.

vLLM splits a model's KV heads evenly over the TP ranks; with fewer KV heads than ranks each rank holds one head and
several ranks hold the same one. An MLA model caches one latent per token, the same on every rank (``replicated``).
In pull mode only the first rank holding a given span of heads (its first replica) saves it, and every consumer rank
reads each span from that rank: replicated KV (MLA) is saved once per request, not once per rank. (Push mode pushes
rank to rank.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


def rank_heads(total: int, tp: int, rank: int, replicated: bool = False) -> tuple[int, int]:
    """The span [start, stop) of the model's KV heads that ``rank`` of ``tp`` holds."""
    if not 0 <= rank < tp or total < 1:
        raise ValueError(f"rank {rank} of TP {tp} with {total} KV heads")
    if replicated:
        return 0, total
    if total >= tp:
        if total % tp:
            raise ValueError(f"{total} KV heads do not split over TP {tp}")
        per = total // tp
        return rank * per, (rank + 1) * per
    if tp % total:
        raise ValueError(f"TP {tp} is not a multiple of the {total} KV heads")
    head = rank * total // tp
    return head, head + 1


def first_replica(total: int, tp: int, rank: int, replicated: bool = False) -> bool:
    """Whether ``rank`` is the lowest rank holding its span of heads (the one that saves it)."""
    rank_heads(total, tp, rank, replicated)  # validates
    if replicated:
        return rank == 0
    return total >= tp or rank % (tp // total) == 0


@dataclass(frozen=True)
class Piece:
    """One part of a consumer rank's load: heads ``part`` (indices within the producer rank's blocks) of producer rank
    ``producer``, written from head ``at`` of this rank's blocks on. ``shares``: how many consumer ranks read a part
    of that producer rank's entry (it is kept until each of them took its part)."""

    producer: int
    part: tuple[int, int]
    at: int
    shares: int
    whole: bool  # the part is all the producer's heads and all of ours: a plain block copy


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@lru_cache(maxsize=256)
def _plan(total: int, producer_tp: int, consumer_tp: int, rank: int, replicated: bool) -> tuple[Piece, ...]:
    return tuple(plan(total, producer_tp, consumer_tp, rank, replicated))


def plan(total: int, producer_tp: int, consumer_tp: int, rank: int, replicated: bool = False) -> list[Piece]:
    """What consumer ``rank`` (of ``consumer_tp``) reads from which producer rank (of ``producer_tp``)."""
    mine = rank_heads(total, consumer_tp, rank, replicated)
    pieces = []
    for p in range(producer_tp):
        if not first_replica(total, producer_tp, p, replicated):
            continue
        theirs = rank_heads(total, producer_tp, p, replicated)
        common = _overlap(theirs, mine)
        if common is None:
            continue
        readers = sum(1 for c in range(consumer_tp)
                      if _overlap(theirs, rank_heads(total, consumer_tp, c, replicated)) is not None)
        pieces.append(Piece(p, (common[0] - theirs[0], common[1] - theirs[0]), common[0] - mine[0], readers,
                            common == theirs == mine))
    return pieces


@dataclass(frozen=True)
class HeadSplit:
    """This worker's place in the split: the model's KV heads (``total``; 1 for MLA's latent), its TP size and rank."""

    total: int
    tp: int
    rank: int
    replicated: bool = False

    @property
    def span(self) -> tuple[int, int]:
        return rank_heads(self.total, self.tp, self.rank, self.replicated)

    @property
    def saves(self) -> bool:
        """Producer: whether this rank saves its KV (the first replica of its heads does)."""
        return first_replica(self.total, self.tp, self.rank, self.replicated)

    def plan(self, producer_tp: int) -> list[Piece]:
        """Consumer: what this rank reads from a producer running TP ``producer_tp``."""
        return list(_plan(self.total, producer_tp, self.tp, self.rank, self.replicated))

    def producer_span(self, producer_tp: int, producer_rank: int) -> tuple[int, int]:
        return rank_heads(self.total, producer_tp, producer_rank, self.replicated)
