"""SimpleBuffer: the producer holds KV entries keyed by tokens; the consumer asks for one over a KV pipe and takes it.

The conversation on the pipes (``signal_pipe`` and ``data_pipe`` may be one and the same pipe):

- consumer -> producer, signal pipe: one int64 tensor per request,
  ``[op, seq, kind, row_start, row_stop, part_start, part_stop, shares, *tokens]``:
  ``OP_DROP_SELECT`` with ``kind`` ``QUERY`` followed by the query's roi-masked tokens (the consumer applies the roi;
  only the masked tokens take part in the match) or ``kind`` ``ANY`` and nothing after it (``drop_select(None,
  None)``); ``row_start``/``row_stop`` ask for rows [start, stop) of the entry's key (its first dimension), ``stop``
  -1 for all of them; ``part_start``/``part_stop`` a range of its third dimension (-1: all); ``shares``: how many
  requests take parts of this entry (it leaves the buffer with the last of them). Or ``OP_CLOSE`` (the consumer is
  going away).
- producer -> consumer, data pipe: an int64 tensor ``[status, seq]`` echoing the request's ``seq``: ``HIT``
  followed by the five tensors of the entry, ``MISS`` (nothing follows), or ``CLOSED`` (the producer is going away).

The consumer may have several requests in flight (several threads calling ``drop_select``): a receiving thread
hands each answer to the request with its ``seq``; an answer nobody waits for any more (its caller timed out) is
received and dropped (counted as late). The producer answers requests in order, one at a time.

Requests are validated by the producer; a malformed one is answered with MISS (or skipped, if it does not even
carry an op and a seq) and logged, and the serving thread goes on.

Extensions to vLLM v0's contract (all off by default): ``max_age`` drops entries nobody took within that many seconds,
``evict`` makes ``insert`` drop the oldest entries to make room instead of waiting for a consumer, and
``drop_select(..., key_rows=..., key_part=..., shares=...)`` fetches only some rows of the entry's key, only a range
of its third dimension (some KV heads), and lets several consumers (the TP ranks of one instance) each take a part of
one entry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from kv_lookup_buffer.base import KVLookupBufferBase
from kv_lookup_buffer.token_index import TokenIndex, prefix_hashes
from kv_pipe import KVPipeBase, PeerDisconnected, PipeClosed, PipeError, PipeStalled, PipeTimeout
from kv_pipe.memory import copy_bytes
from kv_pipe.scatter import Scatter

logger = logging.getLogger(__name__)

OP_DROP_SELECT, OP_CLOSE = 3, 4  # 1 and 2 were the ops of the 5-field request of older versions
ANY, QUERY = 0, 1  # request kinds: take any entry / match the tokens that follow
HIT, MISS, CLOSED = 0, 1, 2
ANSWER_MAGIC = 0x4D4B5641  # "MKVA": starts every answer, so that leftovers of an answer that broke off are told apart
ALL_ROWS = -1
REQUEST_HEAD = 8  # op, seq, kind, row_start, row_stop, part_start, part_stop, shares
MAX_SHARES = 1024
DEFAULT_TIMEOUT = 30.0
_POLL = 0.5  # how often the serving and receiving threads look at the clock (expiry) and at close()


class BufferClosed(RuntimeError):
    """The buffer, or the other side of it, was closed."""


@dataclass
class _Entry:
    tensors: list[torch.Tensor | None]  # tokens, roi, key, value, hidden
    nbytes: int
    copied: bool  # its tensors are the buffer's own copies (recycled once sent), not the caller's handed over
    created: float = field(default_factory=time.monotonic)
    taken: int = 0  # requests that took a part of it (a shared entry leaves with the last share)


def _nbytes(tensors: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _masked_tokens(tokens: torch.Tensor, roi: torch.Tensor | None) -> torch.Tensor:
    """The tokens that take part in a match: ``tokens`` where ``roi`` is set, as a 1-D int64 host tensor."""
    if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(f"input_tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {list(tokens.shape)}")
    if roi is not None:
        if roi.shape != tokens.shape:
            raise ValueError(f"roi must have the shape of input_tokens {list(tokens.shape)}, got {list(roi.shape)}")
        tokens = tokens[_as_mask(roi)]
    return tokens.detach().to(device="cpu", dtype=torch.int64)


RECYCLE_MIN = 1 << 20  # smaller tensors are cheap to allocate


class _Recycler:
    """Host buffers of copied entries already handed to the consumer, reused by later inserts of the same byte size.

    A fresh allocation page-faults on first write, which roughly doubles the cost of copying a KV-sized entry in;
    reusing the memory of a dropped entry avoids that. Holds at most ``limit`` bytes (oldest dropped first).
    """

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.held = 0
        self.free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor | None:
        bufs = self.free.get(nbytes)
        if not bufs:
            return None
        self.held -= nbytes
        return bufs.pop()

    def give(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < RECYCLE_MIN or nbytes > self.limit:
            return
        self.free.setdefault(nbytes, []).append(t.reshape(-1).view(torch.uint8))
        self.held += nbytes
        while self.held > self.limit:
            size = next(iter(self.free))
            self.free[size].pop(0)
            self.held -= size
            if not self.free[size]:
                del self.free[size]


def _copy(t: torch.Tensor, recycled: torch.Tensor | None = None) -> torch.Tensor:
    """A private, contiguous copy, into ``recycled`` bytes if given (host tensors by a single-threaded memmove:
    see ``kv_pipe.memory.copy_bytes``)."""
    src = t.detach().contiguous()
    out = torch.empty_like(src) if recycled is None else recycled.view(src.dtype).view(src.shape)
    if src.numel():
        copy_bytes(out.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8))
    return out


def _as_mask(roi: torch.Tensor) -> torch.Tensor:
    return roi if roi.dtype == torch.bool else roi > 0.5


def _message(code: int, seq: int) -> torch.Tensor:
    return torch.tensor([ANSWER_MAGIC, code, seq], dtype=torch.int64)


class _BadRequest(ValueError):
    """A malformed request; ``seq`` is set when the request could still be answered (with MISS)."""

    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


@dataclass(frozen=True)
class _Request:
    op: int
    seq: int
    query: list[int] | None = None  # None: any entry
    rows: tuple[int, int] | None = None  # rows [start, stop) of the key; None: all
    part: tuple[int, int] | None = None  # a range of the key's third dimension; None: all
    shares: int = 1


def _request(op: int, seq: int, query: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
             part: tuple[int, int] | None = None, shares: int = 1) -> torch.Tensor:
    start, stop = rows if rows is not None else (0, ALL_ROWS)
    part_start, part_stop = part if part is not None else (0, ALL_ROWS)
    head = torch.tensor([op, seq, ANY if query is None else QUERY, start, stop, part_start, part_stop, shares],
                        dtype=torch.int64)
    return head if query is None else torch.cat((head, query))


def _read_request(t: torch.Tensor | None) -> _Request:
    """The request in a frame; ``_BadRequest`` (with ``seq`` when it could be read) if malformed."""
    if t is None or t.dtype != torch.int64 or t.dim() != 1 or t.numel() < REQUEST_HEAD:
        desc = "None" if t is None else f"{t.dtype} of shape {list(t.shape)}"
        raise _BadRequest("expected a 1-D int64 tensor [op, seq, kind, row_start, row_stop, part_start, part_stop, "
                          f"shares, *tokens], got {desc}")
    op, seq, kind, start, stop, part_start, part_stop, shares, *query = t.tolist()
    if op not in (OP_DROP_SELECT, OP_CLOSE):
        if op in (1, 2):  # its answers have the same form: a MISS tells it at once
            raise _BadRequest(f"unknown op {op}: the consumer runs an older version of this project", seq)
        raise _BadRequest(f"unknown op {op}")
    if op == OP_CLOSE:
        return _Request(op, seq)
    if start < 0 or not (stop == ALL_ROWS or stop >= start):
        raise _BadRequest(f"request {seq}: rows [{start}, {stop}) are not a range", seq)
    rows = None if stop == ALL_ROWS else (start, stop)
    if part_start < 0 or not (part_stop == ALL_ROWS or part_stop >= part_start):
        raise _BadRequest(f"request {seq}: part [{part_start}, {part_stop}) is not a range", seq)
    part = None if part_stop == ALL_ROWS else (part_start, part_stop)
    if not 1 <= shares <= MAX_SHARES:
        raise _BadRequest(f"request {seq}: shares must be 1..{MAX_SHARES}, got {shares}", seq)
    if kind == ANY and not query:
        return _Request(op, seq, None, rows, part, shares)
    if kind == QUERY:
        return _Request(op, seq, query, rows, part, shares)
    raise _BadRequest(f"request {seq}: kind must be {QUERY} (tokens follow) or {ANY} (nothing follows), "
                      f"got {kind} with {len(query)} tokens", seq)


def _read_message(t: torch.Tensor | None, allowed: tuple[int, ...], what: str) -> tuple[int, int]:
    if t is None or t.dtype != torch.int64 or t.shape != (3,) or int(t[0]) != ANSWER_MAGIC or int(t[1]) not in allowed:
        desc = "None" if t is None else f"{t.dtype} of shape {list(t.shape)}"
        raise ValueError(f"malformed {what}: expected an int64 tensor [{ANSWER_MAGIC:#x}, one of {allowed}, seq], "
                         f"got {desc}")
    return int(t[1]), int(t[2])


def _rows(key: torch.Tensor | None, rows: tuple[int, int] | None) -> torch.Tensor | None:
    """Rows [start, stop) of ``key``'s first dimension (clamped to what it has): a view, contiguous if ``key`` is."""
    if key is None or rows is None or key.dim() == 0:
        return key
    start = min(rows[0], key.shape[0])
    return key[start:min(max(rows[1], start), key.shape[0])]


