"""The connector's worker side (vLLM's Worker process): owns the KV cache tensors, the peer links (``links``) and the
transfer (pull or push); saves inside the forward pass, loads in pool threads."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from kv_connector.heads import HeadSplit
from kv_connector.kv_layout import KVCacheLayout, model_fingerprint
from kv_connector.links import PeerLinks
from kv_connector.loads import Loads
from kv_connector.metadata import MooncakeConnectorMetadata
from kv_connector.options import ConnectorOptions, pipe_addresses
from kv_connector.pull import PullTransfer
from kv_connector.push import PushTransfer
from kv_connector.stats import MooncakeConnectorStats, StatsRecorder
from kv_connector.transfer import KVTransfer
from kv_lookup_buffer import SimpleBuffer
from kv_lookup_buffer.push_buffer import PushBuffer
from kv_pipe import MooncakeTransferEngineConfig
from kv_pipe.config import join_host_port
from kv_pipe.endpoint import PipeEndpoint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

IDLE_WAIT = 0.01  # seconds a step with nothing to compute may wait for a pending load (instead of spinning)
logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers and level apply


class ConnectorWorker:
    def __init__(self, vllm_config: VllmConfig, options: ConnectorOptions, mooncake: MooncakeTransferEngineConfig,
                 is_producer: bool, push_mode: bool, kv_cache_config: KVCacheConfig | None) -> None:
        self.vllm_config, self.options, self.mooncake = vllm_config, options, mooncake
        self.is_producer, self.push_mode = is_producer, push_mode
        self.block_size = vllm_config.cache_config.block_size
        self.num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self.stats = StatsRecorder()
        self.layout: KVCacheLayout | None = None
        self.transfer: KVTransfer | None = None
        self.loads: Loads | None = None
        self.links: PeerLinks | None = None
        self.layout_checked = False

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        interval = self.options.gil_switch_interval
        if interval and interval < sys.getswitchinterval():
            # The KV moves in side threads of this process while vLLM's engine loop keeps the GIL busy (it steps
            # continuously while a load is pending): at Python's default 5 ms switch interval every hand-over of the
            # GIL to such a thread costs up to 5 ms, and a transfer needs dozens.
            logger.info("MooncakeConnector: Python thread switch interval %.2f ms -> %.2f ms (gil_switch_interval)",
                        sys.getswitchinterval() * 1e3, interval * 1e3)
            sys.setswitchinterval(interval)
        rank = get_tensor_model_parallel_rank()
        model = self.vllm_config.model_config
        tp = self.vllm_config.parallel_config.tensor_parallel_size
        # MLA caches one latent per token, alike on every rank
        split = HeadSplit(1, tp, rank, True) if model.use_mla else HeadSplit(model.get_total_num_kv_heads(), tp, rank)
        layout = KVCacheLayout.from_caches(kv_caches, self.num_blocks, model_fingerprint(self.vllm_config), split.span,
                                           self.block_size)
        self.layout = layout
        opts, producer = self.options, self.is_producer
        role = "producer" if producer else "consumer"
        kv_rank = 0 if producer else 1
        host, port = self.mooncake.pipe_address(kv_rank, rank)
        # the peer a request without params goes to: the consumer (push) / producer (pull) named in mooncake.json
        default_peer = join_host_port(*self.mooncake.pipe_address(1 - kv_rank, rank))
        endpoint = PipeEndpoint(self.mooncake, host, port, kv_rank=kv_rank, local_rank=rank, link_idle=opts.link_idle,
                                start=False, any_peer_rank=True)  # instances may run different TP sizes
        if not producer and layout.on_host:
            for layer in layout.layers:  # loads are received straight into the blocks they fill
                endpoint.register_receive_region(layer)
        buffer = SimpleBuffer(None, None, opts.buffer_size, role="producer", max_age=opts.entry_ttl,
                              evict=True) if producer else None
        make_push = None
        if self.push_mode:
            make_push = lambda pipe, side: PushBuffer(pipe, side, capacity=opts.push_staging_size,  # noqa: E731
                                                      ttl=opts.push_ttl)
        self.links = PeerLinks(endpoint, buffer, opts.buffer_size, make_push)
        endpoint.start()
        default_producers = pipe_addresses(self.vllm_config, self.mooncake, is_producer=True)
        pull = PullTransfer(layout, self.links, self.stats, self.block_size, split, default_producers,
                            opts.allow_test_corruption, opts.load_concurrency, rank_to_rank=self.push_mode)
        self.transfer = pull
        if self.push_mode:
            self.transfer = PushTransfer(layout, self.links, pull, self.stats, self.block_size, rank, default_peer,
                                         opts.push_wait, opts.allow_test_corruption)
            if producer:  # link to the configured consumer now: its first credit is there before the first request
                self.links.push_buffer(default_peer)
        if not producer:
            self.loads = Loads(self._load, opts.load_concurrency, opts.load_timeout, self.stats)
            self.links.warm_up(default_peer, opts.load_timeout)  # the producer named in mooncake.json
        first = layout.layers[0]
        logger.info("MooncakeConnector %s (TP rank %d of %d, %s mode): %d layers of %s %s, blocks along dim %d, KV "
                    "heads %d-%d of %d%s, pipe %s, default peer %s", role, rank, tp,
                    "push" if self.push_mode else "pull", len(layout.layers), list(first.shape), first.dtype,
                    layout.block_dim, split.span[0], split.span[1] - 1, split.total,
                    " (alike on every rank)" if split.replicated else "", endpoint.address, default_peer)

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
        if self.transfer is not None:
            self.transfer.collect_stats()
        return self.stats.take()

    def close(self) -> None:
        if self.loads is not None:
            self.loads.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.links is not None:
            self.links.close()
