"""The one interface the worker drives; ``worker.pull.PullTransfer`` and ``worker.push.PushTransfer`` implement it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kv_connector.metadata import LeaseRelease, LoadRequest, LookupRequest, MooncakeConnectorMetadata, SaveRequest
from kv_connector.source import LoadSource


class KVMiss(Exception):
    """The producer holds no KV for this prompt (nothing was prefilled there for it, or it expired)."""


@dataclass
class LoadResult:
    """A finished load: the first ``written`` blocks of the request are in the KV cache (the rest, if any, will be
    recomputed)."""

    written: int
    loaded_bytes: int  # written into the KV cache
    fetched_bytes: int  # received over the wire for this load (0 when it was pushed beforehand)
    source: str  # "pulled" or "pushed"
    detail: str  # timings, for the log line


Rows = list[tuple[int, list[int], torch.Tensor]]  # (layer, block ids, their rows): a pushed entry's writes


@dataclass
class Tampered:
    """What a ``LoadTamper`` made of a load: the rows to write (``[blocks, layers, *block]``) and their block ids,
    whether to write them at all, and whether the digest check applies."""

    kv: torch.Tensor
    ids: list[int]
    write: bool = True
    check: bool = True


class LoadTamper(Protocol):
    """A test harness's hand in the consumer's loads (harness/tamper.py sets ``PullTransfer.tamper``; None in
    service): it changes what arrived before it reaches the KV cache, to prove that the KV is used and that the digest
    check catches what it must. Each method answers None to leave a load alone."""

    def pulled(self, req: LoadRequest, kv: torch.Tensor, ids: list[int], in_place: bool, whole: bool,
               gather: Callable[[], torch.Tensor]) -> Tampered | None:
        """A pulled load's rows ``kv`` for blocks ``ids`` (``in_place``: received into the blocks already, ``gather``
        reads them back; ``whole``: every head of each block)."""

    def pushed(self, req: LoadRequest, rows: Rows) -> tuple[Rows, bool] | None:
        """A pushed entry's writes into the cache, and whether the digest check applies."""

    def expected(self, req: LoadRequest, sums: torch.Tensor, positions: list[int],
                 landed: Callable[[tuple[int, int] | None], torch.Tensor]) -> torch.Tensor:
        """The producer's digests ``sums`` a load is checked against (``landed``: the loaded blocks' own digests)."""


class KVTransfer(ABC):
    """Moves prompts' KV from the producer's cache to the consumer's. Producer methods run in vLLM's forward pass and
    must not block it; ``load`` runs in a loader thread, several at once."""

    def begin_step(self, meta: MooncakeConnectorMetadata) -> None:  # noqa: B027 - optional hook
        """Producer: a step starts (before its first layer is saved)."""

    def abandon(self, req_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Producer: these requests ended before their prompt was complete; forget what is kept for them."""

    def save_layer(self, layer: int, meta: MooncakeConnectorMetadata) -> None:  # noqa: B027 - optional hook
        """Producer: ``layer``'s attention has written this step's KV."""

    @abstractmethod
    def finish_prompt(self, save: SaveRequest) -> None:
        """Producer: the prompt of ``save`` is complete in the cache (all layers of its last step are written)."""

    @abstractmethod
    def lookup(self, req: LookupRequest, deadline: float) -> int:
        """Consumer: how many of ``req``'s prompt tokens the producers this rank would load from hold for it (held
        for ``req.lease``); raises if that cannot be told by ``deadline`` (``time.monotonic()``)."""

    @abstractmethod
    def release(self, release: LeaseRelease) -> None:
        """Consumer: tell the producers this rank would load from that ``release.lease`` will not be used."""

    @abstractmethod
    def producers(self, source: LoadSource) -> list[str]:
        """Consumer: the producer addresses this rank reads from for a load from ``source``."""

    @abstractmethod
    def load(self, req: LoadRequest, deadline: float) -> LoadResult:
        """Consumer: write the producer's KV for ``req``'s blocks; raise ``KVMiss`` if there is none, any other
        exception if it failed. ``deadline``: ``time.monotonic()`` value by which to give up."""

    @abstractmethod
    def close(self) -> None:
        """Stop threads and release links. Idempotent."""
