"""Host-memory helpers for the pipe's copies in and out of the registered staging areas, and every pool of memory
faulted in once and reused: ``WarmPool`` (scratch buffers), ``ResultPool`` (received tensors are served from it) and
``RecyclePool`` (the lookup buffer's copies of entries already sent)."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_HUGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_populate_ok = True


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between two contiguous uint8 tensors of equal size.

    Host to host: a plain single-threaded memmove (GIL released). ``Tensor.copy_`` would fan out over the OpenMP
    pool, whose workers then spin for a while after every copy, stealing the cores the engine and the peer need.
    Anything involving a GPU: ``copy_``, which
    synchronises, so the bytes are in place when it returns.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src)


def mapped(nbytes: int) -> torch.Tensor:
    """A uint8 host tensor on an anonymous mapping of its own, unmapped once the tensor and its views are gone."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def prefault(region: torch.Tensor) -> None:
    """Fault in the pages of a host byte region before it is written (best effort; no-op for device memory).

    One ``madvise(MADV_POPULATE_WRITE)`` maps them in bulk, cheaper than a page fault per 4 KiB during a copy.
    """
    global _populate_ok
    if not _populate_ok or region.device.type != "cpu" or region.numel() < mmap.PAGESIZE:
        return
    page = mmap.PAGESIZE
    start = (region.data_ptr() + page - 1) // page * page
    end = (region.data_ptr() + region.numel()) // page * page
    if end <= start:
        return
    if _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE) != 0:
        _populate_ok = False  # an older kernel: fall back to ordinary page faults
        logger.debug("MADV_POPULATE_WRITE unavailable (errno %d); not prefaulting", ctypes.get_errno())


def advise_huge_pages(region: torch.Tensor) -> None:
    """Ask for transparent huge pages on a large fresh host region (best effort): 512x fewer page faults to fill it."""
    if region.device.type != "cpu" or region.numel() < 4 * _HUGE:
        return
    start = (region.data_ptr() + _HUGE - 1) // _HUGE * _HUGE
    end = (region.data_ptr() + region.numel()) // _HUGE * _HUGE
    if end > start:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


