"""Scatter targets: a received tensor's bytes laid into several host memory regions in order (say, the KV cache blocks
a request loads into) instead of into one tensor, so that the bytes land where they are used, without a copy."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Region = tuple[int, int]  # (address, nbytes)


@dataclass(frozen=True)
class Scatter:
    """Regions filled in order by one tensor's bytes. ``owners``: the tensors the regions lie in (kept alive by the
    target while it is used). Adjacent regions are merged."""

    regions: tuple[Region, ...]
    owners: tuple[torch.Tensor, ...] = ()

    @classmethod
    def of(cls, regions: Sequence[Region], owners: Sequence[torch.Tensor] = ()) -> Scatter:
        merged: list[list[int]] = []
        for addr, n in regions:
            if n <= 0 or addr <= 0:
                raise ValueError(f"a scatter region needs an address and a positive size, got ({addr:#x}, {n})")
            if merged and merged[-1][0] + merged[-1][1] == addr:
                merged[-1][1] += n
            else:
                merged.append([addr, n])
        return cls(tuple((a, n) for a, n in merged), tuple(owners))

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.regions)

    def prefix(self, nbytes: int) -> tuple[Region, ...] | None:
        """The regions holding the first ``nbytes`` bytes, if those end exactly at a region's end; else None."""
        total = 0
        for i, (_, n) in enumerate(self.regions):
            total += n
            if total == nbytes:
                return self.regions[:i + 1]
            if total > nbytes:
                return None
        return None

    def copy_in(self, pos: int, src: torch.Tensor) -> None:
        """Copy the contiguous host bytes ``src`` into tensor bytes [pos, pos + len(src)) of the regions."""
        base = src.data_ptr()
        done = 0
        for addr, n in split(self.regions, pos, src.numel()):
            ctypes.memmove(addr, base + done, n)
            done += n


def split(regions: Sequence[Region], pos: int, length: int) -> list[Region]:
    """The parts of ``regions`` (filled in order) that hold tensor bytes [pos, pos + length)."""
    out: list[Region] = []
    start = 0
    end = pos + length
    for addr, n in regions:
        lo, hi = max(pos, start), min(end, start + n)
        if lo < hi:
            out.append((addr + lo - start, hi - lo))
        start += n
        if start >= end:
            break
    if sum(n for _, n in out) != length:
        raise ValueError(f"bytes [{pos}, {end}) lie outside regions of {start} bytes")
    return out


def within(regions: Sequence[Region], registered: Sequence[Region]) -> bool:
    """Whether every region lies inside one of ``registered``."""
    return all(any(r_addr <= addr and addr + n <= r_addr + r_n for r_addr, r_n in registered) for addr, n in regions)
