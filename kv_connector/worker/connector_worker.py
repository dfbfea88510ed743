"""The connector's worker side (vLLM's Worker process): owns the KV cache tensors, the peer links (``links``) and the
transfer (pull or push); saves inside the forward pass, loads in pool threads.

No vLLM here: vLLM's objects are read once by the glue (``vllm_spec.worker_spec``) into a ``WorkerSpec``, and the
worker takes the KV cache as a dict of plain tensors, so the whole data path runs (and is tested) without vLLM.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

import torch

from kv_connector.cache.heads import HeadSplit
from kv_connector.cache.layout import KVCacheLayout
from kv_connector.cache.staging import KVStaging
from kv_connector.config import ConnectorConfig, kv_rank, role_pipe, store_host
from kv_connector.metadata import LookupAnswer, MooncakeConnectorMetadata
from kv_connector.stats import StatsRecorder, TransferStats
from kv_connector.worker.digest import Sampler
from kv_connector.worker.links import PeerLinks
from kv_connector.worker.loads import Finished, Loads
from kv_connector.worker.lookups import Lookups
from kv_connector.worker.pool import KVPool
from kv_connector.worker.pull import PullTransfer
from kv_connector.worker.push import PushTransfer
from kv_connector.worker.transfer import KVTransfer
from kv_lookup_buffer import MooncakeStore, PushArrivals, PushBuffer, SimpleBuffer
from kv_pipe import PipeEndpoint


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker knows of its instance besides the KV cache tensors (``vllm_spec.worker_spec`` reads it off
    vLLM's objects; tests write it by hand)."""

    rank: int  # this worker's tensor-parallel rank
    block_size: int  # tokens per KV cache block
    fingerprint: str  # the model, equal for the same model on any host (``vllm_spec.model_fingerprint``)
    kv_heads: int  # the model's KV heads in all (1 for MLA's latent)
    replicated: bool = False  # every rank holds the same KV (MLA)
    num_blocks: int | None = None  # blocks per layer (None: the first dimension of the first layer)
    cache_dtype: str = "auto"  # vLLM's --kv-cache-dtype
    kv_scales: list[list[Any]] | None = None  # a quantized (fp8) cache: [k_scale, v_scale] per layer


# the buffers' own counts that are connector metrics too (see stats.COUNTERS): their name -> ours
BUFFER_COUNTS = {"expired": "expired", "evicted": "evicted", "hit_key_bytes": "served_bytes",
                 "leases": "leases", "leases_expired": "leases_expired"}
PUSH_COUNTS = {"pushed_bytes": "pushed_bytes", "expired": "push_expired"}
STORE_COUNTS = {"rejected": "pool_rejected", "timeouts": "pool_timeouts", "errors": "pool_errors"}
DRAIN_MARGIN = 5.0  # seconds past load_timeout that sleep mode waits for loads in flight (their copy into the cache)
IDLE_WAIT = 0.01  # seconds a step with nothing to compute may wait for a pending load or lookup (not spin)
LOOKUP_BACKOFF = 2.0  # seconds a producer that failed to answer a lookup is not asked again (see lookups.py)
logger = logging.getLogger(f"vllm.{__name__}")


