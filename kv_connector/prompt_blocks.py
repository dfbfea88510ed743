"""Block arithmetic of the transfers, in tokens and prompt block indices (pure functions, unit tested).

A consumer loads prompt blocks ``[first, end)``: those before ``first`` are in its own prefix cache, and it computes
the prompt's last ``recompute`` tokens itself. A producer pushes a block once every token of it is computed, and
every block (the partial last one too) once the whole prompt is.
"""

from __future__ import annotations


def num_blocks(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens (the last one may be partial)."""
    return -(-tokens // block_size)


def claim_tokens(prompt_len: int, local_hit: int, recompute: int) -> int:
    """Consumer: how many prompt tokens to load, given ``local_hit`` tokens (block aligned) already in its prefix
    cache and the last ``recompute`` tokens (at least 1) computed here; 0 or less: nothing to load."""
    return prompt_len - max(recompute, 1) - local_hit


def load_span(local_hit: int, claimed: int, block_size: int) -> tuple[int, int]:
    """Consumer: the prompt blocks ``[first, end)`` a load of ``claimed`` tokens after ``local_hit`` writes."""
    return local_hit // block_size, num_blocks(local_hit + claimed, block_size)


def complete_blocks(computed: int, prompt_len: int, block_size: int) -> int:
    """Producer: how many of the prompt's blocks are complete once its tokens up to ``computed`` are computed."""
    return num_blocks(prompt_len, block_size) if computed >= prompt_len else computed // block_size


def usable_blocks(first: int, wanted: int, claimed: int, agree: int, received: int, block_size: int) -> int:
    """Consumer: how many of the ``received`` rows of a load of ``wanted`` blocks from block ``first`` hold this
    prompt's KV, when the producer's entry agrees with the prompt on its first ``agree`` tokens: all of them if the
    agreement reaches the end of the ``claimed`` tokens, else only the blocks lying wholly inside it."""
    end = first + wanted if agree >= first * block_size + claimed else agree // block_size
    return max(0, min(end - first, received))


def overlap(piece_first: int, piece_len: int, first: int, end: int) -> tuple[int, int] | None:
    """The blocks ``[lo, hi)`` that a piece of ``piece_len`` blocks from ``piece_first`` shares with ``[first, end)``;
    None if it shares none."""
    lo, hi = max(piece_first, first), min(piece_first + piece_len, end)
    return (lo, hi) if lo < hi else None
