"""The KV pool on a worker (``KVPool``): this rank's blocks into and out of Mooncake Store through
``kv_lookup_buffer.MooncakeStore``. An object is one block of this rank's KV (every layer, the heads it holds),
block-major as everywhere else (``cache.layout``), under a key of its namespace (what the bytes depend on besides the
tokens: the layout descriptor, so the model, dtype, block shape, KV heads and scales; and ``pool_namespace``) and
the chained hash of its tokens. The same prefix computed on any instance of the same model and layout is one object;
MLA's KV, alike on every rank, is stored by the first rank only and read by all.

Saves run in a thread of their own: the blocks of an ended request, held by vLLM until they are copied out, are
checked against the pool (what is there is skipped), gathered into host memory registered with the store (a device
cache's through its pinned arena), reported copied (vLLM frees them), then put. Loads and lookups run in the loader
and lookup threads the pipe's use. Every call has a deadline; a pool that is down or slow costs a request its
timeout, never a hang, and what it could not load is computed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kv_connector.cache.heads import HeadSplit
from kv_connector.cache.layout import KVCacheLayout
from kv_connector.cache.pinned import ArenaFull, PinnedArena
from kv_connector.cache.staging import CacheSuspended, KVStaging
from kv_connector.metadata import LoadRequest, PoolSave
from kv_connector.stats import StatsRecorder
from kv_connector.worker.transfer import KVMiss, LoadResult
from kv_lookup_buffer import TAG, MooncakeStore, StoreError, StoreTimeout, block_keys

logger = logging.getLogger(f"vllm.{__name__}")
SAVE_TIMEOUT = 10.0  # seconds each store call of a save may take (it runs off the forward path)
SAVE_ROOM_WAIT = 2.0  # seconds a save waits for room in the host memory before it is dropped
CHUNK_BYTES = 64 << 20  # a save moves at most this much per store call (and per piece of host memory)
# a load fetches pieces of this size, the next one while the last is copied into the cache (measured on kv32k's 4 MiB
# blocks: pieces of 4 blocks kept the engine busy; a get costs ~1 ms besides its bytes)
LOAD_PIECE_BYTES = 16 << 20
FETCHERS = 8  # pieces fetched at once, all loads together (each load has one in flight ahead of its copy)
FAILED_KEPT = 4096  # requests whose loads failed, remembered so that their blocks are never stored


def pool_namespace(layout: KVCacheLayout, extra: str = "") -> str:
    """The part of a block's key that is not its tokens (``layout.descriptor``, ``pool_namespace``)."""
    text = json.dumps(layout.descriptor, sort_keys=True) + "\0" + extra
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class KVPool:
    """``store``: the pool's client (this rank's); ``memory_bytes``: host memory to stage puts and gets through
    (mooncake.json's ``local_buffer_size``; a device cache's pinned arena instead)."""

    def __init__(self, store: MooncakeStore, layout: KVCacheLayout, staging: KVStaging, split: HeadSplit,
                 block_size: int, stats: StatsRecorder, memory_bytes: int, namespace: str = "") -> None:
        self.store, self.layout, self.staging, self.split = store, layout, staging, split
        self.block_size, self.stats = block_size, stats
        self.namespace = pool_namespace(layout, namespace)
        self.memory = staging.arena if staging.arena is not None else PinnedArena(memory_bytes, pinned=False)
        store.register(self.memory.memory)
        self.chunk_blocks = max(1, min(CHUNK_BYTES, self.memory.capacity // 2) // layout.row_bytes)
        self.load_blocks = max(1, min(LOAD_PIECE_BYTES, self.memory.capacity // 4) // layout.row_bytes)
        self._fetches = ThreadPoolExecutor(max_workers=FETCHERS, thread_name_prefix="mooncake-pool-fetch")
        self._saves = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-pool-save",
                                         initializer=staging.bind_thread)
        self._copying: dict[str, threading.Event] = {}  # request -> set once its blocks are copied out
        self._failed: OrderedDict[str, None] = OrderedDict()  # requests whose loads failed: never stored
        self._lock = threading.Lock()

    def keys(self, tokens: list[int], first: int = 0, count: int | None = None) -> list[str]:
        return block_keys(self.namespace, tokens, self.block_size, first, count)

    # ---------------------------------------------------------------- lookups (a lookup thread)
    def lookup(self, tokens: list[int], deadline: float) -> int:
        """Tokens of ``tokens`` (whole blocks from the start) the pool holds for this rank."""
        keys = self.keys(tokens)
        if not keys:
            return 0
        return self.store.contains(keys, timeout=max(deadline - time.monotonic(), 0.001)) * self.block_size

    # ---------------------------------------------------------------- loads (a loader thread)
    def load(self, req: LoadRequest, deadline: float) -> LoadResult:
        """Write the pool's blocks of ``req`` into its blocks, a piece at a time: the next piece is fetched and
        checked while this one is copied into the cache. The first block that is missing or fails its check ends the
        load there (``LoadResult.written``; the rest is computed). ``KVMiss``: none."""
        start = time.perf_counter()
        n = len(req.block_ids)
        keys = self.keys(req.token_ids, req.first_block, n)
        parts = [keys[lo:lo + self.load_blocks] for lo in range(0, len(keys), self.load_blocks)]
        written, waited, copying = 0, 0.0, 0.0
        pending = self._fetches.submit(self._fetch, parts[0], deadline) if parts else None
        for i, part in enumerate(parts):
            assert pending is not None
            asked = time.perf_counter()
            try:
                got, rows, piece = pending.result(timeout=max(deadline - time.monotonic(), 0.001))
            except FutureTimeout:
                raise TimeoutError("the pool did not answer by the load's deadline (load_timeout)") from None
            arrived = time.perf_counter()
            pending = self._fetches.submit(self._fetch, parts[i + 1], deadline) \
                if got == len(part) and i + 1 < len(parts) else None
            if got:
                self.staging.scatter(req.block_ids[written:written + got], rows[:got])
            del rows, piece  # back to the arena
            waited, copying = waited + arrived - asked, copying + time.perf_counter() - arrived
            written += got
            if got < len(part):
                break
        if not written:
            self.stats.count("pool_load_misses")
            raise KVMiss()
        nbytes = self.layout.kv_bytes(written)
        self.stats.count("pool_loaded_bytes", nbytes)
        seconds = time.perf_counter() - start
        return LoadResult(written, nbytes, 0, "pool", f"from the pool: {written} of {n} blocks in {len(parts)} "
                          f"piece(s), {seconds * 1e3:.1f} ms: waiting for gets and checks {waited * 1e3:.1f} ms, "
                          f"copies into the KV cache {copying * 1e3:.1f} ms")

    def _fetch(self, keys: list[str], deadline: float) -> tuple[int, torch.Tensor, Any]:
        """Get and check the objects of ``keys`` into host memory: how many arrived whole and checked, the rows,
        and the piece of memory holding them."""
        piece = self.memory.take(len(keys) * self.layout.row_bytes, max(deadline - time.monotonic(), 0.0))
        rows = piece.view([len(keys), len(self.layout.layers), *self.layout.descriptor["block"]],
                          self.layout.layers[0].dtype)
        try:
            got = self.store.get_into(keys, rows, timeout=max(deadline - time.monotonic(), 0.001))
        except StoreTimeout as e:
            self._keep_until(piece, e)
            raise TimeoutError(f"the pool did not answer by the load's deadline: {e}") from None
        return got, rows, piece

    @staticmethod
    def _keep_until(piece: object, stuck: StoreTimeout) -> None:
        """A get that outlived its caller may still write into ``piece``: it goes back only once the call ended."""
        stuck.done.add_done_callback(lambda _: piece)

    def load_failed(self, req_ids: set[str]) -> None:
        """Loads of these requests failed (or wrote only some blocks): their blocks are never stored."""
        with self._lock:
            for req_id in req_ids:
                self._failed[req_id] = None
            while len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)

    # ---------------------------------------------------------------- saves (the forward thread queues them)
    def save(self, save: PoolSave) -> None:
        """After a step's forward pass. A prompt just computed (``in_step``) is copied out now (its blocks are the
        running request's: the next step may write after them, never into them) and put in the background; an ended
        request's held blocks are copied out and put in the background, then reported copied."""
        copied = threading.Event()
        with self._lock:
            failed = save.req_id in self._failed
            if not save.in_step:
                self._failed.pop(save.req_id, None)
                self._copying[save.req_id] = copied
        if failed or not self.split.saves:  # nothing to store: a failed load's blocks, or another rank's (MLA)
            copied.set()
            return
        if not save.in_step:
            self._saves.submit(self._save, save, copied)
            return
        try:
            keys, staged = self._copy_out(save, wait=False)
        except (ArenaFull, CacheSuspended, ValueError) as e:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not copy the KV of request %s out for the pool: %s", save.req_id, e)
            return
        self._saves.submit(self._put, save, keys, staged, time.perf_counter())

    def copied(self, req_id: str) -> bool:
        """Whether the blocks of ``req_id`` are free to go (copied out, or never to be): forgotten once they are."""
        with self._lock:
            event = self._copying.get(req_id)
            if event is None or event.is_set():
                self._copying.pop(req_id, None)
                return True
            return False

    def _copy_out(self, save: PoolSave, wait: bool = True, skip: list[bool] | None = None
                  ) -> tuple[list[str], list[tuple[list[int], torch.Tensor, Any]]]:
        """The blocks of ``save`` from ``first_block`` (but those ``skip`` says the pool holds) copied into host
        memory registered with the store, an object each (a block, then room for its tag), a chunk at a time: their
        keys, and (positions, objects, what holds their memory) per chunk. A device cache's copies are queued
        (``wait``: waited for here)."""
        keys = self.keys(save.token_ids, save.first_block)
        ids = save.block_ids[save.first_block:save.first_block + len(keys)]
        todo = [i for i in range(len(keys)) if skip is None or not skip[i]]
        row, slot = self.layout.row_bytes, self.layout.row_bytes + TAG
        out = []
        for lo in range(0, len(todo), self.chunk_blocks):
            part = todo[lo:lo + self.chunk_blocks]
            piece = self.memory.take(len(part) * slot, SAVE_ROOM_WAIT if wait else 0.0)
            slots = piece.tensor[:len(part) * slot].view(len(part), slot)
            if self.staging.on_device:  # gathered into pinned memory, then into the objects (in the save thread)
                out.append((part, slots, (piece, self.staging.gather([ids[i] for i in part], owner=save.req_id))))
            else:
                for i, block in enumerate(part):
                    self.staging.gather([ids[block]], scratch=slots[i, :row])
                out.append((part, slots, (piece, None)))
        return keys, out

    def _save(self, save: PoolSave, copied: threading.Event) -> None:
        """An ended request's held blocks: those the pool lacks copied out, reported copied, then put."""
        start = time.perf_counter()
        try:
            keys = self.keys(save.token_ids, save.first_block)
            there = self.store.present(keys, timeout=SAVE_TIMEOUT)
            keys, staged = self._copy_out(save, skip=there)
            self._finish_copies(staged)
        except (StoreError, ArenaFull, CacheSuspended, ValueError) as e:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not store the KV of request %s in the pool: %s", save.req_id, e)
            return
        except Exception:
            self.stats.count("pool_save_errors")
            logger.exception("MooncakeConnector: storing the KV of request %s in the pool failed unexpectedly",
                             save.req_id)
            return
        finally:
            copied.set()  # vLLM may reuse the blocks now
        self._put(save, keys, staged, start, copied_out=True)

    def _finish_copies(self, staged: list[tuple[list[int], torch.Tensor, Any]]) -> None:
        """A device cache's gathers: wait for each, then lay it out as objects."""
        row = self.layout.row_bytes
        for part, slots, (_piece, gathered) in staged:
            if gathered is not None:
                gathered.wait()
                slots[:, :row].copy_(gathered.tensor.reshape(len(part), -1).view(torch.uint8))

    def _put(self, save: PoolSave, keys: list[str], staged: list[tuple[list[int], torch.Tensor, Any]], start: float,
             copied_out: bool = False) -> None:
        """Put the objects copied out (skipping those the pool holds by now, for a prompt copied out in its step)."""
        stored = 0
        try:
            if not copied_out:
                self._finish_copies(staged)
                there = self.store.present(keys, timeout=SAVE_TIMEOUT)
                staged = [(part, slots, holder) for part, slots, holder in staged
                          if not all(there[i] for i in part)]
            for part, slots, holder in staged:
                try:
                    stored += self.store.put([keys[i] for i in part], slots, timeout=SAVE_TIMEOUT)
                except StoreTimeout as e:  # the put may still read its objects: they are kept until it ended
                    self._keep_until(holder, e)
                    raise
        except (StoreError, ArenaFull, CacheSuspended, ValueError) as e:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not store the KV of request %s in the pool: %s", save.req_id, e)
        except Exception:
            self.stats.count("pool_save_errors")
            logger.exception("MooncakeConnector: storing the KV of request %s in the pool failed unexpectedly",
                             save.req_id)
        seconds = time.perf_counter() - start
        nbytes = self.layout.kv_bytes(stored)
        if stored:
            self.stats.count("pool_saved_blocks", stored)
            self.stats.count("pool_saved_bytes", nbytes)
            self.stats.sample("pool_saves", stored * self.block_size, nbytes, seconds)
        logger.debug("MooncakeConnector: pool save of request %s (%s): %d blocks stored in %.1f ms", save.req_id,
                     "its prompt" if save.in_step else "ended", stored, seconds * 1e3)

    def close(self) -> None:
        self._saves.shutdown(wait=False, cancel_futures=True)
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self.store.close()
