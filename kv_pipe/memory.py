"""Host-memory helpers for the pipe's copies in and out of the registered staging areas."""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading

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
