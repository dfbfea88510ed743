"""Push mode (``PushTransfer``): the producer streams each layer's newly computed blocks to the consumer while the
prefill runs, then commits the entry; the consumer stages it until the request's load takes it, and copies only the
blocks it lacks into its KV cache. Pull (``PullTransfer``) serves whatever push cannot: an entry the consumer has no
room for, a push that failed, a request the producer never announced.

How loads wait for pushes, and XpYd: docs/architecture.md (Push mode); the messages: docs/wire.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_connector import prompt_blocks as blocks
from kv_connector.cache.layout import KVCacheLayout
from kv_connector.cache.pinned import ArenaFull
from kv_connector.cache.staging import CacheSuspended, KVStaging, Staged
from kv_connector.metadata import LeaseRelease, LoadRequest, LookupRequest, MooncakeConnectorMetadata, SaveRequest
from kv_connector.source import LoadSource, push_link_source
from kv_connector.stats import StatsRecorder
from kv_connector.worker import digest
from kv_connector.worker.digest import BlockHasher
from kv_connector.worker.links import PeerLinks
from kv_connector.worker.pull import PullTransfer
from kv_connector.worker.transfer import KVTransfer, LoadResult
from kv_lookup_buffer import DROPPED, PULL, STAGED, PushedEntry, PushReceiver, PushSender, entry_key

logger = logging.getLogger(f"vllm.{__name__}")
_PREFERRED = {STAGED: 0, PULL: 1, DROPPED: 2}  # which link's news of a key an awaiting load acts on


@dataclass
class _PushState:
    req_id: str
    key: bytes
    num_blocks: int
    push: PushSender  # the link to the consumer it goes to
    next_block: int = 0  # blocks before this one are queued
    hasher: BlockHasher | None = None  # its KV digests (kv_digest not "off"), fed by the sender thread


class PushTransfer(KVTransfer):
    """``default_peer``: producer: the consumer a request without params is pushed to (a consumer takes each request
    from the producer its ``LoadRequest.source`` names)."""

    def __init__(self, layout: KVCacheLayout, links: PeerLinks, pull: PullTransfer, stats: StatsRecorder,
                 block_size: int, rank: int, default_peer: str, push_wait: float,
                 staging: KVStaging | None = None) -> None:
        self.layout, self.links, self.pull, self.stats = layout, links, pull, stats
        self.staging = staging or KVStaging(layout.layers, layout.block_dim)
        self.block_size = block_size
        self.rank, self.default_peer = rank, default_peer
        self.push_wait = push_wait
        self.pushing: dict[str, _PushState] = {}  # producer: requests being pushed
        self.targets: dict[str, PushSender] = {}  # producer: the link each request in flight goes to
        self.step_pushes: list[tuple[_PushState, int, list[int]]] = []  # producer: (entry, first block, ids) this step
        self.planned_for: MooncakeConnectorMetadata | None = None

    # ---------------------------------------------------------------- producer
    def begin_step(self, meta: MooncakeConnectorMetadata) -> None:
        """Decide which blocks each layer pushes in this step (once per step, before the first layer's push: vLLM
        may call start_load_kv after the forward pass when a step has no synchronous load)."""
        if self.planned_for is meta:
            return
        self.planned_for = meta
        self.step_pushes = []
        for step in meta.pushes:
            if step.token_ids is not None and step.push_to == []:
                logger.info("MooncakeConnector: request %s is not pushed (its params ask for pull, or name a consumer "
                            "of another TP size): pull", step.req_id)
            elif step.token_ids is not None:  # the request's first step: announce it if the consumer has room
                key = entry_key(step.token_ids)
                nblocks = blocks.num_blocks(step.prompt_len, self.block_size)
                hashed = self.pull.checks.mode != "off"
                # the commit's digests are announced with the blocks: the consumer stages them in the same room
                nbytes = self.layout.kv_bytes(nblocks) + (
                    8 * digest.packed_size(nblocks, self.pull.digest_groups, self.pull.secret) if hashed else 0)
                push = self.links.push_buffer(step.push_to[self.rank] if step.push_to else self.default_peer)
                assert push is not None
                self.targets[step.req_id] = push
                if push.begin(key, nbytes, len(self.layout.layers), nblocks):
                    hasher = None if not hashed else BlockHasher(nblocks, len(self.layout.layers),
                                                                 self.pull.digest_groups)
                    self.pushing[step.req_id] = _PushState(step.req_id, key, nblocks, push, hasher=hasher)
                else:
                    logger.info("MooncakeConnector: the consumer has no push room for request %s (%.1f MiB), or has "
                                "not answered on this link yet: pull", step.req_id, nbytes / 2**20)
            state = self.pushing.get(step.req_id)
            if state is None:
                continue
            upto = blocks.complete_blocks(step.end, step.prompt_len, self.block_size)
            if upto > state.next_block:
                self.step_pushes.append((state, state.next_block, step.block_ids[state.next_block:upto]))
                state.next_block = upto

    def abandon(self, req_ids: list[str]) -> None:
        """Requests aborted mid-prefill: their pushes end (the consumer frees what it staged at once)."""
        for req_id in req_ids:
            state = self.pushing.pop(req_id, None)
            self.targets.pop(req_id, None)
            if state is not None:
                state.push.abort(state.key)

    def save_layer(self, layer: int, meta: MooncakeConnectorMetadata) -> None:
        """Queue this layer's blocks planned for this step (the sender thread moves them)."""
        if not meta.pushes:
            return
        self.begin_step(meta)
        for state, first, ids in self.step_pushes:
            if self.pushing.get(state.req_id) is not state:
                continue  # its push was given up earlier in this step
            try:  # [n, 1, *block]; from a device: still being copied
                piece = self.staging.gather(ids, layer=layer, owner=state.req_id)
            # never into vLLM's forward pass: this prompt goes by pull
            except (ArenaFull, CacheSuspended, torch.OutOfMemoryError) as e:
                logger.warning("MooncakeConnector: request %s: its push is given up (%s): it is saved for pull",
                               state.req_id, e)
                self.pushing.pop(state.req_id, None)
                state.push.abort(state.key)
                self.stats.count("push_dropped")
                continue
            state.push.push(state.key, layer, first, piece.tensor, len(ids),
                            ready=_sending(piece, first, layer, state.hasher))

    def finish_prompt(self, save: SaveRequest) -> None:
        """Commit the push, or save the prompt for pull (and tell the consumer not to wait for a push)."""
        state = self.pushing.pop(save.req_id, None)
        target = self.targets.pop(save.req_id, None)
        if state is not None and state.next_block < state.num_blocks:
            logger.warning("MooncakeConnector: request %s completed with %d of %d blocks pushed: serving it by pull",
                           save.req_id, state.next_block, state.num_blocks)
        elif state is not None and not state.push.failed(state.key):
            descriptor, secret = self.layout.descriptor_tensor(), self.pull.secret
            sums = None if state.hasher is None else _later(
                digest.packed_size(state.num_blocks, state.hasher.groups, secret))
            state.push.commit(state.key, len(save.token_ids), descriptor, sums,
                              ready=None if state.hasher is None else _digests(state, descriptor, secret, sums))
            self.stats.count("pushed")
            return
        self.pull.finish_prompt(save)  # before the notice: the consumer's drop_select must find it
        if target is not None:  # a consumer that was told a push begins must stop waiting for it
            target.notify_pull(state.key if state else entry_key(save.token_ids))

    # ---------------------------------------------------------------- consumer
    def lookup(self, req: LookupRequest, deadline: float) -> int:
        """A prompt pushed here (staged on the link of the producer its load takes pushes from) is held in full, for
        the lease; else what that producer holds for pull."""
        peer = req.source.peer(self.rank)
        push = None if peer is None else self.links.push_buffer(peer)
        if push is not None and push.hold(entry_key(req.token_ids), req.lease_seconds):
            return len(req.token_ids)
        return self.pull.lookup(req, deadline)

    def producers(self, source: LoadSource) -> list[str]:
        return self.pull.producers(source)

    def release(self, release: LeaseRelease) -> None:
        """(A staged push's hold only delays its expiry within push_ttl: nothing to release there.)"""
        self.pull.release(release)

    def load(self, req: LoadRequest, deadline: float) -> LoadResult:
        if req.source.await_push:
            return self._load_awaited(req, deadline)
        peer = req.source.peer(self.rank)
        if req.source.pushed and peer is not None:  # its producer said it pushes here: wait for what it sends
            return self._load_awaited(req, deadline, peer)
        start = time.perf_counter()
        push = None if peer is None else self.links.push_buffer(peer)
        key = entry_key(req.token_ids)
        entry = None if push is None else push.take(key, min(self.push_wait, max(deadline - time.monotonic(), 0.0)))
        if entry is None:  # never linked, announced, refused, aborted or sent by pull: ask the producer
            if push is not None:
                push.take_notice(key)  # acted on here: not for a later request of the same tokens
            return self.pull.load(req, deadline)
        return self._copy(req, entry, start, f"waited {(time.perf_counter() - start) * 1e3:.1f} ms for the push to "
                                             "be committed")

    def _load_awaited(self, req: LoadRequest, deadline: float, producer: str | None = None) -> LoadResult:
        """Wait for news of the prompt's push, then act on it: take the entry once committed (by ``deadline``), or
        pull it from the producer that says so. ``producer`` None: a decode sent together with its prefill, whichever
        producer begins the push within ``push_wait`` s (it may have begun, even committed, before this load started);
        else the producer whose answer said it pushes the prompt here (its news may come after that answer), until
        ``deadline``."""
        start = time.perf_counter()
        key = entry_key(req.token_ids)
        begin_by = deadline if producer is not None else min(time.monotonic() + self.push_wait, deadline)
        while True:
            seen = self.links.arrivals.seq  # read before looking: whatever arrives meanwhile ends the wait at once
            found = self._look(key, producer)
            if found is not None:
                break
            if time.monotonic() >= begin_by:
                if producer is not None:
                    raise TimeoutError(f"the producer at {producer} said it pushes its prompt here, but neither the "
                                       "push nor a notice to pull came by the load's deadline")
                self.stats.count("await_push_timeouts")
                raise TimeoutError(f"no producer began pushing its prompt within {self.push_wait:g} s (push_wait)")
            self.links.arrivals.wait(seen, begin_by - time.monotonic())
        peer, receiver, state = found
        begun = time.perf_counter()
        entry = receiver.take(key, max(deadline - time.monotonic(), 0.0)) if state == STAGED else None
        if entry is not None:
            result = self._copy(req, entry, start, f"waited {(begun - start) * 1e3:.1f} ms for the producer to "
                                                   f"begin the push and {(time.perf_counter() - begun) * 1e3:.1f} ms "
                                                   "for its commit")
        elif receiver.take_notice(key) == PULL:  # no room, or the push failed: the producer saved it for pull
            logger.info("MooncakeConnector: the producer at %s serves request %s by pull", peer, req.req_id)
            source = req.source if producer is not None else push_link_source(peer, self.rank)
            result = self.pull.load(dataclasses.replace(req, source=source), deadline)
        elif receiver.look(key) == STAGED:
            raise TimeoutError(f"the push of its prompt from {peer} was not committed by the load's deadline")
        else:
            raise ValueError(f"the push of its prompt from {peer} was refused, aborted, dropped or taken by another request")
        if producer is None:
            self.stats.count("await_push_loads")
        return result

    def _look(self, key: bytes, producer: str | None = None) -> tuple[str, PushReceiver, str] | None:
        """The push link with news of ``key`` (its producer's address, its receiver, what it knows): a staged entry
        before a pull notice before a drop; ``producer``: that producer's link only."""
        best = None
        for peer, receiver in self.links.push_receivers():
            state = receiver.look(key) if producer is None or peer == producer else None
            if state is not None and (best is None or _PREFERRED[state] < _PREFERRED[best[2]]):
                best = (peer, receiver, state)
        return best

    def _copy(self, req: LoadRequest, entry: PushedEntry, start: float, waited: str) -> LoadResult:
        """Write a taken entry into the cache: the result of a push load that began at ``start``."""
        copy_start = time.perf_counter()
        written = self._write(req, entry)
        self.stats.count("push_loaded")
        copied = time.perf_counter() - copy_start
        return LoadResult(written, self.layout.kv_bytes(written), 0, "pushed",
                          f"{waited} (not a transfer time: the KV moved during the prefill), copied from the staging "
                          f"area in {copied * 1e3:.1f} ms")

    def _write(self, req: LoadRequest, entry: PushedEntry) -> int:
        """Copy the pushed pieces that fall in the request's blocks into the KV cache; all of them must be there."""
        self.layout.check(entry.meta)
        first, end = req.first_block, req.first_block + len(req.block_ids)
        covered = [0] * len(self.layout.layers)
        jobs = []
        for layer, piece_first, piece in entry.pieces:
            self.layout.check_piece(layer, piece)
            shared = blocks.overlap(piece_first, piece.shape[0], first, end)
            if shared is None:
                continue
            lo, hi = shared
            jobs.append((layer, req.block_ids[lo - first:hi - first], piece[lo - piece_first:hi - piece_first]))
            covered[layer] += hi - lo
        if any(n != end - first for n in covered):
            raise ValueError(f"the pushed entry covers {min(covered)} of the {end - first} blocks wanted")
        check = True
        if self.pull.tamper is not None:  # tests only (harness/tamper.py)
            jobs, check = self.pull.tamper.pushed(req, jobs) or (jobs, check)
        last = None
        try:
            for layer, ids, rows in jobs:
                last = self.staging.scatter(ids, rows, layer=layer, wait=False)
        finally:  # copies into a device cache run in order on one stream: the last ends last
            if last is not None:
                last.wait()
        if check and self.pull.checks.due() and \
                self.pull.verify(req, entry.hidden, end - first, req.token_ids, entry.meta):
            self.stats.count("digest_checks")
        return end - first

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """The push buffers belong to the links (closed with them)."""
        self.pull.close()