def _part(key: torch.Tensor | None, part: tuple[int, int] | None) -> torch.Tensor | None:
    """A range of ``key``'s third dimension (clamped to what it has), as a contiguous copy; ``key`` itself if the
    range is all of it (or ``key`` has no third dimension). On the host one memmove per (row, second index): a
    strided ``contiguous()`` would fan out over the OpenMP pool of the process's main thread (see ``copy_bytes``)."""
    if key is None or part is None or key.dim() < 3:
        return key
    size = key.shape[2]
    start = min(part[0], size)
    stop = min(max(part[1], start), size)
    if (start, stop) == (0, size):
        return key
    src = key[:, :, start:stop]
    if key.device.type != "cpu" or not key.is_contiguous() or src.numel() == 0:
        return src.contiguous()
    out = torch.empty(src.shape, dtype=key.dtype)
    for r in range(src.shape[0]):
        for i in range(src.shape[1]):
            copy_bytes(out[r, i].reshape(-1).view(torch.uint8), src[r, i].reshape(-1).view(torch.uint8))
    return out


@dataclass
class _Pending:
    """A consumer request waiting for its answer."""

    key_out: torch.Tensor | Scatter | None
    receiving: bool = False  # its entry is being received (into key_out): the caller waits for the end of it
    done: threading.Event = field(default_factory=threading.Event)
    result: list[torch.Tensor | None] | None = None
    error: BaseException | None = None


