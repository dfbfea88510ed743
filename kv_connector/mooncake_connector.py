"""MooncakeConnector: a vLLM v1 KV connector that ships each request's prompt KV from a kv_producer instance to a
kv_consumer instance through SimpleBuffer over MooncakePipe. Users name this module in --kv-transfer-config:

    {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector", ...}

A thin facade: vLLM creates it twice, once in the scheduler process (``scheduler.producer.ProducerScheduler``:
what to save, or ``scheduler.consumer.ConsumerScheduler``: what to look up and load) and once per worker
(``worker.connector_worker.ConnectorWorker``: the KV cache, the links, pull or push). A load that was found and then
failed is reported to vLLM, whose kv_load_failure_policy decides (fail the request, or recompute the prompt).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from kv_connector.config import ConnectorConfig, check_kv_cache_dtype, recompute_tokens
from kv_connector.metadata import MooncakeConnectorMetadata, MooncakeWorkerMetadata
from kv_connector.scheduler.consumer import ConsumerScheduler
from kv_connector.scheduler.pool import PoolSaves
from kv_connector.scheduler.producer import ProducerScheduler
from kv_connector.vllm_stats import MooncakeConnectorStats, MooncakePromMetrics
from kv_connector.worker.connector_worker import ConnectorWorker
from kv_connector.worker.vllm_spec import worker_spec
from kv_pipe import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under "vllm": vLLM's log handlers and level apply
KVConnectorMetadata.register(MooncakeConnectorMetadata)  # plain dataclasses, so that the worker needs no vLLM
KVConnectorWorkerMetadata.register(MooncakeWorkerMetadata)


def holds_blocks(vllm_config: VllmConfig, config: ConnectorConfig) -> bool:
    """Whether a producer holds finished requests' blocks for their copies out of the cache (``hold_blocks``):
    always on an accelerator (those copies run after the step that queued them), on the host only if asked."""
    return config.options.hold_blocks == "always" or vllm_config.device_config.device_type != "cpu"


def route_stack_logs() -> None:
    """The pipe and buffer layers log through plain ``logging`` (they know nothing of vLLM): inside a vLLM process,
    send their records through vLLM's handlers and level, else only their warnings reach stderr, bare."""
    ours = logging.getLogger("vllm")
    for name in ("kv_pipe", "kv_lookup_buffer"):
        stack = logging.getLogger(name)
        if stack.handlers or not ours.handlers:
            continue
        for handler in ours.handlers:
            stack.addHandler(handler)
        stack.setLevel(ours.getEffectiveLevel())
        stack.propagate = False


