"""Push mode: the producer streams each layer's newly computed blocks to the consumer while the prefill runs, then
commits the entry; the consumer stages it until the request's load takes it, and copies only the blocks it lacks
into its KV cache. Pull (``PullTransfer``) serves whatever push cannot: an entry the consumer has no room for, a
push that failed, a request the producer never announced.

The producer cannot know the consumer's prefix cache when it prefills, so a pushed entry always holds the whole
prompt; the load still writes exactly the blocks the consumer lacks.

A load waits for a push only if it has begun (the consumer has its BEGIN): a request nobody pushes is a miss in
milliseconds, never a ``push_wait``.

XpYd: the producer pushes each request to the consumer its params name (``mooncake_push_to``, chosen by the proxy
before the prefill), else to the consumer in mooncake.json; the consumer takes it from the push link of the producer
its decode params name (else the configured one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.logger import init_logger

from kv_connector import block_copy, blocks
from kv_connector.kv_layout import KVCacheLayout
from kv_connector.links import PeerLinks
from kv_connector.metadata import LoadRequest, MooncakeConnectorMetadata, SaveRequest
from kv_connector.pull import PullTransfer
from kv_connector.stats import StatsRecorder
from kv_connector.transfer import KVTransfer, LoadResult
from kv_lookup_buffer.push_buffer import PushedEntry, PushSender, entry_key

logger = init_logger(f"vllm.{__name__}")


@dataclass
class _PushState:
    key: bytes
    num_blocks: int
    push: PushSender  # the link to the consumer it goes to
    next_block: int = 0  # blocks before this one are queued


class PushTransfer(KVTransfer):
    """``default_peer``: producer: the consumer a request without params is pushed to (a consumer takes each request
    from the producer its ``LoadRequest.source`` names)."""

    def __init__(self, layout: KVCacheLayout, links: PeerLinks, pull: PullTransfer, stats: StatsRecorder,
                 block_size: int, rank: int, default_peer: str, push_wait: float, corrupt_ok: bool = False) -> None:
        self.layout, self.links, self.pull, self.stats = layout, links, pull, stats
        self.block_size = block_size
        self.rank, self.default_peer = rank, default_peer
        self.push_wait = push_wait
        self.corrupt_ok = corrupt_ok
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
                nbytes = self.layout.kv_bytes(nblocks)
                push = self.links.push_buffer(step.push_to[self.rank] if step.push_to else self.default_peer)
                assert push is not None
                self.targets[step.req_id] = push
                if push.begin(key, nbytes, len(self.layout.layers), nblocks):
                    self.pushing[step.req_id] = _PushState(key, nblocks, push)
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

    def save_layer(self, layer: int, meta: MooncakeConnectorMetadata) -> None:
        """Queue this layer's blocks planned for this step (the sender thread moves them)."""
        if not meta.pushes:
            return
        self.begin_step(meta)
        for state, first, ids in self.step_pushes:
            piece = block_copy.gather([self.layout.layers[layer]], self.layout.block_dim, ids)  # [n, 1, *block]
            state.push.push(state.key, layer, first, piece, len(ids))

    def finish_prompt(self, save: SaveRequest) -> None:
        """Commit the push, or save the prompt for pull (and tell the consumer not to wait for a push)."""
        state = self.pushing.pop(save.req_id, None)
        target = self.targets.pop(save.req_id, None)
        if state is not None and state.next_block < state.num_blocks:
            logger.warning("MooncakeConnector: request %s completed with %d of %d blocks pushed: serving it by pull",
                           save.req_id, state.next_block, state.num_blocks)
        elif state is not None and not state.push.failed(state.key):
            state.push.commit(state.key, len(save.token_ids), self.layout.descriptor_tensor())
            self.stats.count("pushed")
            return
        self.pull.finish_prompt(save)  # before the notice: the consumer's drop_select must find it
        if target is not None:  # a consumer that was told a push begins must stop waiting for it
            target.notify_pull(state.key if state else entry_key(save.token_ids))

    # ---------------------------------------------------------------- consumer
    def load(self, req: LoadRequest, deadline: float) -> LoadResult:
        start = time.perf_counter()
        peer = req.source.peer(self.rank)
        push = None if peer is None else self.links.push_buffer(peer)
        entry = None if push is None else push.take(entry_key(req.token_ids),
                                                    min(self.push_wait, max(deadline - time.monotonic(), 0.0)))
        if entry is None:  # never linked, announced, refused, aborted or sent by pull: ask the producer
            return self.pull.load(req, deadline)
        waited = time.perf_counter() - start
        written = self._write(req, entry)
        self.stats.count("push_loaded")
        copied = time.perf_counter() - start - waited
        return LoadResult(written, self.layout.kv_bytes(written), 0, "pushed",
                          f"waited {waited * 1e3:.1f} ms for the push to be committed (not a transfer time: the KV "
                          f"moved during the prefill), copied from the staging area in {copied * 1e3:.1f} ms")

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
            rows = piece[lo - piece_first:hi - piece_first]
            if req.corrupt and self.corrupt_ok:
                rows = rows.flip(-1)
            jobs.append((layer, req.block_ids[lo - first:hi - first], rows))
            covered[layer] += hi - lo
        if any(n != end - first for n in covered):
            raise ValueError(f"the pushed entry covers {min(covered)} of the {end - first} blocks wanted")
        if req.corrupt and self.corrupt_ok:
            logger.warning("MooncakeConnector: corrupted the KV of request %s on purpose (test switch)", req.req_id)
        for layer, ids, rows in jobs:
            block_copy.scatter([self.layout.layers[layer]], self.layout.block_dim, ids, rows)
        return end - first

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """The push buffers belong to the links (closed with them)."""
        self.pull.close()
