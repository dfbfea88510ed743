"""Pull mode: the producer keeps each finished prompt's KV in a SimpleBuffer; the consumer asks for the blocks it
lacks and copies them into its KV cache.

Save (producer, inside the forward pass): gather the prompt's blocks of every layer into one block-major tensor and
insert it keyed by the prompt's tokens. The buffer evicts the oldest unclaimed entries when full and expires those
nobody takes within ``entry_ttl``, so a save never waits for a consumer.

Load (consumer, in a loader thread): ``drop_select`` by the prompt's tokens from the producer that prefilled it (its
params name it; else the one in mooncake.json), asking only for rows [first_block,
first_block + n) - the blocks this instance does not hold in its prefix cache - so only those bytes cross the wire,
straight into the request's blocks of the KV cache (a ``Scatter`` target: the pipe offers the blocks to the
producer's writes, or copies each chunk there from its ring). The entry's tokens come back with it: a block is used
only where its tokens agree with the prompt; blocks written with anything else are reported and recomputed.
"""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger

from kv_connector import block_copy
from kv_connector.kv_layout import KVCacheLayout
from kv_connector.links import PeerLinks
from kv_connector.metadata import LoadRequest, SaveRequest
from kv_connector.stats import StatsRecorder
from kv_connector.transfer import KVMiss, KVTransfer, LoadResult
from kv_lookup_buffer import BufferClosed
from kv_pipe import PipeError
from kv_pipe.memory import WarmPool

logger = init_logger(f"vllm.{__name__}")


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D integer tensors."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


class PullTransfer(KVTransfer):
    """``rank``: this worker's TP rank (a request's params name the producer's pipe per rank); ``default_producer``:
    where requests without params load from."""

    def __init__(self, layout: KVCacheLayout, links: PeerLinks, stats: StatsRecorder, block_size: int, rank: int,
                 default_producer: str, corrupt_ok: bool = False, concurrency: int = 1) -> None:
        self.layout, self.links, self.stats = layout, links, stats
        self.block_size = block_size
        self.rank, self.default_producer = rank, default_producer
        self.corrupt_ok = corrupt_ok
        self.scratch = WarmPool(keep=1)  # producer: gathers land here, then the buffer copies them (both warm)
        self.receive = WarmPool(keep=concurrency)  # consumer: one receive buffer per load in flight
        self.buffer = links.producer_buffer  # producer: the entries every consumer takes from
        self._buffer_stats = dict(self.buffer.stats) if self.buffer is not None else {}

    # ---------------------------------------------------------------- producer
    def finish_prompt(self, save: SaveRequest) -> None:
        assert self.buffer is not None, "only a producer saves"
        start = time.perf_counter()
        nbytes = self.layout.kv_bytes(len(save.block_ids))
        scratch = self.scratch.get(nbytes)
        try:
            kv = block_copy.gather(self.layout.layers, self.layout.block_dim, save.block_ids, scratch)
            # insert copies into memory the buffer recycles: two copies into warm pages cost less than one into
            # fresh pages, and the forward pass never waits for a consumer (full: the oldest entries are evicted)
            self.buffer.insert(torch.tensor(save.token_ids, dtype=torch.int64), None, kv,
                               self.layout.descriptor_tensor(), None)
        except (BufferClosed, PipeError, ValueError) as e:
            logger.warning("MooncakeConnector: dropped the KV of request %s (%d tokens): %s", save.req_id,
                           len(save.token_ids), e)
            self.stats.count("save_dropped")
            return
        finally:
            self.scratch.put(scratch)
        seconds = time.perf_counter() - start
        self.stats.count("saved")
        self.stats.count("saved_bytes", nbytes)
        self.stats.sample("saves", len(save.token_ids), nbytes, seconds)
        logger.info("MooncakeConnector: saved request %s: %d tokens, %d blocks, %.1f MiB in %.1f ms", save.req_id,
                    len(save.token_ids), len(save.block_ids), nbytes / 2**20, seconds * 1e3)

    # ---------------------------------------------------------------- consumer
    def load(self, req: LoadRequest, deadline: float) -> LoadResult:
        start = time.perf_counter()
        n = len(req.block_ids)
        rows = (req.first_block, req.first_block + n)
        query = torch.tensor(req.token_ids, dtype=torch.int64)
        # Host cache: receive into the blocks themselves. Else into a pooled buffer, copied into the blocks after.
        buf = None if self.layout.on_host else self.receive.get(self.layout.kv_bytes(n))
        target = self.layout.scatter(req.block_ids) if buf is None else buf
        buffer = self.links.pull_buffer(self.producer(req))
        # If drop_select raises, writes may still land in buf for a while: it is then not put back for reuse.
        tokens, _, kv, descriptor, _ = buffer.drop_select(query, None, key_rows=rows, key_out=target,
                                                          timeout=max(deadline - time.monotonic(), 0.001))
        fetched = time.perf_counter()
        try:
            if kv is None:
                raise KVMiss()
            self.layout.check(descriptor, kv)
            if tokens is None or tokens.dtype != torch.int64 or tokens.dim() != 1:
                raise ValueError("the producer's entry has no valid token ids")
            usable = self._usable_rows(req, query, tokens, kv.shape[0])
            if usable == 0:
                raise KVMiss()
            ids = req.block_ids[:usable]
            in_place = received_in_place = kv.device.type == "meta"  # the rows are in the blocks already
            if req.corrupt and self.corrupt_ok:  # test-only control: proves the consumer really uses the KV
                kv = (block_copy.gather(self.layout.layers, self.layout.block_dim, ids) if in_place else kv).flip(-1)
                in_place = False
                logger.warning("MooncakeConnector: corrupting the KV of request %s on purpose (test switch)", req.req_id)
            if not in_place:
                block_copy.scatter(self.layout.layers, self.layout.block_dim, ids, kv[:usable])
        finally:
            if buf is not None:
                self.receive.put(buf)  # the pipe is done with it: the receive completed (or never started writing)
        copied = time.perf_counter()
        nbytes = kv.numel() * kv.element_size()
        where = ("received into the KV cache blocks" if received_in_place
                 else f"copy into the KV cache {(copied - fetched) * 1e3:.1f} ms")
        return LoadResult(usable, self.layout.kv_bytes(usable), nbytes, "pulled",
                          f"fetch {(fetched - start) * 1e3:.1f} ms, {where}")

    def producer(self, req: LoadRequest) -> str:
        """The pipe of the producer that holds ``req``'s KV, for this rank."""
        return req.producers[self.rank] if req.producers else self.default_producer

    def _usable_rows(self, req: LoadRequest, query: torch.Tensor, tokens: torch.Tensor, received: int) -> int:
        """How many of the received rows hold this prompt's KV: all of them when the entry's tokens agree with the
        prompt up to the end of the claim, else only the blocks lying wholly inside the common prefix."""
        agree = common_prefix(query, tokens)
        claim_end = req.first_block * self.block_size + req.num_tokens
        end = req.first_block + len(req.block_ids) if agree >= claim_end else agree // self.block_size
        return max(0, min(end - req.first_block, received))

    # ---------------------------------------------------------------- stats, closing
    def collect_stats(self) -> None:
        if self.buffer is None:
            return
        now = dict(self.buffer.stats)
        for ours, theirs in (("expired", "expired"), ("evicted", "evicted"), ("served_bytes", "hit_key_bytes")):
            self.stats.count(ours, now[theirs] - self._buffer_stats[theirs])
        self._buffer_stats = now

    def close(self) -> None:
        """The buffers belong to the links (closed with them)."""
