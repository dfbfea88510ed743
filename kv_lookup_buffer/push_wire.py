"""The wire protocol of the push channel (``push_sender`` / ``push_receiver``): its messages (HELLO, BEGIN, DATA,
COMMIT, PULL, ABORT, CREDIT), one dataclass each, built and parsed here only, and the counters both ends keep
(``push_stats``). Nothing on the wire is executed.

Message layout: docs/wire.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from kv_lookup_buffer.base import Counts

MAGIC, VERSION = 0x4D4B5642, 2  # "MKVB"; 2: COMMIT's hidden tensor
HELLO, BEGIN, DATA, COMMIT, PULL, ABORT, CREDIT = range(1, 8)
KIND_NAMES = {HELLO: "HELLO", BEGIN: "BEGIN", DATA: "DATA", COMMIT: "COMMIT", PULL: "PULL", ABORT: "ABORT",
              CREDIT: "CREDIT"}
HEADER_LEN = 11
NO_KEY = b"\0" * 32
_FIELDS = 4  # header words after the key


@dataclass(frozen=True)
class Hello:
    """A (re)started producer, identified by a random ``epoch``."""

    KIND: ClassVar[int] = HELLO
    epoch: int


@dataclass(frozen=True)
class Begin:
    """An entry of ``nbytes`` bytes, ``num_layers`` layers of ``num_blocks`` blocks, follows."""

    KIND: ClassVar[int] = BEGIN
    key: bytes
    nbytes: int
    num_layers: int
    num_blocks: int


@dataclass(frozen=True)
class Data:
    """``num_blocks`` blocks of ``layer`` from ``first_block`` on: the tensor that follows."""

    KIND: ClassVar[int] = DATA
    key: bytes
    layer: int
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class Commit:
    """The entry of ``num_tokens`` tokens is complete; its metadata tensor follows, then (``hidden`` 1) a second
    tensor the entry carries to whoever takes it."""

    KIND: ClassVar[int] = COMMIT
    key: bytes
    num_tokens: int
    hidden: int = 0


@dataclass(frozen=True)
class Pull:
    """The entry goes through the pull path: do not wait for a push of it."""

    KIND: ClassVar[int] = PULL
    key: bytes


@dataclass(frozen=True)
class Abort:
    """The producer gave up on the entry."""

    KIND: ClassVar[int] = ABORT
    key: bytes


@dataclass(frozen=True)
class Credit:
    """``free_bytes`` of staging are free once the first ``begun`` BEGINs after the HELLO of ``epoch`` count."""

    KIND: ClassVar[int] = CREDIT
    epoch: int
    free_bytes: int
    begun: int


Message = Hello | Begin | Data | Commit | Pull | Abort | Credit
_BY_KIND: dict[int, type[Message]] = {cls.KIND: cls for cls in (Hello, Begin, Data, Commit, Pull, Abort, Credit)}
_KEYED = (Begin, Data, Commit, Pull, Abort)


def key_of(message: Message) -> bytes:
    """The entry a message is about (``NO_KEY`` for HELLO and CREDIT)."""
    return message.key if isinstance(message, _KEYED) else NO_KEY


def encode(message: Message) -> torch.Tensor:
    """The header of ``message``."""
    values = tuple(getattr(message, f.name) for f in fields(message))
    key = NO_KEY
    if isinstance(message, _KEYED):
        key, values = values[0], values[1:]
    words = torch.frombuffer(bytearray(key), dtype=torch.int64).tolist()
    padded = [*values, *[0] * (_FIELDS - len(values))]
    return torch.tensor([MAGIC, VERSION, message.KIND, *words, *padded], dtype=torch.int64)


def parse(t: torch.Tensor | None) -> Message:
    """The message in a header; ``ValueError`` saying what is wrong if it is not a valid one."""
    if t is None or t.dtype != torch.int64 or t.shape != (HEADER_LEN,):
        what = "None" if t is None else f"{t.dtype} {list(t.shape)}"
        raise ValueError(f"expected a push header (int64[{HEADER_LEN}]), got {what}")
    words = t.tolist()
    if words[0] != MAGIC or words[1] != VERSION:
        raise ValueError(f"bad push header magic/version {words[0]:#x}/{words[1]}")
    cls = _BY_KIND.get(words[2])
    if cls is None:
        raise ValueError(f"unknown push message kind {words[2]}")
    rest = words[7:]
    if any(w < 0 for w in rest):
        raise ValueError(f"negative field in a {KIND_NAMES[words[2]]} header: {rest}")
    keyed = issubclass(cls, _KEYED)
    values = rest[:len(fields(cls)) - keyed]
    if cls is Commit and values[1] > 1:
        raise ValueError(f"a COMMIT's hidden must be 0 or 1, got {values[1]}")
    if keyed:
        return cls(t[3:7].contiguous().numpy().tobytes(), *values)  # type: ignore[call-arg]
    return cls(*values)  # type: ignore[call-arg]


def push_stats(on_count: Callable[[str, int], None] | None = None) -> Counts:
    """The counters of either end of a push channel (one set for both, so that a caller can sum them over ends).
    lost: messages that broke off mid-way (PipeStalled)."""
    return Counts(("begun", "pushed_bytes", "committed", "push_failed", "no_credit", "staged", "taken", "rejected",
                   "expired", "pulled", "aborted", "malformed", "lost", "duplicates"), on_count)
