"""The wire protocol of ``SimpleBuffer``: the requests its consumer sends (drop_select, lookup, release, close) and
the answers its producer sends back, each an int64 tensor on the pipes, built and parsed here only. Every frame is
validated field by field (nothing on the wire is executed); a malformed one raises ``BadRequest`` (requests) or
``ValueError`` (answers) with a message saying what was expected.

Frame layout: docs/wire.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

OP_CLOSE, OP_DROP_SELECT, OP_LOOKUP, OP_RELEASE = 4, 5, 6, 7
OLDER_OPS = (1, 2, 3)  # the drop_select ops of older versions (5- and 8-field requests)
ANY, QUERY = 0, 1  # request kinds: take any entry / match the tokens that follow
HIT, MISS, CLOSED, LOOKED = 0, 1, 2, 3
ANSWER_MAGIC = 0x4D4B5641  # "MKVA": starts every answer, so that leftovers of an answer that broke off are told apart
ALL_ROWS = -1
REQUEST_HEAD = 10  # op, seq, kind, row_start, row_stop, part_start, part_stop, shares, lease, lease_ms
MAX_SHARES = 1024
MAX_LEASE_MS = 600_000  # the longest a lookup may hold an entry for (what a consumer asks is capped at this)


class BadRequest(ValueError):
    """A malformed request; ``seq`` is set when the request could still be answered (with MISS)."""

    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


@dataclass(frozen=True)
class Request:
    op: int
    seq: int
    query: list[int] | None = None  # None: any entry
    rows: tuple[int, int] | None = None  # rows [start, stop) of the key; None: all
    part: tuple[int, int] | None = None  # a range of the key's third dimension; None: all
    shares: int = 1
    lease: int = 0  # drop_select: the lease it takes the entry under (0: none); lookup: the lease to grant
    lease_ms: int = 0  # lookup: how long the lease lasts


def as_mask(roi: torch.Tensor) -> torch.Tensor:
    """``roi`` as a boolean mask (a float roi counts where it is above one half)."""
    return roi if roi.dtype == torch.bool else roi > 0.5


def masked_tokens(tokens: torch.Tensor, roi: torch.Tensor | None) -> torch.Tensor:
    """The tokens that take part in a match: ``tokens`` where ``roi`` is set, as a 1-D int64 host tensor."""
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"input_tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {list(tokens.shape)}")
    if roi is not None:
        if roi.shape != tokens.shape:
            raise ValueError(f"roi must have the shape of input_tokens {list(tokens.shape)}, got {list(roi.shape)}")
        tokens = tokens[as_mask(roi)]
    return tokens.detach().to(device="cpu", dtype=torch.int64)


def request_frame(op: int, seq: int, query: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
                  part: tuple[int, int] | None = None, shares: int = 1, lease: int = 0,
                  lease_ms: int = 0) -> torch.Tensor:
    """The frame of a request (``query``: the roi-masked tokens, None: any entry)."""
    start, stop = rows if rows is not None else (0, ALL_ROWS)
    part_start, part_stop = part if part is not None else (0, ALL_ROWS)
    head = torch.tensor([op, seq, ANY if query is None else QUERY, start, stop, part_start, part_stop, shares, lease,
                         lease_ms], dtype=torch.int64)
    return head if query is None else torch.cat((head, query))


def read_request(t: torch.Tensor | None) -> Request:
    """The request in a frame; ``BadRequest`` (with ``seq`` when it could be read) if malformed."""
    if t is None or t.dtype != torch.int64 or t.dim() != 1 or t.numel() < REQUEST_HEAD:
        desc = "None" if t is None else f"{t.dtype} of shape {list(t.shape)}"
        raise BadRequest("expected a 1-D int64 tensor [op, seq, kind, row_start, row_stop, part_start, part_stop, "
                         f"shares, lease, lease_ms, *tokens], got {desc}")
    op, seq, kind, start, stop, part_start, part_stop, shares, lease, lease_ms, *query = t.tolist()
    if op not in (OP_DROP_SELECT, OP_LOOKUP, OP_RELEASE, OP_CLOSE):
        if op in OLDER_OPS:  # its answers have the same form: a MISS tells it at once
            raise BadRequest(f"unknown op {op}: the consumer runs an older version of this project", seq)
        raise BadRequest(f"unknown op {op}")
    if op == OP_CLOSE:
        return Request(op, seq)
    if op == OP_RELEASE:
        if lease == 0:
            raise BadRequest("a release names no lease")  # not answered: no seq to answer
        return Request(op, seq, lease=lease)
    if start < 0 or not (stop == ALL_ROWS or stop >= start):
        raise BadRequest(f"request {seq}: rows [{start}, {stop}) are not a range", seq)
    rows = None if stop == ALL_ROWS else (start, stop)
    if part_start < 0 or not (part_stop == ALL_ROWS or part_stop >= part_start):
        raise BadRequest(f"request {seq}: part [{part_start}, {part_stop}) is not a range", seq)
    part = None if part_stop == ALL_ROWS else (part_start, part_stop)
    if not 1 <= shares <= MAX_SHARES:
        raise BadRequest(f"request {seq}: shares must be 1..{MAX_SHARES}, got {shares}", seq)
    if op == OP_LOOKUP and (lease == 0 or kind != QUERY or not 0 < lease_ms):
        raise BadRequest(f"request {seq}: a lookup needs tokens, a lease and lease_ms > 0 (got kind {kind}, lease "
                         f"{lease}, lease_ms {lease_ms})", seq)
    lease_ms = min(lease_ms, MAX_LEASE_MS)
    if kind == ANY and not query:
        return Request(op, seq, None, rows, part, shares, lease, lease_ms)
    if kind == QUERY:
        return Request(op, seq, query, rows, part, shares, lease, lease_ms)
    raise BadRequest(f"request {seq}: kind must be {QUERY} (tokens follow) or {ANY} (nothing follows), "
                     f"got {kind} with {len(query)} tokens", seq)


def answer_frame(status: int, seq: int) -> torch.Tensor:
    """The frame that starts an answer (``HIT``, ``MISS`` or ``CLOSED``)."""
    return torch.tensor([ANSWER_MAGIC, status, seq], dtype=torch.int64)


def looked_frame(seq: int, agree: int, held: int) -> torch.Tensor:
    """A lookup's whole answer: the entry held for it agrees with the query on ``agree`` tokens, of ``held``."""
    return torch.tensor([ANSWER_MAGIC, LOOKED, seq, agree, held], dtype=torch.int64)


