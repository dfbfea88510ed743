"""The producer half of ``SimpleBuffer``: the entries (insert, expiry, eviction, back-pressure) and the threads that
serve the consumers' requests (one per link). The frames are those of ``simple_wire``."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kv_lookup_buffer.base import BufferClosed, BufferFull, Counts
from kv_lookup_buffer.simple_wire import (
    CLOSED,
    HIT,
    MISS,
    OP_CLOSE,
    OP_LOOKUP,
    OP_RELEASE,
    BadRequest,
    Request,
    answer_frame,
    looked_frame,
    masked_tokens,
    read_request,
)
from kv_lookup_buffer.token_index import TokenIndex, prefix_hashes
from kv_pipe import KVPipeBase, PeerDisconnected, PipeClosed, PipeError, PipeStalled, PipeTimeout, RecyclePool, copy_bytes

logger = logging.getLogger(__name__)

_POLL = 0.5  # how often a serving thread looks at the clock (expiry) and at close()


@dataclass
class _Entry:
    tensors: list[torch.Tensor | None]  # tokens, roi, key, value, hidden
    nbytes: int
    copied: bool  # its tensors are the buffer's own copies (recycled once sent), not the caller's handed over
    ready: Callable[[], None] | None = None  # its tensors are being filled: returns once they are
    created: float = field(default_factory=time.monotonic)
    taken: int = 0  # requests that took a part of it (a shared entry leaves with the last share)
    lease: int = 0  # held for the consumer's requests under this lease (a lookup found it); 0: none
    lease_until: float = 0.0  # time.monotonic() when the lease ends

    def open_to(self, lease: int) -> bool:
        """May a request under ``lease`` (0: none) see it? (Leases past their end are swept by ``_expire`` first.)"""
        return self.lease == 0 or self.lease == lease


def _unleased(entry: _Entry) -> bool:
    return entry.lease == 0


def nbytes_of(tensors: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _copy(t: torch.Tensor, recycled: torch.Tensor | None = None) -> torch.Tensor:
    """A private, contiguous copy, into ``recycled`` bytes if given (host tensors by a single-threaded memmove:
    see ``kv_pipe.memory.copy_bytes``)."""
    src = t.detach().contiguous()
    out = torch.empty_like(src) if recycled is None else recycled.view(src.dtype).view(src.shape)
    if src.numel():
        copy_bytes(out.view(-1).view(torch.uint8), src.view(-1).view(torch.uint8))
    return out


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


class BufferProducer:
    """Holds the entries of a producer ``SimpleBuffer`` (at most ``thresh`` bytes) and answers its consumers.

    ``closed`` and ``stats`` are the buffer's own (shared with it); ``died(thread)`` is called if the thread serving
    the constructor's pipes ends while the buffer is open.
    """

    def __init__(self, signal_pipe: KVPipeBase | None, data_pipe: KVPipeBase | None, thresh: float, timeout: float,
                 max_age: float | None, evict: bool, closed: threading.Event, stats: Counts,
                 died: Callable[[str], None]) -> None:
        self.signal_pipe, self.data_pipe = signal_pipe, data_pipe
        self.thresh, self.timeout, self.max_age, self.evict = thresh, timeout, max_age, evict
        self.stats = stats
        self.buffer_size = 0  # bytes held (entries in the index and the ones being sent)
        self._closed = closed
        self._died = died
        self._index: TokenIndex[_Entry] = TokenIndex()
        self._recycler = RecyclePool(thresh)
        self._cv = threading.Condition()
        self._consumer_closes = 0  # bumped when a consumer says goodbye: wakes blocked inserts
        self._thread: threading.Thread | None = None  # serving the constructor's pipes
        self._links: list[tuple[KVPipeBase, KVPipeBase, threading.Thread]] = []  # every link given to serve_link
        self._leased: dict[int, _Entry] = {}  # id -> entry, of the entries held under a lease

    def __len__(self) -> int:
        with self._cv:
            return len(self._index)

    # ------------------------------------------------------------------ entries
    def insert(self, originals: tuple[torch.Tensor | None, ...], copy: bool,
               ready: Callable[[], None] | None = None) -> None:
        """``SimpleBuffer.insert``, its arguments checked by the caller except the tokens."""
        input_tokens, roi = originals[0], originals[1]
        assert input_tokens is not None
        tokens = masked_tokens(input_tokens, roi).tolist()
        hashes = prefix_hashes(tokens)  # outside the lock: the serving thread is not held up by it
        nbytes = nbytes_of(originals)
        if nbytes > self.thresh:
            raise ValueError(f"an entry of {nbytes} bytes can never fit a buffer of buffer_size_thresh="
                             f"{self.thresh:.0f} bytes; raise the threshold")
        deadline = time.monotonic() + self.timeout
        with self._cv:  # claim room first, then copy: no copy is held outside the threshold
            self._expire()
            closes = self._consumer_closes
            while self.buffer_size + nbytes > self.thresh:
                if self.evict and self._drop_oldest("evicted", f"to make room for an entry of {len(tokens)} tokens"):
                    continue
                held = sum(entry.nbytes for entry in self._leased.values())
                if self.evict and held + nbytes > self.thresh:  # a lease is a promise to a consumer: the new entry
                    # gives way (entries being sent leave in a moment: room for them is overcommitted below)
                    raise BufferFull(f"no room for an entry of {nbytes} bytes: {held} bytes of the buffer's are held "
                                     f"for consumers that found them ({len(self._leased)} lease(s))")
                if self.evict:
                    break  # only entries being sent are left: they leave in a moment
                if self._closed.is_set():
                    raise BufferClosed("the buffer was closed while insert waited for room")
                if self._consumer_closes != closes:
                    raise BufferClosed("the consumer closed the buffer while insert waited for room")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"the buffer stayed full ({self.buffer_size} of {self.thresh:.0f} "
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
            self._index.add(tokens, _Entry(tensors, nbytes, copy, ready), hashes)
        self.start_serving()

    def make_room(self, nbytes: int) -> bool:
        """Drop the oldest entries no lease holds until they add up to ``nbytes`` or none is left (an ``evict``
        buffer's room lies elsewhere too: a device cache's pinned memory); whether any was dropped."""
        if not self.evict:
            return False
        freed = 0
        with self._cv:
            while freed < nbytes:
                before = self.buffer_size
                if not self._drop_oldest("evicted", f"to make room for an entry of {nbytes} bytes"):
                    break
                freed += before - self.buffer_size
        return freed > 0

    def _drop_oldest(self, why: str, detail: str) -> bool:
        """Forget the oldest entry no lease holds (under the lock), counted under ``why`` and logged; False if there
        is none."""
        ident = self._index.find(None, accept=_unleased)
        if ident is None:
            return False
        entry = self._index.remove(ident)
        self._release(entry)
        self.stats.add(why)
        logger.info("%s an entry of %d tokens (%.1f MiB) nobody took in %.1f s, %s", why, entry.tensors[0].numel(),
                    entry.nbytes / 2**20, time.monotonic() - entry.created, detail)
        return True

    def _expire(self) -> None:
        """End the leases past their end, then drop entries older than ``max_age`` no lease holds (under the lock).
        The index is in insertion order: oldest first."""
        now = time.monotonic()
        for key, entry in list(self._leased.items()):
            if entry.lease_until <= now:
                del self._leased[key]
                entry.lease = 0
                self.stats.add("leases_expired")
                logger.info("the lease on an entry of %d tokens ended unused (the consumer that found it did not come "
                            "for it)", entry.tensors[0].numel())
        if self.max_age is None:
            return
        limit = now - self.max_age
        while len(self._index):
            oldest = self._index.find(None, accept=_unleased)
            if oldest is None or self._index.peek(oldest).created > limit:
                return
            self._drop_oldest("expired", f"older than max_age={self.max_age:g} s")

    def _release(self, entry: _Entry) -> None:
        """An entry left the buffer (under the lock): free its bytes, recycle its memory, wake waiting inserts."""
        self.buffer_size -= entry.nbytes
        for t in entry.tensors if entry.copied else ():
            if t is not None:
                self._recycler.give(t)
        self._cv.notify_all()

    def _count(self, name: str, n: int = 1) -> None:
        with self._cv:
            self.stats.add(name, n)

    # ------------------------------------------------------------------ serving
    def start_serving(self) -> None:
        """Start answering on the constructor's pipes (idempotent; no pipes: nothing to do)."""
        if self.signal_pipe is None or self.data_pipe is None:
            return
        with self._cv:
            if self._thread is None and not self._closed.is_set():
                self._thread = self._serve_thread(self.signal_pipe, self.data_pipe)

    def serve_link(self, signal_pipe: KVPipeBase, data_pipe: KVPipeBase) -> None:
        """Also answer the consumer at the other end of these pipes, until they are closed."""
        with self._cv:
            if self._closed.is_set():
                raise BufferClosed("serve_link on a closed buffer")
            self._links = [link for link in self._links if link[2].is_alive()]
            self._links.append((signal_pipe, data_pipe, self._serve_thread(signal_pipe, data_pipe)))

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
                    self._died("serving")
                try:  # its requests in flight fail at once (the consumer may not have heard from us yet)
                    data_pipe.send_tensor(answer_frame(CLOSED, -1), timeout=1.0)
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
                logger.warning("a request from the consumer broke off and is lost (its drop_select fails or times out; "
                               "the consumer's next request connects afresh): %s", e)
                self._count("requests_lost")  # after the log: whoever sees the count can read the reason
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

    def _handle(self, frame: torch.Tensor | None, data_pipe: KVPipeBase) -> None:
        try:
            request = read_request(frame)
        except BadRequest as e:
            self._count("malformed")
            logger.error("malformed drop_select request (%s): %s", e,
                         "skipped" if e.seq is None else f"answering MISS to request {e.seq}")
            if e.seq is not None:
                data_pipe.send_tensor(answer_frame(MISS, e.seq))
            return
        if request.op == OP_CLOSE:
            logger.info("the consumer closed the buffer")
            with self._cv:
                self._consumer_closes += 1
                self._cv.notify_all()
            return
        if request.op == OP_LOOKUP:
            self._look(request, data_pipe)
            return
        if request.op == OP_RELEASE:
            with self._cv:
                for key, entry in list(self._leased.items()):
                    if entry.lease == request.lease:
                        del self._leased[key]
                        entry.lease = 0
                        self.stats.add("leases_released")
            return
        self._answer(request, data_pipe)

    def _look(self, request: Request, data_pipe: KVPipeBase) -> None:
        """A lookup: how much of the query the best entry open to its lease holds, and that entry held for the lease
        (kept from expiry, eviction and other requests) until a request under it takes it or the lease ends."""
        query = request.query
        assert query is not None
        hashes = prefix_hashes(query)
        with self._cv:
            self._expire()
            ident = self._index.find(query, hashes, accept=lambda e: e.open_to(request.lease))
            agree = held = 0
            if ident is not None:
                entry = self._index.peek(ident)
                held = len(self._index.tokens(ident))
                agree = min(held, len(query))  # the index matches only where one is a prefix of the other
                entry.lease, entry.lease_until = request.lease, time.monotonic() + request.lease_ms / 1e3
                self._leased[id(entry)] = entry
                self.stats.add("leases")
            self.stats.add("lookups")
        data_pipe.send_tensor(looked_frame(request.seq, agree, held))

    def _answer(self, request: Request, data_pipe: KVPipeBase) -> None:
        query = request.query
        hashes = None if query is None else prefix_hashes(query)  # outside the lock, away from the inserting thread
        with self._cv:
            self._expire()
            ident = None
            if request.lease:  # the entry its lookup found first, even if a better one came since
                ident = self._index.find(query, hashes, accept=lambda e: e.lease == request.lease)
            if ident is None:
                ident = self._index.find(query, hashes, accept=lambda e: e.open_to(request.lease))
            entry = None if ident is None else self._index.peek(ident)
            if entry is not None:
                entry.taken += 1
                last = entry.taken >= request.shares
                if request.shares > 1:
                    entry.copied = False  # other threads may send it too: its memory is never recycled
                if last:
                    self._index.remove(ident)
                    self._leased.pop(id(entry), None)
        if entry is None:
            self._count("misses")
            data_pipe.send_tensor(answer_frame(MISS, request.seq))
            return
        tokens, roi, key, value, hidden = entry.tensors
        if entry.ready is not None:
            try:
                entry.ready()
            except Exception as e:  # its bytes never arrived (a failed device copy): nothing to send
                logger.error("an entry of %d tokens could not be filled (%s): dropped, answering MISS", len(tokens), e)
                with self._cv:
                    if last:
                        self._release(entry)
                self._count("misses")
                data_pipe.send_tensor(answer_frame(MISS, request.seq))
                return
        try:
            answer = [tokens, roi, _part(_rows(key, request.rows), request.part), value, hidden]
            data_pipe.send_tensor(answer_frame(HIT, request.seq))
            for t in answer:
                data_pipe.send_tensor(t)
        except PipeError:
            with self._cv:  # the consumer did not get it: keep it for the next request
                entry.taken -= 1
                if last:
                    assert tokens is not None
                    self._index.add(masked_tokens(tokens, roi).tolist(), entry)
                    if entry.lease:
                        self._leased[id(entry)] = entry
            raise
        with self._cv:
            self.stats.add("hits")
            self.stats.add("hit_bytes", nbytes_of(answer))
            self.stats.add("hit_key_bytes", nbytes_of(answer[2:3]))
            if last:
                self._release(entry)

    # ------------------------------------------------------------------ closing
    def close(self, tell: bool) -> None:
        """The buffer is closed (``closed`` is set): wake blocked inserts, wait for the serving threads, and if
        ``tell``, answer CLOSED to each consumer."""
        with self._cv:
            self._cv.notify_all()
            thread = self._thread
            links = list(self._links)  # serve_link adds no more once closed
        for t in (thread, *(t for _, _, t in links)):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=5.0)
        if not tell:
            return
        if self.signal_pipe is not None and self.data_pipe is not None:
            links.append((self.signal_pipe, self.data_pipe, thread))  # type: ignore[arg-type]
        for _, data_pipe, _ in links:
            try:
                data_pipe.send_tensor(answer_frame(CLOSED, -1), timeout=1.0)
            except PipeError as e:
                logger.info("could not tell a consumer that the buffer closed: %s", e)