class _AnswerBrokeOff(PipeError):
    """The entry of a HIT answer did not arrive whole."""


def _died_error(thread: str) -> BufferClosed:
    return BufferClosed(f"this buffer's {thread} thread died (see the log): use a new buffer")


class SimpleBuffer(KVLookupBufferBase):
    """A lookup buffer holding at most ``buffer_size_thresh`` bytes of tensors.

    The producer calls ``insert``; a thread serving the consumer's requests starts with the first insert (or
    ``start_serving()``). The consumer calls ``drop_select``, from as many threads as it likes. ``role`` is taken
    from the first of those calls unless given; ``close()`` uses it to tell the right side. ``timeout`` bounds every
    wait (default: the data pipe's configured timeout, else 30 s).

    Producer options: ``max_age`` (seconds; None: forever) drops entries nobody took within that time; ``evict``
    makes an insert that does not fit drop the oldest entries instead of waiting for a consumer to take some (the
    entries being sent at that moment still count, so the bytes held may pass the threshold by those). Both are
    counted in ``stats`` (``expired``, ``evicted``) and logged once per entry. ``on_count(name, n)``, if given, is
    told of those counts and of the answers' (``hits``, ``hit_bytes``, ``hit_key_bytes``) as they happen (under
    the buffer's lock: it must not call back into the buffer).
    """

    def __init__(self, signal_pipe: KVPipeBase | None, data_pipe: KVPipeBase | None, buffer_size_thresh: float,
                 timeout: float | None = None, role: Literal["producer", "consumer"] | None = None, *,
                 max_age: float | None = None, evict: bool = False,
                 on_count: Callable[[str, int], None] | None = None) -> None:
        if buffer_size_thresh <= 0:
            raise ValueError(f"buffer_size_thresh must be > 0 bytes, got {buffer_size_thresh}")
        if max_age is not None and not max_age > 0:
            raise ValueError(f"max_age must be > 0 seconds or None, got {max_age}")
        if role not in (None, "producer", "consumer"):
            raise ValueError(f"role must be 'producer', 'consumer' or None, got {role!r}")
        if (signal_pipe is None or data_pipe is None) and role != "producer":
            raise ValueError("only a producer may start without pipes (it serves the links given to serve_link)")
        self.signal_pipe = signal_pipe
        self.data_pipe = data_pipe
        self.buffer_size_threshold = buffer_size_thresh
        config = getattr(data_pipe, "config", None)
        self.timeout = timeout if timeout is not None else getattr(config, "timeout", DEFAULT_TIMEOUT)
        self.max_age = max_age
        self.evict = evict
        self.on_count = on_count
        self.role = role
        self.buffer_size = 0  # bytes held (entries in the index and the one being sent)
        self._index: TokenIndex[_Entry] = TokenIndex()
        self._recycler = _Recycler(buffer_size_thresh)
        self._cv = threading.Condition()
        self._closed = threading.Event()
        self._consumer_closes = 0  # bumped when the consumer says goodbye: wakes blocked inserts
        self._thread: threading.Thread | None = None  # producer: serving the constructor's pipes; consumer: receiving
        self._links: list[tuple[KVPipeBase, KVPipeBase, threading.Thread]] = []  # producer: every link served
        self._died: str | None = None  # the thread of ours that ended unexpectedly (see ``healthy``)
        self._seq = 0  # the consumer's request counter
        self._pending: dict[int, _Pending] = {}  # consumer: requests in flight, by seq
        # requests_lost (producer) / answers_lost (consumer): requests / answers that broke off mid-way (their
        # sender froze or died after they had begun to arrive); logged too
        self.stats = {"hits": 0, "misses": 0, "malformed": 0, "late_hits_dropped": 0, "stray_frames": 0, "expired": 0,
                      "evicted": 0, "hit_bytes": 0, "hit_key_bytes": 0, "requests_lost": 0, "answers_lost": 0}

    def __len__(self) -> int:
        with self._cv:
            return len(self._index)

    # ---------------------------------------------------------------- producer
    def insert(self, input_tokens: torch.Tensor, roi: torch.Tensor | None, key: torch.Tensor | None,
               value: torch.Tensor | None, hidden: torch.Tensor | None, *, copy: bool = True) -> None:
        """See ``KVLookupBufferBase.insert``. ``copy=False`` (an extension): keep the caller's tensors instead of
        copying them; the caller hands them over and must not touch them again (saves a copy of a fresh gather).
        With ``evict``, never waits: the oldest entries make room."""
        self._check_usable("insert")
        self._take_role("producer")
        tokens = _masked_tokens(input_tokens, roi).tolist()
        hashes = prefix_hashes(tokens)  # outside the lock: the serving thread is not held up by it
        originals = (input_tokens, roi, key, value, hidden)
        nbytes = _nbytes(originals)
        if nbytes > self.buffer_size_threshold:
            raise ValueError(f"an entry of {nbytes} bytes can never fit a buffer of buffer_size_thresh="
                             f"{self.buffer_size_threshold:.0f} bytes; raise the threshold")
        deadline = time.monotonic() + self.timeout
        with self._cv:  # claim room first, then copy: no copy is held outside the threshold
            self._expire()
            closes = self._consumer_closes
            while self.buffer_size + nbytes > self.buffer_size_threshold:
                if self.evict and len(self._index):
                    self._drop_oldest("evicted", f"to make room for an entry of {len(tokens)} tokens")
                    continue
                if self.evict:
                    break  # only entries being sent are left: they leave in a moment
                if self._closed.is_set():
                    raise BufferClosed("the buffer was closed while insert waited for room")
                if self._consumer_closes != closes:
                    raise BufferClosed("the consumer closed the buffer while insert waited for room")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the buffer stayed full ({self.buffer_size} of {self.buffer_size_threshold:.0f} "
                                       f"bytes) for {self.timeout:.1f} s: no consumer took an entry")
                self._cv.wait(remaining)
            self.buffer_size += nbytes
            recycled = [None if t is None or not copy else self._recycler.take(t.numel() * t.element_size())
                        for t in originals]
        try:
            if copy:
                tensors = [None if t is None else _copy(t, r) for t, r in zip(originals, recycled, strict=True)]
            else:
                tensors = [None if t is None else t.detach().contiguous() for t in originals]
        except BaseException:
            with self._cv:
                self.buffer_size -= nbytes
                self._cv.notify_all()
            raise
        with self._cv:
            self._index.add(tokens, _Entry(tensors, nbytes, copy), hashes)
        self.start_serving()

    def _drop_oldest(self, why: str, detail: str) -> None:
        """Forget the oldest entry (under the lock), counted under ``why`` and logged."""
        ident = self._index.find(None)
        assert ident is not None
        entry = self._index.remove(ident)
        self._release(entry)
        self.stats[why] += 1
        if self.on_count is not None:
            self.on_count(why, 1)
        logger.info("%s an entry of %d tokens (%.1f MiB) nobody took in %.1f s, %s", why, entry.tensors[0].numel(),
                    entry.nbytes / 2**20, time.monotonic() - entry.created, detail)

    def _expire(self) -> None:
        """Drop entries older than ``max_age`` (under the lock). The index is in insertion order: oldest first."""
        if self.max_age is None:
            return
        limit = time.monotonic() - self.max_age
        while len(self._index):
            oldest = self._index.find(None)
            assert oldest is not None
            if self._index.peek(oldest).created > limit:
                return
            self._drop_oldest("expired", f"older than max_age={self.max_age:g} s")

    def _release(self, entry: _Entry) -> None:
        """An entry left the buffer (under the lock): free its bytes, recycle its memory, wake waiting inserts."""
        self.buffer_size -= entry.nbytes
        for t in entry.tensors if entry.copied else ():
            if t is not None:
                self._recycler.give(t)
        self._cv.notify_all()

    def start_serving(self) -> None:
        """Start answering the consumer's requests on the constructor's pipes (idempotent; insert calls it)."""
        self._take_role("producer")
        if self.signal_pipe is None or self.data_pipe is None:
            return
        with self._cv:
            if self._thread is None and not self._closed.is_set():
                self._thread = self._serve_thread(self.signal_pipe, self.data_pipe)

    def serve_link(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase | None = None) -> None:
        """Producer (an extension for XpYd): also answer the consumer at the other end of these pipes (``data_pipe``
        defaults to ``signal_pipe``). Every consumer takes from the same entries; each gets its answers on its own
        link. Serving a link ends when its pipe is closed."""
        self._take_role("producer")
        with self._cv:
            if self._closed.is_set():
                raise BufferClosed("serve_link on a closed buffer")
            data = data_pipe if data_pipe is not None else signal_pipe
            self._links = [link for link in self._links if link[2].is_alive()]
            self._links.append((signal_pipe, data, self._serve_thread(signal_pipe, data)))

    def _check_usable(self, op: str) -> None:
        if self._closed.is_set():
            raise BufferClosed(f"{op} on a closed buffer")
        if self._died is not None:
            raise _died_error(self._died)

    @property
    def healthy(self) -> bool:
        """Open, and its receiving thread (consumer) or the serving thread of its constructor's pipes (producer) has
        not died. A link whose serving thread died is closed instead: its consumer makes it again."""
        return not self._closed.is_set() and self._died is None

    def _serve_thread(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase) -> threading.Thread:
        thread = threading.Thread(target=self._serve_guarded, args=(signal_pipe, data_pipe), name="kv-buffer-server",
                                  daemon=True)
        thread.start()
        return thread

    def _serve_guarded(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase) -> None:
        """``_serve``, and if it ever ends while the buffer is open (it catches every error of a request, so only
        something like SystemExit can end it): say so and close the link, so that its consumer's requests fail
        at once and it links again (a new serving thread), instead of waiting for answers nobody sends."""
        try:
            self._serve(signal_pipe, data_pipe)
        finally:
            if not self._closed.is_set():
                logger.error("the thread serving a consumer's requests ended unexpectedly; closing that link")
                if signal_pipe is self.signal_pipe:
                    self._died = "serving"
                try:  # its requests in flight fail at once (the consumer may not have heard from us yet)
                    data_pipe.send_tensor(_message(CLOSED, -1), timeout=1.0)
                except Exception as e:  # telling it is best effort here
                    logger.info("could not tell the consumer: %s", e)
                for pipe in {id(signal_pipe): signal_pipe, id(data_pipe): data_pipe}.values():
                    try:
                        pipe.close()
                    except Exception:  # closing is best effort here
                        logger.exception("closing the link failed")

    def _serve(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase) -> None:
        while not self._closed.is_set():
            try:
                # _POLL bounds only the wait for a request to start: its bytes (a long query's come after its
                # header) may take the pipe's own timeout, and a request that breaks off raises PipeStalled
                frame = signal_pipe.recv_tensor(timeout=_POLL)
            except PipeStalled as e:
                self._count("requests_lost")
                logger.warning("a request from the consumer broke off and is lost (its drop_select fails or times out; "
                               "the consumer's next request connects afresh): %s", e)
                continue
            except PipeTimeout:
                with self._cv:
                    self._expire()
                continue
            except PipeClosed:
                return
            except PeerDisconnected as e:
                logger.warning("buffer consumer went away (%s); waiting for it to come back", e)
                self._closed.wait(_POLL)  # its next connection is accepted by the pipe meanwhile
                continue
            except (PipeError, ValueError) as e:
                self._count("malformed")
                logger.error("ignored a malformed or broken request from the consumer: %s", e)
                continue
            except Exception:  # a bug must not end the serving: every later request would go unanswered
                logger.exception("receiving a request failed; serving goes on")
                self._closed.wait(_POLL)
                continue
            try:
                self._handle(frame, data_pipe)
            except PipeClosed:
                return
            except (PipeError, ValueError) as e:
                logger.warning("could not answer the consumer: %s", e)
            except Exception:
                logger.exception("answering a request failed; serving goes on")

    def _count(self, name: str, n: int = 1) -> None:
        with self._cv:
            self.stats[name] += n

    def _handle(self, frame: torch.Tensor | None, data_pipe: KVPipeBase) -> None:
        try:
            request = _read_request(frame)
        except _BadRequest as e:
            self._count("malformed")
            logger.error("malformed drop_select request (%s): %s", e,
                         "skipped" if e.seq is None else f"answering MISS to request {e.seq}")
            if e.seq is not None:
                data_pipe.send_tensor(_message(MISS, e.seq))
            return
        if request.op == OP_CLOSE:
            logger.info("the consumer closed the buffer")
            with self._cv:
                self._consumer_closes += 1
                self._cv.notify_all()
            return
        self._answer(request, data_pipe)

    def _answer(self, request: _Request, data_pipe: KVPipeBase) -> None:
        query = request.query
        hashes = None if query is None else prefix_hashes(query)  # outside the lock, away from the inserting thread
        with self._cv:
            self._expire()
            ident = self._index.find(query, hashes)
            entry = None if ident is None else self._index.peek(ident)
            if entry is not None:
                entry.taken += 1
                last = entry.taken >= request.shares
                if request.shares > 1:
                    entry.copied = False  # other threads may send it too: its memory is never recycled
                if last:
                    self._index.remove(ident)
        if entry is None:
            self._count("misses")
            data_pipe.send_tensor(_message(MISS, request.seq))
            return
        tokens, roi, key, value, hidden = entry.tensors
        answer = [tokens, roi, _part(_rows(key, request.rows), request.part), value, hidden]
        try:
            data_pipe.send_tensor(_message(HIT, request.seq))
            for t in answer:
                data_pipe.send_tensor(t)
        except PipeError:
            with self._cv:  # the consumer did not get it: keep it for the next request
                entry.taken -= 1
                if last:
                    self._index.add(_masked_tokens(tokens, roi).tolist(), entry)
            raise
        counts = {"hits": 1, "hit_bytes": _nbytes(answer), "hit_key_bytes": _nbytes(answer[2:3])}
        with self._cv:
            for name, n in counts.items():
                self.stats[name] += n
                if self.on_count is not None:
                    self.on_count(name, n)
            if last:
                self._release(entry)

    # ---------------------------------------------------------------- consumer
    def drop_select(self, input_tokens: torch.Tensor | None, roi: torch.Tensor | None, *,
                    key_out: torch.Tensor | Scatter | None = None, key_rows: tuple[int, int] | None = None,
                    key_part: tuple[int, int] | None = None, shares: int = 1,
                    timeout: float | None = None) -> list[torch.Tensor | None]:
        """See ``KVLookupBufferBase.drop_select``. Extensions:

        - ``key_rows=(start, stop)``: only rows [start, stop) of the entry's key are sent (its first dimension,
          clamped to the rows it has); the entry is taken all the same.
        - ``key_part=(start, stop)``: only that range of the key's third dimension is sent (for a KV entry
          ``[blocks, layers, heads, ...]``: some heads), as a contiguous tensor.
        - ``shares``: this request takes one of that many parts of the entry (e.g. the heads of one TP rank); the
          entry stays for the others and leaves the buffer with the last of them (or when it expires).
        - ``key_out``: where the entry's key is received, through the data pipe's ``recv_tensor(out=...)``
          (``MooncakePipe``): a buffer (the key returned is then a view of it: reusing one buffer for large entries
          saves the page faults of a fresh allocation each time), or a ``Scatter`` of memory regions (the key
          returned is then a ``meta`` tensor: its bytes are in the regions). If this call raises, do not reuse a
          buffer ``key_out`` (see ``MooncakePipe.recv_tensor``).
        - ``timeout``: seconds to wait for the answer (default: the buffer's); ``TimeoutError`` after that. Once the
          entry is being received the call waits for the end of that (the pipe's own timeouts bound it), so nothing
          is written into ``key_out`` after this call returns or raises.

        Several threads may call this at once: their requests are in flight together.
        """
        self._check_usable("drop_select")
        self._take_role("consumer")
        if input_tokens is not None:
            query = _masked_tokens(input_tokens, roi)  # a bad query is refused here rather than at the producer
        elif roi is not None:
            raise ValueError("roi given without input_tokens")
        else:
            query = None
        for name, span in (("key_rows", key_rows), ("key_part", key_part)):
            if span is not None and not (0 <= span[0] <= span[1]):
                raise ValueError(f"{name} must be (start, stop) with 0 <= start <= stop, got {span}")
        if isinstance(shares, bool) or not isinstance(shares, int) or not 1 <= shares <= MAX_SHARES:
            raise ValueError(f"shares must be an integer from 1 to {MAX_SHARES}, got {shares!r}")
        wait = self.timeout if timeout is None else timeout
        pending = _Pending(key_out)
        with self._cv:
            self._seq += 1
            seq = self._seq
            self._pending[seq] = pending
            if self._thread is None:
                self._thread = threading.Thread(target=self._receive_guarded, name="kv-buffer-receiver", daemon=True)
                self._thread.start()
        try:
            self.signal_pipe.send_tensor(_request(OP_DROP_SELECT, seq, query, key_rows, key_part, shares), timeout=wait)
            if not pending.done.wait(wait):
                with self._cv:
                    receiving = pending.receiving
                    if not receiving:
                        self._pending.pop(seq, None)  # a late answer is dropped, never received into key_out
                if not receiving:
                    raise TimeoutError(f"no answer to drop_select request {seq} within {wait:.1f} s")
                pending.done.wait()
        finally:
            with self._cv:
                self._pending.pop(seq, None)
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _receive_guarded(self) -> None:
        """``_receive_loop``, and if it ever ends while the buffer is open (only something like SystemExit can end
        it): the buffer is unhealthy, the requests in flight and every later one fail with a clear error."""
        try:
            self._receive_loop()
        finally:
            if not self._closed.is_set():
                self._died = "receiving"
                logger.error("the buffer's receiving thread ended unexpectedly: drop_select fails from now on")
                self._fail_pending(_died_error(self._died))

    def _receive_loop(self) -> None:
        """Consumer: receive every answer and hand it to its request."""
        while not self._closed.is_set():
            try:
                frame = self.data_pipe.recv_tensor(timeout=_POLL)  # _POLL: the wait for an answer to start only
                try:
                    status, seq = _read_message(frame, (HIT, MISS, CLOSED), "drop_select answer")
                except ValueError as e:  # e.g. the rest of an answer that broke off, resent on a new connection
                    self.stats["stray_frames"] += 1
                    logger.warning("skipped a frame that starts no answer: %s", e)
                    continue
                if status == CLOSED:
                    self._fail_pending(BufferClosed("the producer closed the buffer"))
                    continue
                with self._cv:
                    pending = self._pending.get(seq)
                    if pending is not None and status == HIT:
                        pending.receiving = True
                if status == MISS:
                    result: list[torch.Tensor | None] = [None] * 5
                else:
                    try:
                        result = self._receive_entry(pending.key_out if pending is not None else None)
                    except Exception as e:  # whatever broke it, the rest of the entry is still coming
                        self.data_pipe.abandon_receive(f"answer {seq} broke off: {e}")
                        raise _AnswerBrokeOff(f"the answer to drop_select request {seq} broke off: {e}") from e
                    if pending is None:
                        self.stats["late_hits_dropped"] += 1
                        logger.warning("dropped a late answer to drop_select request %d (its caller gave up)", seq)
                if pending is not None:
                    pending.result = result
                    pending.done.set()
            except PipeTimeout as e:
                if not isinstance(e, PipeStalled):
                    continue  # idle
                self._answers_lost(e, broke_off=True)  # an answer's header broke off: never mistaken for idleness
            except PipeClosed:
                self._fail_pending(BufferClosed("the buffer was closed"))
                return
            except (PipeError, ValueError) as e:  # the answers in flight are lost with the connection
                self._answers_lost(e, broke_off=isinstance(e, _AnswerBrokeOff))
            except Exception as e:  # a bug must not leave callers waiting forever: fail them and go on
                logger.exception("drop_select answers lost")
                self._fail_pending(e)

    def _answers_lost(self, error: BaseException, broke_off: bool) -> None:
        """The connection answers come on failed (``broke_off``: in the middle of an answer, which is counted): the
        requests in flight fail now (their answers are lost with it) rather than at their timeout."""
        if broke_off:
            self._count("answers_lost")
        logger.warning("drop_select answers lost: %s", error)
        self._fail_pending(error)
        self._closed.wait(0.01)

    def _fail_pending(self, error: BaseException) -> None:
        """Fail every request in flight; they leave ``_pending`` at once, so that an answer to one of them arriving
        later is dropped as late, never received into its ``key_out``."""
        with self._cv:
            waiting = list(self._pending.values())
            self._pending.clear()
        for pending in waiting:
            if not pending.done.is_set():
                pending.error = error
                pending.done.set()

    def _receive_entry(self, key_out: torch.Tensor | Scatter | None) -> list[torch.Tensor | None]:
        tokens, roi = self.data_pipe.recv_tensor(), self.data_pipe.recv_tensor()
        key = self.data_pipe.recv_tensor() if key_out is None else self.data_pipe.recv_tensor(out=key_out)  # type: ignore[call-arg]
        return [tokens, roi, key, self.data_pipe.recv_tensor(), self.data_pipe.recv_tensor()]

    def _take_role(self, role: str) -> None:
        if self.role is None:
            self.role = role
        elif self.role != role:
            raise RuntimeError(f"this SimpleBuffer is the {self.role}'s end; "
                               f"{'insert' if role == 'producer' else 'drop_select'} belongs to the {role}")

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Producer: stop serving and answer CLOSED to the consumer. Consumer: tell the producer. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._cv:
            self._cv.notify_all()
            thread = self._thread
            links = list(self._links)  # serve_link adds no more once closed
        self._fail_pending(BufferClosed("the buffer was closed"))
        for t in (thread, *(t for _, _, t in links)):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=5.0)
        if self.role == "consumer":
            assert self.signal_pipe is not None
            try:
                self.signal_pipe.send_tensor(_request(OP_CLOSE, -1), timeout=1.0)
            except PipeError as e:
                logger.info("could not tell the producer that the buffer closed: %s", e)
            return
        if self.role != "producer":
            return  # never used: nobody to tell
        if self.signal_pipe is not None and self.data_pipe is not None:
            links.append((self.signal_pipe, self.data_pipe, thread))
        for _, data_pipe, _ in links:  # producer: tell each consumer
            try:
                data_pipe.send_tensor(_message(CLOSED, -1), timeout=1.0)
            except PipeError as e:
                logger.info("could not tell a consumer that the buffer closed: %s", e)