class ConnectorWorker:
    def __init__(self, config: ConnectorConfig) -> None:
        self.config, self.options = config, config.options
        self.is_producer, self.push_mode = config.is_producer, config.push_mode
        self.stats = StatsRecorder()
        self.layout: KVCacheLayout | None = None
        self.staging: KVStaging | None = None
        self.transfer: KVTransfer | None = None
        self.loads: Loads | None = None
        self.lookups: Lookups | None = None
        self.links: PeerLinks | None = None
        self.pool: KVPool | None = None
        self.layout_checked = False
        self.suspended = False
        self.held: set[str] = set()  # requests vLLM holds for their copies out of the cache (and into the pool)

    def register(self, kv_caches: dict[str, torch.Tensor], spec: WorkerSpec) -> None:
        """Set up this worker (TP rank) once vLLM has allocated its KV cache: ``kv_caches`` maps each attention layer's
        name to its paged cache tensor, in the model's layer order."""
        self._set_switch_interval()
        split = HeadSplit(spec.kv_heads, self.config.tp_size, spec.rank, spec.replicated)
        self.layout = KVCacheLayout.from_caches(kv_caches, spec.num_blocks, spec.fingerprint, split.span,
                                                spec.block_size, spec.cache_dtype, spec.kv_scales)
        self.staging = KVStaging(self.layout.layers, self.layout.block_dim, self.pinned_bytes())
        if self.config.store is not None:
            self.pool = self._pool(self.layout, split, spec.block_size)
        if self.config.is_both:  # no pipe: KV comes from and goes to the pool only
            if self.config.loads:
                self._start_loads(spec.rank)
            self._log_ready(spec.rank, split, "none (kv_both)", "none")
            return
        endpoint = self._endpoint(spec.rank, self.layout)
        self.links = self._links(endpoint)
        endpoint.start()
        peer = role_pipe(self.config.mooncake, not self.is_producer, spec.rank)  # the peer mooncake.json names
        self.transfer = self._transfer(self.layout, self.links, split, spec.block_size, peer)
        self._connect(peer, spec.rank)
        self._log_ready(spec.rank, split, endpoint.address, peer)

    def _pool(self, layout: KVCacheLayout, split: HeadSplit, block_size: int) -> KVPool:
        """This rank's client of the KV pool, and what moves its blocks in and out."""
        store_config = self.config.store
        assert store_config is not None and self.staging is not None
        mooncake = self.config.mooncake
        store = MooncakeStore(store_config, store_host(self.config), mooncake.metadata.conn, mooncake.protocol,
                              mooncake.device_for(split.rank), self.config.secret,
                              on_count=self.stats.counter(STORE_COUNTS),
                              local_first=self.options.pool_placement == "local")
        pool = KVPool(store, layout, self.staging, split, block_size, self.stats, store_config.local_buffer_size,
                      self.options.pool_namespace)
        logger.info("MooncakeConnector: KV pool at master %s (TP rank %d): objects of %d bytes, one per block, under "
                    "namespace %s", store_config.master_server_address, split.rank, layout.row_bytes, pool.namespace)
        if not self.config.secret:
            logger.warning("MooncakeConnector: no secret is set: any client of the KV pool's master can plant KV that "
                           "this instance loads. Set the same MOONCAKE_KV_SECRET (or auth_secret) on every instance; "
                           "see docs/deployment.md (Security)")
        return pool

    def pinned_bytes(self) -> int:
        """Pinned host memory a rank with a GPU cache allocates at start-up (``staging``'s arena): its buffer's
        entries or its loads' receive buffers (``buffer_size``), and a producer's pushes in flight
        (``push_staging_size``)."""
        opts = self.options
        return opts.buffer_size + (opts.push_staging_size if self.push_mode and self.is_producer else 0)

    def _set_switch_interval(self) -> None:
        interval = self.options.gil_switch_interval
        if interval and interval < sys.getswitchinterval():
            # The KV moves in side threads of this process while vLLM's engine loop keeps the GIL busy (it steps
            # continuously while a load is pending): at Python's default 5 ms switch interval every hand-over of the
            # GIL to such a thread costs up to 5 ms, and a transfer needs dozens.
            logger.info("MooncakeConnector: Python thread switch interval %.2f ms -> %.2f ms (gil_switch_interval)",
                        sys.getswitchinterval() * 1e3, interval * 1e3)
            sys.setswitchinterval(interval)

    def _endpoint(self, rank: int, layout: KVCacheLayout) -> PipeEndpoint:
        """This rank's pipe endpoint at its address in mooncake.json (not started yet)."""
        host, port = self.config.mooncake.pipe_address(kv_rank(self.is_producer), rank)
        endpoint = PipeEndpoint(self.config.mooncake, host, port, kv_rank=kv_rank(self.is_producer), local_rank=rank,
                                link_idle=self.options.link_idle, start=False,
                                any_peer_rank=True)  # instances may run different TP sizes
        if self._into_cache(layout):
            for layer in layout.layers:  # loads are received straight into the blocks they fill
                endpoint.register_receive_region(layer)
        return endpoint

    def _into_cache(self, layout: KVCacheLayout) -> bool:
        return self.options.receive_into_cache and not self.is_producer and layout.on_host

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

    def _transfer(self, layout: KVCacheLayout, links: PeerLinks, split: HeadSplit, block_size: int, peer: str
                  ) -> KVTransfer:
        opts = self.options
        pull = PullTransfer(layout, links, self.stats, block_size, split, opts.load_concurrency,
                            rank_to_rank=self.push_mode, staging=self.staging,
                            into_cache=self._into_cache(layout),
                            checks=Sampler(opts.kv_digest, opts.kv_digest_sample), secret=self.config.secret)
        if not self.push_mode:
            return pull
        return PushTransfer(layout, links, pull, self.stats, block_size, split.rank, peer, opts.push_wait,
                            staging=self.staging)

    def _connect(self, peer: str, rank: int) -> None:
        """Link to the peer mooncake.json names before the first request needs it; a consumer (or an instance with a
        pool) starts its loads."""
        assert self.links is not None
        if self.config.loads:
            self._start_loads(rank)
        if self.is_producer:
            if self.push_mode:  # its first credit is there before the first request
                self.links.push_buffer(peer)
            return
        self.links.warm_up(peer, self.options.load_timeout)

    def _start_loads(self, rank: int) -> None:
        """Loads and lookups: from the producers (a consumer) and the pool (any role with one)."""
        assert self.staging is not None
        self.loads = Loads(self._load, self.options.load_concurrency, self.options.load_timeout, self.stats,
                           self.staging.bind_thread, fail=self.config.fail_loads)
        transfer = self.transfer
        asks = (transfer.lookup, lambda req: transfer.producers(req.source), transfer.release) \
            if transfer is not None and self.config.has_producer else (None, None, None)  # else the pool only
        pool = self.pool.lookup if self.pool is not None and self.config.looks_in_pool else None
        self.lookups = Lookups(*asks, rank, self.options.lookup_timeout, self.stats, LOOKUP_BACKOFF, pool=pool)

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
        if req.from_pool:
            assert self.pool is not None
            return self.pool.load(req, deadline)
        assert self.transfer is not None
        result = self.transfer.load(req, deadline)
        if not self.layout_checked:
            self.layout_checked = True
            logger.info("MooncakeConnector: the producer's KV layout matches (%s)", self.layout.descriptor)
        return result

    # ---------------------------------------------------------------- per step
    def start_step(self, meta: MooncakeConnectorMetadata) -> None:
        """vLLM's ``start_load_kv``: after this step's forward pass was queued (or before it, when the step has a
        synchronous load - never with this connector)."""
        assert self.staging is not None
        self.held.update(meta.held)
        if self.pool is not None:  # here, not in wait_for_save: vLLM may ask what was sent before that (spec decode)
            for pool_save in meta.pool_saves:
                if not pool_save.in_step:
                    self.held.add(pool_save.req_id)
                    self.pool.hold(pool_save)
        if meta.loads:
            self.staging.mark()
        if self.loads is not None:
            for load in meta.loads:
                self.loads.start(load)
        if self.lookups is not None:
            for lookup in meta.lookups:
                self.lookups.start(lookup)
            for release in meta.releases:
                self.lookups.release(release)
        if meta.pushes and self.transfer is not None:
            self.transfer.begin_step(meta)
        if meta.abandoned and self.transfer is not None:
            self.transfer.abandon(meta.abandoned)

    def handle_preemptions(self, meta: MooncakeConnectorMetadata) -> None:
        """Before the forward pass: vLLM frees a preempted request's blocks without asking, so the next kernels
        wait (on the device) for the copies still reading them."""
        if self.staging is not None and meta.preempted:
            self.staging.protect(meta.preempted)

    def save_layer(self, layer_name: str, meta: MooncakeConnectorMetadata) -> None:
        if self.transfer is None or self.layout is None or not meta.pushes:
            return
        index = self.layout.layer_index.get(layer_name)
        if index is not None:
            self.transfer.save_layer(index, meta)

    def wait_for_save(self, meta: MooncakeConnectorMetadata) -> None:
        """After the step's forward pass: a producer saves the prompts it completed; a pool stores them too (copied
        out now, put in the background). (The blocks of requests that ended go to the pool from ``start_step``.)"""
        if self.transfer is not None:
            for save in meta.saves:
                self.transfer.finish_prompt(save)
        if self.pool is not None:
            for pool_save in meta.pool_saves:
                if pool_save.in_step:
                    self.pool.save_step(pool_save)

    def transfer_results(self, idle: bool) -> Finished:
        """Finished loads (failed ones too), and the blocks of partial ones that must be recomputed. ``idle``: the
        step had nothing to compute: wait a moment for a load or a lookup to end (vLLM would spin its engine loop,
        taking the CPU and the GIL from them). A producer's ``sending``: the requests held for their copies out of
        the cache whose copies all ended."""
        sending: set[str] = set()
        if self.held:
            sending = self.staging.sent(self.held) if self.staging is not None else set(self.held)
            if self.pool is not None:
                sending = {req_id for req_id in sending if self.pool.copied(req_id)}
            self.held -= sending
        if self.loads is None:
            return Finished(sending=sending)
        if idle:
            pending = self.loads.pending() + (self.lookups.pending() if self.lookups is not None else []) + \
                (self.pool.pending() if self.pool is not None else [])
            if pending:
                futures_wait(pending, timeout=IDLE_WAIT, return_when=FIRST_COMPLETED)
        finished = self.loads.collect()
        finished.sending = sending
        if self.pool is not None and (finished.failed or finished.bad_blocks):
            self.pool.load_failed(finished.failed | finished.partial)
        return finished

    def lookup_answers(self) -> list[LookupAnswer]:
        """The answers of the lookups that ended since the last call (for the scheduler)."""
        return [] if self.lookups is None else self.lookups.collect()

    # ---------------------------------------------------------------- sleep mode (vLLM >= 0.33)
    def suspend(self) -> None:
        """The KV cache's memory is about to be released (vLLM's sleep mode; its scheduler is paused, so no step
        starts a transfer): give the loads in flight a while to end, then let no copy start into or out of the cache
        (a load still running fails, and is recomputed) and wait for the copies queued on both streams. No
        registration of KV memory is left to drop: a GPU cache is never registered with the engine (it is staged;
        only a host cache is, with ``receive_into_cache``, and sleep mode exists only on GPUs). Entries already saved
        or pushed are host copies: they stay servable. Idempotent."""
        if self.suspended:
            return
        self.suspended = True
        left = 0 if self.loads is None else self.loads.drain(self.options.load_timeout + DRAIN_MARGIN)
        if self.staging is not None:
            self.staging.suspend()
        if left:
            logger.warning("MooncakeConnector: %d load(s) still running as the KV cache is released for sleep mode: "
                           "they fail (recomputed after wake-up) and write nothing into it", left)
        logger.info("MooncakeConnector: KV cache released for sleep mode")

    def resume(self) -> None:
        """The KV cache's memory is back (at the same addresses). Idempotent."""
        if self.suspended:
            self.suspended = False
            if self.staging is not None:
                self.staging.resume()
            logger.info("MooncakeConnector: KV cache restored after sleep mode")

    def take_stats(self) -> TransferStats | None:
        return self.stats.take()

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        if self.loads is not None:
            self.loads.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.links is not None:
            self.links.close()
        if self.pool is not None:
            self.pool.close()
