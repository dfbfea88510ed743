"""Host-memory helpers for the pipe's copies in and out of the registered staging areas, and the pool of
memory, faulted in once and reused, that received tensors are served from."""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
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
    pool, whose workers then spin for a while after every copy, stealing the cores the engine and the peer need
    (measured: milliseconds of wake-up latency per frame on 2 cores). Anything involving a GPU: ``copy_``, which
    synchronises, so the bytes are in place when it returns.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src)


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
    """Host byte buffers kept from use to use, faulted in once: on this kind of host, fresh pages for every KV-sized
    transfer cost more than the copies into them (measured inside vLLM: 20-90 ms for 32 MiB, 50-500 ms for
    128 MiB). ``get`` hands a buffer to one user, ``put`` takes it back; at most ``keep`` idle buffers are kept."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes: the smallest idle one that fits, else a new one."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        buf = torch.empty(nbytes, dtype=torch.uint8)
        prefault(buf)  # no huge pages: compacting memory for them stalled for milliseconds per MiB here
        return buf

    def put(self, buf: torch.Tensor) -> None:
        """Give ``buf`` back for reuse (only if nothing may still write into it)."""
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


# torch's count of the owners of a storage (tensors and views using it, DLPack capsules, numpy arrays...): private,
# so a torch without it gets no pool rather than a wrong one.
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass(eq=False)
class _Slot:
    """One block of the pool (mapped once a receive filled it). Only the pool holds ``storage``; every result served
    from it is a tensor on that storage, so the slot is in use for as long as any tensor, view or slice of a result
    (or the storage object itself) is alive anywhere."""

    storage: torch.UntypedStorage
    addr: int
    nbytes: int
    last_used: float
    warm: bool = False  # a receive has filled it: every page is mapped
    idle: tuple[int, int] = (0, 0)  # (uses, refs) while only the pool holds the storage (measured when made)

    def users(self) -> tuple[int, int]:
        """torch's use count of the storage (tensors, views, capsules, arrays on it) and Python's reference count
        of the storage object (a caller may hold the storage itself)."""
        return _storage_use_count(self.storage._cdata), sys.getrefcount(self.storage)

    def free(self) -> bool:
        uses, refs = self.users()
        return uses <= self.idle[0] and refs <= self.idle[1]

    def lost(self) -> bool:
        """The storage no longer owns our memory (e.g. ``share_memory_()`` moved a result to shared memory, which
        another process may now use): never serve from it again."""
        return self.storage.data_ptr() != self.addr or self.storage.nbytes() != self.nbytes


class ResultPool:
    """Host memory, kept mapped, that ``recv_tensor()`` results are served from (one pool per pipe endpoint).

    A fresh result's page faults cost about as much as receiving the bytes (measured on 2 cores: 64 MiB copied into
    fresh memory 30 ms, into mapped memory 10 ms; 64 MiB received fresh without huge pages ~42 ms, into mapped memory
    ~33 ms). So results of at least ``MIN_BYTES`` live in *slots*, faulted in once and reused once a result is
    dropped: a slot is reused only while nothing but the pool references its storage (torch's use count of it, and
    Python's of the storage object), so a result still referenced, also through a view, a slice or its storage, is
    never overwritten. Slots are made on demand, sized to the tensor, and all of them together hold at most
    ``capacity`` bytes; idle slots are dropped, least recently used first, to make room. A result that fits nowhere is
    left to the caller to allocate (``take`` returns None). Thread-safe.

    A new slot is faulted in by the receive it is made for, as a fresh result would be, not before: faulting 64 MiB
    in first took 8-15 ms, and a sender waits only ``OFFER_WAIT`` (20 ms) for a zero-copy offer, so a slot made
    ahead of the offer sent that first tensor through the ring instead (one more copy).
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
            return torch.empty(0, dtype=dtype).set_(slot.storage, 0, tuple(shape)), warm

    def _find(self, nbytes: int) -> _Slot | None:
        """The smallest free slot that fits (within SLACK), else a new one if room can be made; under the lock."""
        for slot in [s for s in self._slots if s.lost()]:
            self._slots.remove(slot)
            logger.debug("result pool: a %d-byte slot's memory was taken over (e.g. share_memory_): forgotten",
                         slot.nbytes)
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
        slot = _Slot(buf.untyped_storage(), buf.data_ptr(), size, time.monotonic())
        del buf  # from now on the slot's storage object is the only owner of the memory
        slot.idle = slot.users()
        self.stats["made"] += 1
        logger.debug("result pool: made a %d-byte slot (%d slots)", size, len(self._slots) + 1)
        return slot

    def clear(self) -> None:
        """Drop every slot (results still in use keep their memory: it is freed with its last user)."""
        with self._lock:
            self._slots.clear()
