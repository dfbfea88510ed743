"""Pull mode (``PullTransfer``): the producer saves each finished prompt's KV into its SimpleBuffer, keyed by the
prompt's tokens; the consumer's load takes from the producer that holds it only the blocks it lacks, receives them
into a pooled buffer (never into the KV cache, unless ``receive_into_cache``), copies them into the request's blocks
and may check them against the producer's digests. Each consumer rank reads its KV heads from the producer ranks
that hold them. Which blocks move, deadlines: docs/architecture.md (Which blocks move, Concurrent loads); TP:
docs/deployment.md (Tensor parallelism).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kv_connector import prompt_blocks as blocks
from kv_connector.cache import block_copy
from kv_connector.cache.heads import HeadSplit, Piece
from kv_connector.cache.layout import KVCacheLayout, LayoutMismatch
from kv_connector.cache.pinned import ArenaFull
from kv_connector.cache.staging import CacheSuspended, KVStaging, Staged
from kv_connector.metadata import LeaseRelease, LoadRequest, LookupRequest, SaveRequest
from kv_connector.source import LoadSource
from kv_connector.stats import StatsRecorder
from kv_connector.worker import digest
from kv_connector.worker.digest import DigestMismatch, Sampler
from kv_connector.worker.links import PeerLinks
from kv_connector.worker.transfer import KVMiss, KVTransfer, LoadResult, LoadTamper, Tampered
from kv_lookup_buffer import AnswerAbandoned, BufferClosed, entry_key
from kv_pipe import PipeError, WarmPool

logger = logging.getLogger(f"vllm.{__name__}")
RELEASE_TIMEOUT = 1.0  # seconds a lease's release may wait to be sent (best effort: the lease ends on its own)


def _ready(kv: Staged, sums: torch.Tensor | None, groups: int, context: bytes, secret: bytes) -> Callable[[], None]:
    """Waits for a device gather's copy into host memory, then hashes it into ``sums`` (``digest.pack``ed): once,
    however many shares of the entry are served (MLA, a consumer of another TP size), each from a serving thread."""
    lock, done = threading.Lock(), []

    def ready() -> None:
        kv.wait()
        with lock:
            if sums is not None and not done:
                sums.copy_(digest.pack(digest.block_digests(kv.tensor, groups), context, secret))
                done.append(True)
    return ready


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D integer tensors."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class PullTransfer(KVTransfer):
    """``split``: this worker's TP rank and the KV heads it holds (a request's ``source`` names the producer's pipe
    per rank); ``rank_to_rank`` (push mode, whose pushes go rank to rank, and so does what falls back to pull): every
    producer rank saves, and with equal TP sizes consumer rank r reads producer rank r. ``secret``: the pipes'
    secret, which seals the KV digests (``digest.pack``)."""

    def __init__(self, layout: KVCacheLayout, links: PeerLinks, stats: StatsRecorder, block_size: int,
                 split: HeadSplit, concurrency: int = 1, rank_to_rank: bool = False,
                 staging: KVStaging | None = None, into_cache: bool = False, checks: Sampler | None = None,
                 secret: bytes = b"") -> None:
        self.layout, self.links, self.stats = layout, links, stats
        self.staging = staging or KVStaging(layout.layers, layout.block_dim)
        self.into_cache = into_cache  # receive_into_cache: loads go straight into the (registered) blocks
        self.checks = checks or Sampler("sampled", 16)  # which loads are checked; the producer hashes unless "off"
        self.secret = secret
        # a digest per head of each block where a block holds its heads first: a consumer of another TP size checks
        # the heads it loads
        self.digest_groups = layout.heads[1] - layout.heads[0] if layout.heads_split else 1
        self.block_size = block_size
        self.split = split
        self.rank = split.rank
        self.rank_to_rank = rank_to_rank
        self._pieces: ThreadPoolExecutor | None = None  # a load's pieces from several producer ranks, in parallel
        self.tamper: LoadTamper | None = None  # tests only (harness/tamper.py)
        self.scratch = WarmPool(keep=1)  # producer: gathers land here, then the buffer copies them (both warm)
        # consumer, host cache: one receive buffer per load in flight (a device cache's come from the staging's
        # pinned arena: copied onto the device without waits)
        self.receive = WarmPool(keep=concurrency)
        self.buffer = links.producer_buffer  # producer: the entries every consumer takes from
        self._lock = threading.Lock()
        self._quarantined: list[tuple[threading.Event, torch.Tensor]] = []  # (landed, buffer) of abandoned receives

    # ---------------------------------------------------------------- producer
    def finish_prompt(self, save: SaveRequest) -> None:
        assert self.buffer is not None, "only a producer saves"
        if not self.split.saves and not self.rank_to_rank:  # another rank holds the same KV (MLA) and saves it
            return
        start = time.perf_counter()
        nbytes = self.layout.kv_bytes(len(save.block_ids))
        scratch = None if self.staging.on_device else self.scratch.get(nbytes)
        try:
            kv = self._gather(save, scratch)
            # The blocks' digests travel with them (``hidden``): hashed now from a host gather, else once the copy
            # off the device is done (before the entry is served).
            sums = None
            hashing = time.perf_counter()
            descriptor = self.layout.descriptor_tensor()
            context = digest.seal_context(entry_key(save.token_ids), descriptor) if self.secret else b""
            groups = self.digest_groups
            if self.checks.mode != "off" and kv.done is None:
                sums = digest.pack(digest.block_digests(kv.tensor, groups), context, self.secret)
            elif self.checks.mode != "off":
                with torch.inference_mode(False):  # filled by a serving thread: not an inference tensor
                    sums = torch.empty(digest.packed_size(len(save.block_ids), groups, self.secret),
                                       dtype=torch.int64)
            hashed = time.perf_counter() - hashing
            ready = None if kv.done is None else _ready(kv, sums, groups, context, self.secret)
            # A host gather: insert copies it into memory the buffer recycles (two copies into warm pages cost less
            # than one into fresh pages). A device cache's blocks are still being copied into pinned memory: handed
            # over, served once that copy is done. Either way the forward pass never waits for a consumer (full: the
            # oldest entries are evicted).
            self.buffer.insert(torch.tensor(save.token_ids, dtype=torch.int64), None, kv.tensor, descriptor, sums,
                               ready=ready)
        except (BufferClosed, PipeError, ValueError, torch.OutOfMemoryError, ArenaFull, CacheSuspended) as e:
            # never into vLLM's forward pass: the request is served by pull from elsewhere, or recomputed
            logger.warning("MooncakeConnector: dropped the KV of request %s (%d tokens): %s", save.req_id,
                           len(save.token_ids), e)
            self.stats.count("save_dropped")
            return
        finally:
            if scratch is not None:
                self.scratch.put(scratch)
        seconds = time.perf_counter() - start
        self.stats.count("saved")
        self.stats.count("saved_bytes", nbytes)
        self.stats.sample("saves", len(save.token_ids), nbytes, seconds)
        logger.info("MooncakeConnector: saved request %s: %d tokens, %d blocks, %.1f MiB in %.1f ms (digest %.1f ms)",
                    save.req_id, len(save.token_ids), len(save.block_ids), nbytes / 2**20, seconds * 1e3,
                    hashed * 1e3)

    def _gather(self, save: SaveRequest, scratch: torch.Tensor | None) -> Staged:
        """The prompt's blocks, copied out of the cache (from a device: being copied). A device cache's pinned arena
        holds the buffer's entries: when it has no room, the buffer first lets go of the oldest entries nobody holds."""
        try:
            return self.staging.gather(save.block_ids, scratch=scratch, owner=save.req_id)
        except ArenaFull:
            if self.buffer is None or not self.buffer.make_room(self.layout.kv_bytes(len(save.block_ids))):
                raise
        return self.staging.gather(save.block_ids, scratch=scratch, owner=save.req_id)

    # ---------------------------------------------------------------- consumer
    def _plan(self, source: LoadSource) -> list[Piece]:
        """The pieces of each block this rank reads from which producer rank of ``source``."""
        if self.rank_to_rank and source.same_tp:
            return [Piece(self.rank, (0, self.split.span[1] - self.split.span[0]), 0, 1, True)]
        return self.split.plan(len(source.pipes))

    def producers(self, source: LoadSource) -> list[str]:
        """The producer ranks' addresses this rank reads from."""
        return sorted({source.pipes[piece.producer] for piece in self._plan(source)})

    def lookup(self, req: LookupRequest, deadline: float) -> int:
        """How many of the prompt's tokens every producer rank this rank reads from holds (each holds its entry for
        ``req.lease``); raises if one cannot tell by ``deadline``."""
        query = torch.tensor(req.token_ids, dtype=torch.int64)
        held = len(req.token_ids)
        for producer in self.producers(req.source):  # one, unless the two instances run different TP sizes
            agree, _ = self.links.pull_buffer(producer).lookup(query, lease=req.lease,
                                                               lease_seconds=req.lease_seconds,
                                                               timeout=max(deadline - time.monotonic(), 0.001))
            held = min(held, agree)
            if not held:
                break
        return held

    def release(self, release: LeaseRelease) -> None:
        for producer in self.producers(release.source):
            self.links.pull_buffer(producer).release(release.lease, timeout=RELEASE_TIMEOUT)

    def load(self, req: LoadRequest, deadline: float) -> LoadResult:
        start = time.perf_counter()
        producers = req.source.pipes
        pieces = self._plan(req.source)
        check = self.checks.due()  # once per load, however many pieces
        if len(pieces) == 1:
            results = [self._load_piece(req, pieces[0], producers, deadline, check)]
        else:  # every piece runs to its end, so that no producer keeps a share nobody takes
            if self._pieces is None:
                self._pieces = ThreadPoolExecutor(max_workers=8, thread_name_prefix="mooncake-kv-piece",
                                                  initializer=self.staging.bind_thread)
            futures = [self._pieces.submit(self._load_piece, req, piece, producers, deadline, check)
                       for piece in pieces]
            errors = [f.exception() for f in futures]
            if any(errors):
                raise next(e for e in errors if e is not None)
            results = [f.result() for f in futures]
        if check and all(checked for _, _, _, checked in results):
            self.stats.count("digest_checks")
        written = min(usable for usable, _, _, _ in results)
        fetched = sum(nbytes for _, nbytes, _, _ in results)
        details = [detail for _, _, detail, _ in results]
        seconds = time.perf_counter() - start
        return LoadResult(written, self.layout.kv_bytes(written), fetched, "pulled",
                          "; ".join(details) if len(details) == 1 else
                          f"{len(details)} producer ranks in {seconds * 1e3:.1f} ms: " + "; ".join(details))

    def _load_piece(self, req: LoadRequest, piece: Piece, producers: list[str], deadline: float, check: bool
                    ) -> tuple[int, int, str, bool]:
        """Read ``piece`` of ``req``'s blocks from its producer rank (of ``producers``) into the KV cache: (rows
        usable, bytes fetched, timings, whether its digests were checked); ``check``: then compare what landed with
        the producer's KV digests."""
        start = time.perf_counter()
        n = len(req.block_ids)
        rows = (req.first_block, req.first_block + n)
        count = None if piece.whole else piece.part[1] - piece.part[0]
        query = torch.tensor(req.token_ids, dtype=torch.int64)
        if count is not None and not self.layout.heads_split:
            raise LayoutMismatch(f"the producer runs TP {len(producers)} and this instance TP "
                                 f"{self.split.tp}, but this KV cache's layout cannot take parts of blocks: run both "
                                 "instances with the same tensor_parallel_size")
        wanted = self.layout.kv_bytes(n) // (1 if count is None else self.layout.heads[1] - self.layout.heads[0])
        # Received into a pooled buffer, then copied into the blocks: a receive cut off at the load's deadline leaves
        # the buffer to the writes still on their way (quarantined), never the blocks vLLM recomputes into. With
        # receive_into_cache, straight into the blocks: the load then waits for a stalled receive to end.
        self._reclaim()
        buf = None if self.into_cache else self._receive_buffer(wanted * (count or 1), deadline)
        target = buf if buf is not None else (self.layout.scatter(req.block_ids) if count is None else
                                              self.layout.scatter(req.block_ids, piece.at, count))
        buffer = self.links.pull_buffer(producers[piece.producer])
        try:
            tokens, _, kv, descriptor, sums = buffer.drop_select(
                query, None, key_rows=rows, key_part=None if piece.whole else piece.part, shares=piece.shares,
                key_out=target, timeout=max(deadline - time.monotonic(), 0.001),
                deadline=None if buf is None else deadline, lease=req.lease)
        except AnswerAbandoned as e:
            with self._lock:
                self._quarantined.append((e.landed, buf))
            raise TimeoutError("the producer's answer was still arriving at the load's deadline (load_timeout): "
                               "its late bytes go to a quarantined buffer, never to the KV cache") from None
        # (if drop_select raised otherwise, writes may still land in buf for a while: it is not put back for reuse)
        fetched = time.perf_counter()
        checked, verified = "", False
        try:
            if kv is None:
                raise KVMiss()
            span = self.split.producer_span(len(producers), piece.producer)
            self.layout.check(descriptor, kv, span, count)
            if tokens is None or tokens.dtype != torch.int64 or tokens.dim() != 1:
                raise ValueError("the producer's entry has no valid token ids")
            # the received blocks that hold this prompt's KV (its tokens agree with the prompt's)
            usable = blocks.usable_blocks(req.first_block, len(req.block_ids), req.num_tokens,
                                          common_prefix(query, tokens), kv.shape[0], self.block_size)
            if usable == 0:
                raise KVMiss()
            ids = req.block_ids[:usable]
            in_place = received_in_place = kv.device.type == "meta"  # the rows are in the blocks already
            done = Tampered(kv, ids, not in_place, check)
            if self.tamper is not None:
                done = self.tamper.pulled(req, kv, ids, in_place, count is None, lambda: block_copy.gather(
                    self.layout.layers, self.layout.block_dim, ids)) or done
            if done.write:
                heads = None if count is None else (piece.at, piece.at + count)
                self.staging.scatter(done.ids, done.kv[:usable], heads)
            copied = time.perf_counter()
            if check and done.check:
                verified = self.verify(req, sums, usable, tokens, descriptor, None if piece.whole else piece.part,
                                       piece.at, span[1] - span[0])
                checked = f", digest check {(time.perf_counter() - copied) * 1e3:.1f} ms"
        finally:
            if buf is not None and not self.staging.on_device:
                self.receive.put(buf)  # the pipe is done with it: the receive completed (an arena's: freed with it)
        where = ("received into the KV cache blocks" if received_in_place
                 else f"copy into the KV cache {(copied - fetched) * 1e3:.1f} ms") + checked
        source = "" if piece.whole else f"heads {piece.part[0]}-{piece.part[1] - 1} of producer rank {piece.producer}: "
        return (usable, kv.numel() * kv.element_size(), f"{source}fetch {(fetched - start) * 1e3:.1f} ms, {where}",
                verified)

    def verify(self, req: LoadRequest, sums: torch.Tensor | None, usable: int, tokens: torch.Tensor | list[int],
               descriptor: torch.Tensor | None, part: tuple[int, int] | None = None, at: int = 0,
               producer_heads: int = 1) -> bool:
        """Read the first ``usable`` blocks ``req`` loaded back from the KV cache and compare their digests with the
        producer's ``sums`` (``digest.pack``ed, of the whole entry, whose tokens are ``tokens`` and layout
        ``descriptor``; pulled or pushed): True if they match, False if they could not be checked (no usable
        digests under ``sampled``: counted; a producer's digest per block for a part of blocks: counted),
        ``DigestMismatch`` if they differ or cannot be checked under ``always``. ``part``: the load wrote heads
        ``part`` of the producer rank's blocks only (of its ``producer_heads``), into ours from head ``at`` (a
        consumer of another TP size: one call per piece; only the piece at head 0 counts what is counted once per
        load). A block id that comes
        more than once is vLLM's null block, padding the positions a sliding window skips: written once per
        position, never read, not checked."""
        first_piece = at == 0
        loaded = req.block_ids[:usable]
        seen = Counter(loaded)
        positions = [i for i, block in enumerate(loaded) if seen[block] == 1]
        ids = [loaded[i] for i in positions]
        if sums is not None and self.tamper is not None and part is None:
            sums = self.tamper.expected(req, sums, positions, lambda heads: self._landed(ids, heads))
        try:
            if sums is None:
                raise digest.DigestUnusable("the producer sent no KV digests (its kv_digest is \"off\")")
            context = digest.seal_context(entry_key(tokens), descriptor) if self.secret else b""
            expected = digest.unpack(sums, context, self.secret)  # the seal first: nothing below trusts the rest
            groups = expected.shape[1]
            if part is None and groups != self.digest_groups:
                raise digest.DigestUnusable(f"the producer's KV digests come in groups of {groups}, this layout's "
                                            f"in {self.digest_groups}")
            if part is not None and groups == 1 < producer_heads:  # a digest per block of several heads: a part of
                # each block cannot be checked; said
                if first_piece:
                    self.stats.count("digest_unchecked")
                if self.checks.mode == "always":
                    raise DigestMismatch("the producer sent a KV digest per block: a part of each block, loaded "
                                         "here, cannot be checked (kv_digest \"always\")")
                return False
            if part is not None and (groups != producer_heads or part[1] > groups):
                raise digest.DigestUnusable(f"the producer's KV digests come in groups of {groups} per block, its "
                                            f"rank holds {producer_heads} heads")
        except digest.DigestUnusable as e:  # none, another release's, unsealed: nothing to compare with
            if first_piece:
                self.stats.count("digest_missing")
            if self.checks.mode == "sampled":
                logger.warning("MooncakeConnector: request %s: %s: not checked (kv_digest \"always\" fails such "
                               "loads)", req.req_id, e)
                return False
            raise DigestMismatch(f"no KV digest to check (kv_digest \"always\"): {e}") from None
        except DigestMismatch:
            self.stats.count("digest_mismatches")
            raise
        heads = None if part is None and groups == 1 else (at, at + (groups if part is None else part[1] - part[0]))
        wrong = digest.compare(expected, self._landed(ids, heads), req.first_block, positions, part)
        if wrong is not None:
            self.stats.count("digest_mismatches")
            raise DigestMismatch(f"KV digest mismatch: {wrong}")
        return True

    def _receive_buffer(self, nbytes: int, deadline: float) -> torch.Tensor:
        pinned = self.staging.host(nbytes, max(deadline - time.monotonic(), 0.0))
        return pinned if pinned is not None else self.receive.get(nbytes)

    def _landed(self, ids: list[int], heads: tuple[int, int] | None) -> torch.Tensor:
        """The digests of blocks ``ids`` as they lie in the KV cache (all heads of each, or ``heads``)."""
        if self.staging.on_device:
            landed = self.staging.readback(ids)
            rows = landed if heads is None else landed[:, :, heads[0]:heads[1]]
            return digest.block_digests(rows, 1 if heads is None else heads[1] - heads[0])
        return digest.cache_digests(self.layout.layers, self.layout.block_dim, ids, heads)

    def _reclaim(self) -> None:
        """Give the buffers of abandoned receives back to the pool once nothing more can land in them."""
        with self._lock:
            landed = [buf for done, buf in self._quarantined if done.is_set()]
            self._quarantined = [(done, buf) for done, buf in self._quarantined if not done.is_set()]
        for buf in landed:
            if not self.staging.on_device:
                self.receive.put(buf)

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """The buffers belong to the links (closed with them)."""
        if self._pieces is not None:
            self._pieces.shutdown(wait=False, cancel_futures=True)
