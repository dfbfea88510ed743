"""vLLM's side of the transfer statistics (``stats.py`` counts them without vLLM): the stats class vLLM carries
from the workers to its logger process, and the Prometheus metrics it exports on ``/metrics``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from kv_connector import params as kv_params
from kv_connector.config import ConnectorConfig
from kv_connector.param_keys import (
    ENDPOINT_INFO,
    ENGINE_ID_LABEL,
    KV_ROLE_LABEL,
    PIPES_LABEL,
    POOL_LABEL,
    PUSH_PROOF_LABEL,
    TRANSFER_MODE_LABEL,
)
from kv_connector.stats import COUNTERS, GAUGES, TransferStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")


@dataclass
class MooncakeConnectorStats(TransferStats, KVConnectorStats):
    """``TransferStats`` as vLLM's ``KVConnectorStats`` (its methods are ``TransferStats``'s)."""


def endpoint_info(config: ConnectorConfig) -> dict[str, str]:
    """What a proxy needs to know about this instance: role, transfer mode, pipe address per TP rank, engine id, and
    (a consumer, with a secret) the proof of its pipe addresses that a producer checks before pushing there."""
    pipes = config.pipes
    return {KV_ROLE_LABEL: config.kv_role, TRANSFER_MODE_LABEL: config.options.transfer_mode,
            PIPES_LABEL: ",".join(pipes), ENGINE_ID_LABEL: config.engine_id,
            PUSH_PROOF_LABEL: "" if config.is_producer or not pipes else kv_params.push_proof(config.secret, pipes),
            POOL_LABEL: "" if config.store is None else config.store.master_server_address}


class MooncakePromMetrics(KVConnectorPromMetrics):
    """``vllm:mooncake_kv_<counter>_total``, ``vllm:mooncake_kv_loads_in_flight``, histograms of the time and size
    of loads and saves and of the time of lookups, and ``vllm:mooncake_kv_endpoint_info`` (1, labelled with ``endpoint_info``)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {name: self._per_engine(self._counter_cls(name=f"vllm:mooncake_kv_{name}", documentation=doc,
                                                                  labelnames=labelnames))
                         for name, doc in COUNTERS.items()}
        self.gauges = {name: self._per_engine(self._gauge_cls(name=f"vllm:mooncake_kv_{name}", documentation=doc,
                                                              labelnames=labelnames, multiprocess_mode="mostrecent"))
                       for name, doc in GAUGES.items()}
        seconds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
        sizes = [float(2 ** (16 + 2 * i)) for i in range(9)]  # 64 KiB .. 4 GiB
        self.histograms = {}
        for kind, what in (("load", "pull loads (request to the producer, transfer, copy into the KV cache)"),
                           ("push_load", "push-mode loads: the wait for the push's commit plus the copy from the "
                                         "staging area into the KV cache; not a transfer time (the KV moved during "
                                         "the prefill)"),
                           ("save", "saves (gather from the KV cache into the producer's buffer)"),
                           ("pool_load", "loads from the KV pool (get, check, copy into the KV cache)"),
                           ("pool_save", "stores into the KV pool (gather from the KV cache, check what is there, "
                                         "put the rest)")):
            self.histograms[f"{kind}s", 2] = self._per_engine(self._histogram_cls(
                name=f"vllm:mooncake_kv_{kind}_seconds", documentation=f"Duration of {what}.", buckets=seconds,
                labelnames=labelnames))
            self.histograms[f"{kind}s", 1] = self._per_engine(self._histogram_cls(
                name=f"vllm:mooncake_kv_{kind}_bytes", documentation=f"KV bytes moved by {what}.", buckets=sizes,
                labelnames=labelnames))

        fine = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]  # a lookup is a round trip
        self.histograms["lookup_times", 2] = self._per_engine(self._histogram_cls(
            name="vllm:mooncake_kv_lookup_seconds", documentation="Duration of the consumer's lookups that got an "
            "answer (the question to the producer and its answer).", buckets=fine, labelnames=labelnames))
        self.histograms["pool_lookup_times", 2] = self._per_engine(self._histogram_cls(
            name="vllm:mooncake_kv_pool_lookup_seconds", documentation="Duration of lookups in the KV pool that got an "
            "answer (a round trip to the master).", buckets=fine, labelnames=labelnames))

        try:
            # built in vLLM's front-end process, where no connector exists to hand its parsed config over
            info = endpoint_info(ConnectorConfig.from_vllm(vllm_config))
        except Exception as e:  # the connector itself reports a bad config; metrics go on without
            logger.warning("MooncakeConnector: no %s on /metrics: %s", ENDPOINT_INFO, e)
        else:
            gauge = self._gauge_cls(name=ENDPOINT_INFO, documentation="This instance's MooncakeConnector endpoint: "
                                    "role, transfer mode, pipe address per TP rank (comma separated), engine id.",
                                    labelnames=[*labelnames, *info], multiprocess_mode="mostrecent")
            for values in per_engine_labelvalues.values():
                gauge.labels(*values, *info.values()).set(1)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counter in self.counters.items():
            if transfer_stats_data.get(name):
                counter[engine_idx].inc(transfer_stats_data[name])
        for name, gauge in self.gauges.items():
            if transfer_stats_data.get(name, -1) >= 0:
                gauge[engine_idx].set(transfer_stats_data[name])
        for (kind, column), histogram in self.histograms.items():
            for sample in transfer_stats_data.get(kind, ()):
                histogram[engine_idx].observe(sample[column])