class MooncakeConnector(KVConnectorBase_V1):
    """See the module docstring. ``kv_role`` kv_producer or kv_consumer (kv_both is refused: one role per instance)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_stack_logs()
        try:  # fail at start-up, not on the first request, and say why before vLLM's traceback does
            config = ConnectorConfig.from_vllm(vllm_config)
            check_kv_cache_dtype(vllm_config)
        except ConfigError as e:
            logger.error("MooncakeConnector: configuration error: %s", e)
            raise
        self._bad_blocks: set[int] = set()
        # the scheduler side: what a producer saves, what an instance that loads looks up and loads (a consumer from
        # its producers and the pool; a producer or kv_both from the pool), and what goes into the pool
        self._producer: ProducerScheduler | None = None
        self._consumer: ConsumerScheduler | None = None
        self._pool: PoolSaves | None = None
        block_size = vllm_config.cache_config.block_size
        if role != KVConnectorRole.SCHEDULER:
            self._worker = ConnectorWorker(config)
            self._kv_cache_config = kv_cache_config
            return
        if config.store is not None:
            self._pool = PoolSaves(block_size, config.options.pool_save_output,
                                   hold_copies=vllm_config.device_config.device_type != "cpu")
        if config.is_producer:
            self._producer = ProducerScheduler(config, block_size, hold=holds_blocks(vllm_config, config))
        if config.loads:
            self._consumer = self._consumer_scheduler(vllm_config, config, self._pool)

    @staticmethod
    def _consumer_scheduler(vllm_config: VllmConfig, config: ConnectorConfig, pool: PoolSaves | None
                            ) -> ConsumerScheduler:
        recompute = recompute_tokens(vllm_config, config.options)
        if recompute > 1:
            logger.info("MooncakeConnector: the consumer computes the last %d tokens of each prompt itself "
                        "(recompute_tokens%s)", recompute, "" if config.options.recompute_tokens else
                        ": an MLA model on the CPU, whose decode attention path disagrees with its prefill path")
        fail = config.fail_loads
        if config.store is not None:
            logger.info("MooncakeConnector: KV pool at master %s: each request %s the pool how much of its prompt "
                        "it holds, loads the longest prefix found, and stores its blocks there when it ends",
                        config.store.master_server_address, "asks its producer and" if config.has_producer else "asks")
        if config.has_producer:
            logger.info("MooncakeConnector: kv_load_failure_policy=%s: each request asks its producer how much of its "
                        "prompt it holds and claims only that (found nothing: computed here); %s", "fail" if fail else
                        "recompute", "a KV load that was found and then fails ends its request with an error (set "
                        "kv_load_failure_policy to recompute in --kv-transfer-config to recompute the prompt instead)"
                        if fail else "a KV load that fails is recomputed here")
        return ConsumerScheduler(config, vllm_config.cache_config.block_size, recompute,
                                 pool.found if pool is not None else None)

    # ------------------------------------------------------------------ scheduler side (EngineCore process)
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._consumer is None:
            return 0, False  # a producer without a pool loads nothing
        return self._consumer.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._consumer is not None:
            self._consumer.after_alloc(request, blocks, num_external_tokens)
        if self._producer is not None:
            self._producer.after_alloc(request, blocks, num_external_tokens)
        if self._pool is not None:
            self._pool.after_alloc(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MooncakeConnectorMetadata(idle=scheduler_output.total_num_scheduled_tokens == 0)
        if self._producer is not None:
            meta = self._producer.build_meta(scheduler_output)
        if self._consumer is not None:
            loading = self._consumer.build_meta(scheduler_output)
            meta.loads, meta.lookups, meta.releases = loading.loads, loading.lookups, loading.releases
        if self._pool is not None:
            meta.pool_saves = self._pool.build_meta(scheduler_output)
            meta.held += self._pool.take_held()
        # every role: copies out of a device cache a preempted request's blocks may still feed (``handle_preemptions``)
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._consumer is not None:
            if isinstance(meta, MooncakeWorkerMetadata):
                self._consumer.answered(meta)
            self._consumer.received(set(connector_output.finished_recving or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # a producer holds the blocks a copy out of a GPU cache may still read (``scheduler.producer``'s ``hold``),
        # and any role the blocks a pool save will copy out (``scheduler.pool``)
        held, params = False, None
        if self._producer is not None:
            held, params = self._producer.finished(request)
        if self._consumer is not None:
            params = self._consumer.finished(request) or params
        if self._pool is not None:
            loading = self._consumer is not None and request.request_id in self._consumer.loading
            held = self._pool.finished(request, block_ids, loading) or held
        return held, params

    # ------------------------------------------------------------------ worker side (Worker process)
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker.register(kv_caches, worker_spec(self._vllm_config, self._kv_cache_config, list(kv_caches)))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, MooncakeConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_step(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous: a request runs only after its load finished (get_finished)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Push mode: queue this layer's newly completed blocks for the consumer. (Pull mode saves once per request
        in wait_for_save, when every layer of the final chunk is written.) Nothing in a run without metadata (vLLM's
        warm-up and CUDA graph capture runs)."""
        if self.has_connector_metadata():
            self._worker.save_layer(layer_name, self._meta())

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, MooncakeConnectorMetadata) and meta.idle
        finished = self._worker.transfer_results(idle)
        self._bad_blocks |= finished.bad_blocks
        return KVConnectorTransferResults(finished_sending=finished.sending, finished_recving=finished.done,
                                          failed_recving=finished.failed)

    def build_connector_worker_meta(self) -> MooncakeWorkerMetadata | None:
        answers = self._worker.lookup_answers()
        return MooncakeWorkerMetadata(answers) if answers else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def get_kv_connector_stats(self) -> MooncakeConnectorStats | None:
        taken = self._worker.take_stats() if self.role == KVConnectorRole.WORKER else None
        return None if taken is None else MooncakeConnectorStats(data=taken.data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> MooncakeConnectorStats | None:
        return MooncakeConnectorStats(data=data) if data is not None else MooncakeConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics:
        return MooncakePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Push mode copies each layer's blocks out in ``save_kv_layer``, which a replayed full CUDA graph never
        calls: vLLM then captures piecewise graphs (attention, and the hook, run outside them)."""
        return isinstance(extra_config, dict) and extra_config.get("transfer_mode") == "push"

    # ------------------------------------------------------------------ sleep mode (vLLM >= 0.33 calls these)
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """Yes: ``unregister_kv_caches`` drains the transfers and drops every registration of KV memory, and
        ``restore_kv_caches`` redoes it after wake-up (a GPU cache is never registered: it is staged through pinned
        host memory, so no peer can write into it while it sleeps)."""
        return True

    def unregister_kv_caches(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.suspend()

    release_kv_caches = unregister_kv_caches  # the name vLLM's newer releases call

    def restore_kv_caches(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.resume()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.close()

    def _meta(self) -> MooncakeConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        return meta