def _sending(piece: Staged, first: int, layer: int, hasher: BlockHasher | None) -> Callable[[], None] | None:
    """What the sender thread runs before it sends a piece: wait for its copy off the device, then add it to the
    entry's digests."""
    if hasher is None:
        return None if piece.done is None else piece.wait

    def ready() -> None:
        piece.wait()
        hasher.update(first, layer, piece.tensor[:, 0])
    return ready


def _later(words: int) -> torch.Tensor:
    """An int64 tensor the sender thread fills: not an inference tensor (vLLM runs this in inference mode, and an
    inference tensor cannot be written outside it)."""
    with torch.inference_mode(False):
        return torch.empty(words, dtype=torch.int64)


def _digests(state: _PushState, descriptor: torch.Tensor, secret: bytes, sums: torch.Tensor) -> Callable[[], None]:
    """What the sender thread runs before it sends the commit, once every piece before it is hashed: the entry's
    digests, packed into ``sums`` (sealed with a secret); if some piece never came, unusable ones (all zeros: the
    consumer takes the entry as one without digests) rather than wrong ones."""
    assert state.hasher is not None

    def ready() -> None:
        sums.zero_()
        got = state.hasher.digests()
        if got is None:
            logger.warning("MooncakeConnector: a pushed entry is committed without KV digests: some of its pieces "
                           "were not hashed")
            return
        sums.copy_(digest.pack(got, digest.seal_context(state.key, descriptor) if secret else b"", secret))
    return ready