class WarmPool:
    """Host byte buffers kept from use to use, faulted in once: fresh pages for every KV-sized transfer can cost more
    than the copies into them. ``get`` hands a buffer to one user, ``put`` takes it back; at most ``keep`` idle
    buffers are kept."""

    def __init__(self, keep: int = 4, pinned: bool = False) -> None:
        self.keep = keep
        self.pinned = pinned  # page-locked (a CUDA copy reads or writes them without staging)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes: the smallest idle one that fits, else a new one."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        prefault(buf)  # no huge pages: compacting memory for them stalled for milliseconds per MiB here
        return buf

    def put(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse (only if nothing may still write into it)."""
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


RECYCLE_MIN = 1 << 20  # smaller tensors are cheap to allocate


class RecyclePool:
    """Host buffers of copied entries already handed to the consumer, reused by later copies of the same byte size.

    A fresh allocation page-faults on first write, which roughly doubles the cost of copying a KV-sized entry in;
    reusing the memory of a dropped entry avoids that. Holds at most ``limit`` bytes (oldest dropped first). Not
    thread-safe: the caller holds its own lock.
    """

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.held = 0
        self.free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor | None:
        """Idle uint8 bytes of exactly ``nbytes``, or None."""
        bufs = self.free.get(nbytes)
        if not bufs:
            return None
        self.held -= nbytes
        return bufs.pop()

    def give(self, t: torch.Tensor) -> None:
        """Keep ``t``'s memory for reuse (only if nothing else uses it); host tensors of ``RECYCLE_MIN`` bytes up to
        ``limit`` only."""
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


# torch's count of the owners of a storage (tensors and views using it): private, so a torch without it gets no pool
# rather than a wrong one.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass(eq=False)
class _Slot:
    """One block of the pool (mapped once a receive filled it). Only the pool holds ``buf``. A result served from it
    has a storage of its own, exactly its size, whose memory is a view of ``buf`` kept alive by that storage (through
    a numpy array): the slot is in use for as long as the result's storage lives, i.e. while any tensor, view, slice,
    array, capsule or the storage object itself of that result is alive anywhere. The result's storage never shows
    the rest of the slot (an earlier, larger result's bytes), and weak references to it die with it."""

    buf: torch.Tensor  # uint8, the slot's whole memory
    last_used: float
    warm: bool = False  # a receive has filled it: every page is mapped
    idle: int = 0  # torch's use count of ``buf``'s storage while no result uses the slot (measured when made)

    @property
    def addr(self) -> int:
        return self.buf.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def free(self) -> bool:
        return _storage_use_count(self.buf.untyped_storage()._cdata) <= self.idle

    def serve(self, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` on the first ``nbytes`` of the slot, with a storage of its own."""
        return torch.from_numpy(self.buf[:nbytes].numpy()).view(dtype).view(tuple(shape))


class ResultPool:
    """Host memory, kept mapped, that ``recv_tensor()`` results are served from (one pool per pipe endpoint).

    A fresh result's page faults cost about as much as receiving its bytes (see benchmarks/results/bench_pipe.json).
    So results of at least ``MIN_BYTES`` live in *slots*, faulted in once and reused once a result is dropped: each
    result has a storage of its own, exactly its size, that keeps its slot in use for as long as it lives (see
    ``_Slot``), so a result still referenced, also through a view, a slice, an array or its storage, is never
    overwritten, and never shows another result's bytes. Slots are made on demand, sized to the tensor, and all of
    them together hold at most ``capacity`` bytes; idle slots are dropped, least recently used first, to make room. A
    result that fits nowhere is left to the caller to allocate (``take`` returns None). Thread-safe.

    A new slot is faulted in by the receive it is made for, as a fresh result would be, not before: faulting it in
    first can take longer than a sender waits for a zero-copy offer (``OFFER_WAIT``), which then sent that first
    tensor through the ring instead (one more copy).

    A result moved to shared memory (``share_memory_()``, or put on a multiprocessing queue) leaves its slot, which is
    free again. ``forget`` takes a result's slot out of the pool for good (its memory is freed with the result): for a
    result whose failed zero-copy receive a late write may still reach.
    """

    MIN_BYTES = 1 << 20  # smaller results come from the allocator's already mapped heap: little to save
    MAX_SLOTS = 64  # every take scans them all
    SLACK = 2  # a free slot up to this many times the size wanted is used rather than making a tighter one

    def __init__(self, capacity: int, huge_pages: bool = False) -> None:
        if capacity and _storage_use_count is None:
            logger.warning("this torch cannot count a storage's users: received tensors are not pooled")
            capacity = 0
        self.capacity = capacity
        self.huge_pages = huge_pages
        self._slots: list[_Slot] = []
        self._lock = threading.Lock()
        # pooled: results served from a slot; fresh: results the pool had no room for (or larger than all of it);
        # made / dropped: slots made, and idle slots dropped to make room
        self.stats = {"pooled": 0, "fresh": 0, "made": 0, "dropped": 0}

    @property
    def held(self) -> int:
        """Bytes the slots hold (in use or idle)."""
        with self._lock:
            return sum(s.nbytes for s in self._slots)

    def slots(self) -> list[tuple[int, int, bool]]:
        """(address, bytes, free) of every slot, for tests and diagnostics."""
        with self._lock:
            return [(s.addr, s.nbytes, s.free()) for s in self._slots]

    def forget(self, result: torch.Tensor) -> None:
        """Take the slot ``result`` lives in (if any) out of the pool: never served again, freed with the result."""
        with self._lock:
            self._slots = [s for s in self._slots if s.addr != result.data_ptr()]

    def take(self, dtype: torch.dtype, shape: Sequence[int], nbytes: int) -> tuple[torch.Tensor, bool] | None:
        """A contiguous tensor of ``dtype`` and ``shape`` (``nbytes`` bytes) in a free slot, and whether its pages are
        all mapped already (False for a new slot: the caller's writes fault them in); or None: too small or too large
        to pool, or no room for it (then the caller allocates a fresh tensor)."""
        if nbytes < self.MIN_BYTES or not self.capacity:
            return None
        with self._lock:
            slot = self._find(nbytes) if nbytes <= self.capacity else None
            if slot is None:
                self.stats["fresh"] += 1
                return None
            slot.last_used = time.monotonic()
            self.stats["pooled"] += 1
            warm, slot.warm = slot.warm, True
            return slot.serve(dtype, shape, nbytes), warm

    def _find(self, nbytes: int) -> _Slot | None:
        """The smallest free slot that fits (within SLACK), else a new one if room can be made; under the lock."""
        free = [s for s in self._slots if s.free()]
        fits = [s for s in free if nbytes <= s.nbytes <= nbytes * self.SLACK]
        if fits:
            return min(fits, key=lambda s: s.nbytes)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        held = sum(s.nbytes for s in self._slots)
        in_use = held - sum(s.nbytes for s in free)
        if in_use + size > self.capacity or len(self._slots) - len(free) >= self.MAX_SLOTS:
            return None  # results still in use hold the room
        free.sort(key=lambda s: s.last_used)
        while held + size > self.capacity or len(self._slots) >= self.MAX_SLOTS:
            idle = free.pop(0)  # least recently used: its memory goes back to the system
            self._slots.remove(idle)
            held -= idle.nbytes
            self.stats["dropped"] += 1
        slot = self._make(size)
        self._slots.append(slot)
        return slot

    def _make(self, size: int) -> _Slot:
        buf = torch.empty(size, dtype=torch.uint8)
        if self.huge_pages:
            advise_huge_pages(buf)  # before its first fault: 512x fewer of them
        slot = _Slot(buf, time.monotonic())
        slot.idle = _storage_use_count(buf.untyped_storage()._cdata)
        self.stats["made"] += 1
        logger.debug("result pool: made a %d-byte slot (%d slots)", size, len(self._slots) + 1)
        return slot

    def clear(self) -> None:
        """Drop every slot (results still in use keep their memory: it is freed with its last user)."""
        with self._lock:
            self._slots.clear()