def read_answer(t: torch.Tensor | None, allowed: tuple[int, ...], what: str) -> tuple[int, int, tuple[int, int]]:
    """(status, seq, (agree, held)) of an answer's first frame ((0, 0) unless ``LOOKED``); ``ValueError`` if it is not
    one with a status in ``allowed``."""
    size = 5 if t is not None and t.dim() == 1 and t.numel() >= 2 and int(t[1]) == LOOKED else 3
    if t is None or t.dtype != torch.int64 or t.shape != (size,) or int(t[0]) != ANSWER_MAGIC or \
            int(t[1]) not in allowed:
        desc = "None" if t is None else f"{t.dtype} of shape {list(t.shape)}"
        raise ValueError(f"malformed {what}: expected an int64 tensor [{ANSWER_MAGIC:#x}, one of {allowed}, seq] "
                         f"([{ANSWER_MAGIC:#x}, {LOOKED}, seq, agree, held] for a lookup), got {desc}")
    if size == 3:
        return int(t[1]), int(t[2]), (0, 0)
    agree, held = int(t[3]), int(t[4])
    if not 0 <= agree <= held:
        raise ValueError(f"malformed {what}: a lookup's answer says {agree} tokens agree of {held} held")
    return LOOKED, int(t[2]), (agree, held)
