"""The KV pool on a worker (``KVPool``): this rank's blocks into and out of Mooncake Store through
``kv_lookup_buffer.MooncakeStore``. An object is one block of this rank's KV (every layer, the heads it holds),
block-major as everywhere else (``cache.layout``), under a key of its namespace (what the bytes depend on besides the
tokens: the layout descriptor, the model's quantization and revision, ``pool_namespace``) and the chained hash of
its tokens. The same prefix computed on any instance of the same model and layout is one object; MLA's KV, alike on
every rank, is stored by the first rank only and read by all.

Memory: host memory of the pool's own (``local_buffer_size``, pinned for a device cache), registered with the store:
gets land there and puts go from there. What is checked is never that memory (the engine serves registered memory to
whoever reaches it): a host cache's blocks are checked once copied into them (a block that fails is one vLLM
computes again), a device cache's objects in a copy of their own before they go to the device.

Saves: copies out of the cache never wait for the pool (an ended request's held blocks are copied out first and
reported copied, then put); puts run one at a time in the background, at most ``MAX_PUTS`` waiting (more are
dropped), and none for ``SAVE_BACKOFF`` seconds after one met a pool that did not answer. Every call has a deadline;
a pool that is down or slow costs a request its timeout, never a hang, and what it could not load is computed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from kv_connector.cache import block_copy
from kv_connector.cache.heads import HeadSplit
from kv_connector.cache.layout import KVCacheLayout
from kv_connector.cache.pinned import ArenaFull, PinnedArena
from kv_connector.cache.staging import CacheSuspended, KVStaging, Staged
from kv_connector.metadata import LoadRequest, PoolSave
from kv_connector.stats import StatsRecorder
from kv_connector.worker.transfer import KVMiss, LoadResult
from kv_lookup_buffer import TAG, Fetched, MooncakeStore, StoreError, StoreTimeout, block_keys

logger = logging.getLogger(f"vllm.{__name__}")
SAVE_TIMEOUT = 10.0  # seconds each store call of a save may take (it runs off the forward path)
SAVE_ROOM_WAIT = 2.0  # seconds a held request's copy-out waits for room in the host memory before it is dropped
SAVE_BACKOFF = 5.0  # seconds no put goes out after one met a pool that did not answer in time
MAX_PUTS = 16  # saves copied out and waiting for their put; a save beyond them is dropped (counted)
CHUNK_BYTES = 64 << 20  # a save moves at most this much per store call (and per piece of host memory)
# a load fetches pieces of this size, the next one while the last is checked and copied into the cache: small enough
# to overlap, large enough that a get's fixed cost is small beside its bytes
LOAD_PIECE_BYTES = 16 << 20
FETCHERS = 8  # pieces fetched at once, all loads together (each load has one in flight ahead of its copy)
FAILED_KEPT = 4096  # requests whose loads failed, remembered so that their blocks are never stored

Staging = list[tuple[list[int], torch.Tensor, Any]]  # per chunk: positions in its keys, objects, what holds them


def pool_namespace(layout: KVCacheLayout, extra: str = "") -> str:
    """The part of a block's key that is not its tokens (``layout.descriptor``, ``pool_namespace``)."""
    text = json.dumps(layout.descriptor, sort_keys=True) + "\0" + extra
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class KVPool:
    """``store``: the pool's client (this rank's); ``memory_bytes``: host memory to stage puts and gets through
    (mooncake.json's ``local_buffer_size``)."""

    def __init__(self, store: MooncakeStore, layout: KVCacheLayout, staging: KVStaging, split: HeadSplit,
                 block_size: int, stats: StatsRecorder, memory_bytes: int, namespace: str = "") -> None:
        self.store, self.layout, self.staging, self.split = store, layout, staging, split
        self.block_size, self.stats = block_size, stats
        self.namespace = pool_namespace(layout, namespace)
        self.memory = PinnedArena(memory_bytes, pinned=staging.on_device)
        store.register(self.memory.memory)
        self.chunk_blocks = max(1, min(CHUNK_BYTES, self.memory.capacity // 2) // layout.row_bytes)
        self.load_blocks = max(1, min(LOAD_PIECE_BYTES, self.memory.capacity // 4) // layout.row_bytes)
        # a host cache whose blocks lie whole in each layer: what a get brought is copied into the blocks and
        # checked there; else it is copied out of the registered memory into memory the store does not know, checked
        # there, and copied into the cache from there
        self.check_in_cache = layout.on_host and layout.block_dim == 0
        self.private = PinnedArena(0 if self.check_in_cache else min(FETCHERS * LOAD_PIECE_BYTES, memory_bytes),
                                   pinned=staging.on_device)
        self._fetches = ThreadPoolExecutor(max_workers=FETCHERS, thread_name_prefix="mooncake-pool-fetch")
        self._copies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-pool-copy",
                                          initializer=staging.bind_thread)
        self._puts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-pool-put",
                                        initializer=staging.bind_thread)
        self._copying: dict[str, Future[None]] = {}  # held request -> its copy out of the cache
        self._failed: OrderedDict[str, None] = OrderedDict()  # requests whose loads failed: never stored
        self._waiting_puts = 0
        self._quiet_until = 0.0  # no put before this (time.monotonic()): the pool did not answer a moment ago
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
        """Write the pool's blocks of ``req`` into its blocks, a piece at a time: the next piece is fetched while this
        one is copied out of the registered memory, checked and copied into the cache. The first block that is missing
        or fails its check ends the load there (``LoadResult.written``; the rest is computed). ``KVMiss``: none."""
        start = time.perf_counter()
        n = len(req.block_ids)
        keys = self.keys(req.token_ids, req.first_block, n)
        parts = [keys[lo:lo + self.load_blocks] for lo in range(0, len(keys), self.load_blocks)]
        written, waited, checking, copying = 0, 0.0, 0.0, 0.0
        pending = self._fetches.submit(self._fetch, parts[0], deadline) if parts else None
        try:
            for i, part in enumerate(parts):
                assert pending is not None
                asked = time.perf_counter()
                try:
                    fetched, landing = pending.result(timeout=max(deadline - time.monotonic(), 0.001))
                except FutureTimeout:
                    raise TimeoutError("the pool did not answer by the load's deadline (load_timeout)") from None
                pending = self._fetches.submit(self._fetch, parts[i + 1], deadline) \
                    if fetched.arrived and i + 1 < len(parts) else None
                arrived = time.perf_counter()
                ids = req.block_ids[written:written + len(part)]
                if self.check_in_cache:  # copied into the blocks, then checked there (never where the engine writes)
                    self.staging.scatter(ids[:fetched.arrived_count], landing)
                    copied = time.perf_counter()
                    got = fetched.check(where=[[layer[block] for layer in self.layout.layers] for block in ids])
                    checked = time.perf_counter()
                else:  # copied out of the registered memory, checked there, then into the cache
                    rows = self.private.take(len(part) * self.layout.row_bytes, max(deadline - time.monotonic(), 0.0)
                                             ).view(list(landing.shape), landing.dtype)
                    got = fetched.check(copy_to=rows)
                    checked = time.perf_counter()
                    if got:
                        self.staging.scatter(ids[:got], rows[:got])
                    copied = time.perf_counter()
                    del rows
                del fetched, landing  # its piece of the registered memory goes back
                waited += arrived - asked
                if self.check_in_cache:
                    copying, checking = copying + copied - arrived, checking + checked - copied
                else:
                    checking, copying = checking + checked - arrived, copying + copied - checked
                written += got
                if got < len(part):
                    break
        finally:
            if pending is not None:  # a piece fetched ahead that is not used: its tag slots go back
                pending.add_done_callback(lambda f: f.exception() is None and f.result()[0].discard())
        if not written:
            self.stats.count("pool_load_misses")
            raise KVMiss()
        nbytes = self.layout.kv_bytes(written)
        self.stats.count("pool_loaded_bytes", nbytes)
        seconds = time.perf_counter() - start
        return LoadResult(written, nbytes, 0, "pool", f"from the pool: {written} of {n} blocks in {len(parts)} "
                          f"piece(s), {seconds * 1e3:.1f} ms: waiting for gets {waited * 1e3:.1f} ms, checks "
                          f"{checking * 1e3:.1f} ms, copies into the KV cache {copying * 1e3:.1f} ms")

    def _fetch(self, keys: list[str], deadline: float) -> tuple[Fetched, torch.Tensor]:
        """Get the objects of ``keys`` into the registered memory (not checked yet: ``load`` copies them out and
        checks the copy, as the engine serves that memory to whoever reaches it)."""
        shape = [len(keys), len(self.layout.layers), *self.layout.descriptor["block"]]
        piece = self.memory.take(len(keys) * self.layout.row_bytes, max(deadline - time.monotonic(), 0.0))
        landing = piece.view(shape, self.layout.layers[0].dtype)
        try:
            return self.store.fetch(keys, landing, timeout=max(deadline - time.monotonic(), 0.001)), landing
        except StoreTimeout as e:
            self._keep_until(piece, e)
            raise TimeoutError(f"the pool did not answer by the load's deadline: {e}") from None

    @staticmethod
    def _keep_until(holder: object, stuck: StoreTimeout) -> None:
        """A call that outlived its caller may still use ``holder``'s memory: it goes back only once the call
        ended."""
        stuck.done.add_done_callback(lambda _: holder)

    def load_failed(self, req_ids: set[str]) -> None:
        """Loads of these requests failed (or wrote only some blocks): their blocks are never stored."""
        with self._lock:
            for req_id in req_ids:
                self._failed[req_id] = None
            while len(self._failed) > FAILED_KEPT:
                self._failed.popitem(last=False)

    # ---------------------------------------------------------------- saves
    def _skipped(self, save: PoolSave) -> bool:
        """Nothing of ``save`` is stored: a failed load's blocks, or another rank's (MLA)."""
        with self._lock:
            failed = save.req_id in self._failed
            if not save.in_step:
                self._failed.pop(save.req_id, None)
        return failed or not self.split.saves

    def hold(self, save: PoolSave) -> None:
        """``start_load_kv``: a request ended and vLLM holds its blocks for this save (vLLM reports held requests
        before ``wait_for_save`` with speculative decoding): its blocks are copied out in the background, reported
        copied (``copied``), then put."""
        if self._skipped(save):
            return
        with self._lock:
            self._copying[save.req_id] = self._copies.submit(self._copy_held, save)

    def save_step(self, save: PoolSave) -> None:
        """``wait_for_save``, after the forward pass: a prompt just computed (``in_step``), copied out now (a device
        cache's copy is queued; the scheduler holds the request's blocks when it ends until it ran), put in the
        background."""
        if self._skipped(save):
            return
        try:
            keys, staged = self._copy_out(save, wait=False)
        except (ArenaFull, CacheSuspended, ValueError) as e:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not copy the KV of request %s out for the pool: %s", save.req_id, e)
            return
        self._queue_put(save, keys, staged, time.perf_counter())

    def copied(self, req_id: str) -> bool:
        """Whether the blocks of ``req_id`` are free to go (copied out, or never to be): forgotten once they are."""
        with self._lock:
            copy = self._copying.get(req_id)
            if copy is None or copy.done():
                self._copying.pop(req_id, None)
                return True
            return False

    def pending(self) -> list[Future[None]]:
        """The copies out of held blocks under way (an idle engine step waits a moment for them, not spins)."""
        with self._lock:
            return [copy for copy in self._copying.values() if not copy.done()]

    def _copy_out(self, save: PoolSave, wait: bool = True) -> tuple[list[str], Staging]:
        """The blocks of ``save`` from ``first_block`` copied into the registered memory, an object each (a block,
        then room for its tag), a chunk at a time: their keys, and (positions, objects, what holds their memory) per
        chunk. A device cache's copies are queued (laid out as objects by ``_finish_copies``)."""
        keys = self.keys(save.token_ids, save.first_block)
        ids = save.block_ids[save.first_block:save.first_block + len(keys)]
        row, slot = self.layout.row_bytes, self.layout.row_bytes + TAG
        out = []
        for lo in range(0, len(keys), self.chunk_blocks):
            part = list(range(lo, min(lo + self.chunk_blocks, len(keys))))
            piece = self.memory.take(len(part) * slot, SAVE_ROOM_WAIT if wait else 0.0)
            slots = piece.tensor[:len(part) * slot].view(len(part), slot)
            if self.staging.on_device:  # gathered into the staging's pinned memory, then into the objects
                gathered: Staged | None = self.staging.gather([ids[i] for i in part], owner=save.req_id)
                out.append((part, slots, (piece, gathered)))
            else:
                for i, block in enumerate(part):
                    self.staging.gather([ids[block]], scratch=slots[i, :row])
                out.append((part, slots, (piece, None)))
        return keys, out

    def _finish_copies(self, staged: Staging) -> None:
        """A device cache's gathers: wait for each, then lay it out as objects, once (a held request's are finished
        before it is reported copied, and its put calls this again): each laid out lets go of its pinned memory."""
        row = self.layout.row_bytes
        for k, (part, slots, (piece, gathered)) in enumerate(staged):
            if gathered is not None:
                gathered.wait()
                slots[:, :row].copy_(gathered.tensor.reshape(len(part), -1).view(torch.uint8))
                staged[k] = (part, slots, (piece, None))

    def _copy_held(self, save: PoolSave) -> None:
        """An ended request's held blocks: copied out (then vLLM may free them), and queued for their put."""
        start = time.perf_counter()
        try:
            keys, staged = self._copy_out(save)
            self._finish_copies(staged)
        except (ArenaFull, CacheSuspended, ValueError) as e:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not copy the KV of request %s out for the pool: %s", save.req_id, e)
            return
        except Exception:
            self.stats.count("pool_save_errors")
            logger.exception("MooncakeConnector: copying the KV of request %s out for the pool failed unexpectedly",
                             save.req_id)
            return
        self._queue_put(save, keys, staged, start)

    def _queue_put(self, save: PoolSave, keys: list[str], staged: Staging, start: float) -> None:
        with self._lock:
            full = self._waiting_puts >= MAX_PUTS
            if not full:
                self._waiting_puts += 1
        if full:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: the KV of request %s is not stored in the pool: %d saves wait for the "
                           "pool already", save.req_id, MAX_PUTS)
            return
        self._puts.submit(self._put, save, keys, staged, start)

    def _put(self, save: PoolSave, keys: list[str], staged: Staging, start: float) -> None:
        """Put the objects copied out, but those the pool holds by now."""
        stored = 0
        try:
            if time.monotonic() < self._quiet_until:
                raise StoreError("the pool did not answer a moment ago")
            self._finish_copies(staged)
            there = self.store.present(keys, timeout=SAVE_TIMEOUT)
            for part, slots, holder in staged:
                missing = [j for j, i in enumerate(part) if not there[i]]  # the objects the pool holds are left out
                for _, lo, n in block_copy.runs(missing):  # each run of them is contiguous: one put
                    try:
                        stored += self.store.put([keys[i] for i in part[lo:lo + n]], slots[lo:lo + n],
                                                 timeout=SAVE_TIMEOUT)
                    except StoreTimeout as e:  # the put may still read its objects: they are kept until it ended
                        self._keep_until(holder, e)
                        raise
        except StoreTimeout as e:
            self._quiet_until = time.monotonic() + SAVE_BACKOFF
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not store the KV of request %s in the pool (%s): no put for "
                           "%.0f s", save.req_id, e, SAVE_BACKOFF)
        except (StoreError, ArenaFull, CacheSuspended, ValueError) as e:
            self.stats.count("pool_save_errors")
            logger.warning("MooncakeConnector: could not store the KV of request %s in the pool: %s", save.req_id, e)
        except Exception:
            self.stats.count("pool_save_errors")
            logger.exception("MooncakeConnector: storing the KV of request %s in the pool failed unexpectedly",
                             save.req_id)
        finally:
            with self._lock:
                self._waiting_puts -= 1
        seconds = time.perf_counter() - start
        nbytes = self.layout.kv_bytes(stored)
        if stored:
            self.stats.count("pool_saved_blocks", stored)
            self.stats.count("pool_saved_bytes", nbytes)
            self.stats.sample("pool_saves", stored * self.block_size, nbytes, seconds)
        logger.debug("MooncakeConnector: pool save of request %s (%s): %d blocks stored in %.1f ms", save.req_id,
                     "its prompt" if save.in_step else "ended", stored, seconds * 1e3)

    def close(self) -> None:
        for pool in (self._copies, self._puts, self._fetches):
            pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()
