"""The connector's worker side (vLLM's Worker process): owns the KV cache tensors, the peer links (``links``) and the
transfer (pull or push); saves inside the forward pass, loads in pool threads."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from kv_connector.config import ConnectorConfig, kv_rank, role_pipe
from kv_connector.heads import HeadSplit
from kv_connector.kv_layout import KVCacheLayout, model_fingerprint
from kv_connector.links import PeerLinks
from kv_connector.loads import Loads
from kv_connector.metadata import MooncakeConnectorMetadata
from kv_connector.pull import PullTransfer
from kv_connector.push import PushTransfer
from kv_connector.stats import MooncakeConnectorStats, StatsRecorder
from kv_connector.transfer import KVTransfer
from kv_lookup_buffer import SimpleBuffer
from kv_lookup_buffer.push_buffer import PushArrivals, PushBuffer
from kv_pipe.endpoint import PipeEndpoint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# the buffers' own counts that are connector metrics too (see stats.COUNTERS): their name -> ours
BUFFER_COUNTS = {"expired": "expired", "evicted": "evicted", "hit_key_bytes": "served_bytes"}
PUSH_COUNTS = {"pushed_bytes": "pushed_bytes", "expired": "push_expired"}
IDLE_WAIT = 0.01  # seconds a step with nothing to compute may wait for a pending load (instead of spinning)
logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers and level apply


class ConnectorWorker:
    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.vllm_config, self.config, self.options = vllm_config, config, config.options
        self.is_producer, self.push_mode = config.is_producer, config.push_mode
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self.stats = StatsRecorder()
        self.layout: KVCacheLayout | None = None
        self.transfer: KVTransfer | None = None
        self.loads: Loads | None = None
        self.links: PeerLinks | None = None
        self.layout_checked = False

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Set up this worker (TP rank) once vLLM has allocated its KV cache."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        self._set_switch_interval()
        split = self._head_split(rank)
        self.layout = KVCacheLayout.from_caches(kv_caches, self.num_blocks, model_fingerprint(self.vllm_config),
                                                split.span, self.block_size)
        endpoint = self._endpoint(rank, self.layout)
        self.links = self._links(endpoint)
        endpoint.start()
        peer = role_pipe(self.config.mooncake, not self.is_producer, rank)  # the peer mooncake.json names
        self.transfer = self._transfer(self.layout, self.links, split, rank, peer)
        self._connect(peer)
        self._log_ready(rank, split, endpoint.address, peer)

    def _set_switch_interval(self) -> None:
        interval = self.options.gil_switch_interval
        if interval and interval < sys.getswitchinterval():
            # The KV moves in side threads of this process while vLLM's engine loop keeps the GIL busy (it steps
            # continuously while a load is pending): at Python's default 5 ms switch interval every hand-over of the
            # GIL to such a thread costs up to 5 ms, and a transfer needs dozens.
            logger.info("MooncakeConnector: Python thread switch interval %.2f ms -> %.2f ms (gil_switch_interval)",
                        sys.getswitchinterval() * 1e3, interval * 1e3)
            sys.setswitchinterval(interval)

    def _head_split(self, rank: int) -> HeadSplit:
        """The KV heads this rank holds; MLA caches one latent per token, alike on every rank."""
        model = self.vllm_config.model_config
        tp = self.config.tp_size
        return HeadSplit(1, tp, rank, True) if model.use_mla else HeadSplit(model.get_total_num_kv_heads(), tp, rank)

    def _endpoint(self, rank: int, layout: KVCacheLayout) -> PipeEndpoint:
        """This rank's pipe endpoint at its address in mooncake.json (not started yet)."""
        host, port = self.config.mooncake.pipe_address(kv_rank(self.is_producer), rank)
        endpoint = PipeEndpoint(self.config.mooncake, host, port, kv_rank=kv_rank(self.is_producer), local_rank=rank,
                                link_idle=self.options.link_idle, start=False,
                                any_peer_rank=True)  # instances may run different TP sizes
        if not self.is_producer and layout.on_host:
            for layer in layout.layers:  # loads are received straight into the blocks they fill
                endpoint.register_receive_region(layer)
        return endpoint

    def _links(self, endpoint: PipeEndpoint) -> PeerLinks:
        opts = self.options
        # the buffers tell the stats of their counts that are ours too as they happen
        buffer = SimpleBuffer(None, None, opts.buffer_size, role="producer", max_age=opts.entry_ttl, evict=True,
                              on_count=self.stats.counter(BUFFER_COUNTS)) if self.is_producer else None
        make_push = None
        arrivals = PushArrivals()  # wakes loads awaiting a push on any producer's link
        if self.push_mode:
            push_counts = self.stats.counter(PUSH_COUNTS)
            make_push = lambda pipe, side: PushBuffer(pipe, side, capacity=opts.push_staging_size,  # noqa: E731
                                                      ttl=opts.push_ttl, on_count=push_counts, arrivals=arrivals)
        return PeerLinks(endpoint, buffer, opts.buffer_size, make_push, arrivals)

    def _transfer(self, layout: KVCacheLayout, links: PeerLinks, split: HeadSplit, rank: int, peer: str
                  ) -> KVTransfer:
        opts = self.options
        pull = PullTransfer(layout, links, self.stats, self.block_size, split, opts.allow_test_corruption,
                            opts.load_concurrency, rank_to_rank=self.push_mode)
        if not self.push_mode:
            return pull
        return PushTransfer(layout, links, pull, self.stats, self.block_size, rank, peer, opts.push_wait,
                            opts.allow_test_corruption)

    def _connect(self, peer: str) -> None:
        """Link to the peer mooncake.json names before the first request needs it; a consumer starts its loads."""
        assert self.links is not None
        if self.is_producer:
            if self.push_mode:  # its first credit is there before the first request
                self.links.push_buffer(peer)
            return
        self.loads = Loads(self._load, self.options.load_concurrency, self.options.load_timeout, self.stats)
        self.links.warm_up(peer, self.options.load_timeout)

    def _log_ready(self, rank: int, split: HeadSplit, address: str, peer: str) -> None:
        layout = self.layout
        assert layout is not None
        first = layout.layers[0]
        logger.info("MooncakeConnector %s (TP rank %d of %d, %s mode): %d layers of %s %s, blocks along dim %d, KV "
                    "heads %d-%d of %d%s, pipe %s, default peer %s", "producer" if self.is_producer else "consumer",
                    rank, self.config.tp_size, "push" if self.push_mode else "pull", len(layout.layers),
                    list(first.shape), first.dtype, layout.block_dim, split.span[0], split.span[1] - 1, split.total,
                    " (alike on every rank)" if split.replicated else "", address, peer)

    def _load(self, req, deadline):  # Loads' callback
        assert self.transfer is not None
        result = self.transfer.load(req, deadline)
        if not self.layout_checked:
            self.layout_checked = True
            logger.info("MooncakeConnector: the producer's KV layout matches (%s)", self.layout.descriptor)
        return result

    # ---------------------------------------------------------------- per step
    def start_step(self, meta: MooncakeConnectorMetadata) -> None:
        assert self.transfer is not None
        if self.loads is not None:
            for load in meta.loads:
                self.loads.start(load)
        if meta.pushes:
            self.transfer.begin_step(meta)

    def save_layer(self, layer_name: str, meta: MooncakeConnectorMetadata) -> None:
        if self.transfer is None or self.layout is None or not meta.pushes:
            return
        index = self.layout.layer_index.get(layer_name)
        if index is not None:
            self.transfer.save_layer(index, meta)

    def wait_for_save(self, meta: MooncakeConnectorMetadata) -> None:
        assert self.transfer is not None
        for save in meta.saves:
            self.transfer.finish_prompt(save)

    def transfer_results(self, idle: bool) -> tuple[KVConnectorTransferResults, set[int]]:
        """Finished loads, and the blocks of partial ones that must be recomputed."""
        if self.loads is None:
            return KVConnectorTransferResults(), set()
        finished = self.loads.collect(IDLE_WAIT if idle else 0.0)
        return KVConnectorTransferResults(finished_recving=finished.done, failed_recving=finished.failed), \
            finished.bad_blocks

    def take_stats(self) -> MooncakeConnectorStats | None:
        return self.stats.take()

    def close(self) -> None:
        if self.loads is not None:
            self.loads.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.links is not None:
            self.links.close()
