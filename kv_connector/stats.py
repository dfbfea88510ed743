"""Transfer statistics: counted in the worker, carried to vLLM's metrics (plain, msgpack-able data), logged in its
periodic "KV Transfer metrics" line and exported on ``/metrics`` as ``vllm:mooncake_kv_*``.

Bytes are counted where they really moved, never inferred from a claim (vLLM counts a claimed load as an external
prefix-cache hit even when it then fails and the prompt is recomputed):

- ``fetched_bytes``: consumer, pull: KV bytes received from the producer.
- ``loaded_bytes``: consumer: KV bytes written into this instance's cache by loads (pulled or pushed).
- ``saved_bytes``: producer: KV bytes put into its buffer for consumers to take.
- ``served_bytes``: producer: KV bytes sent to consumers that asked (pull).
- ``pushed_bytes``: producer, push mode: KV bytes streamed to the consumer during prefills.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.logger import init_logger

from kv_connector import params as kv_params
from kv_connector.config import ConnectorConfig
from kv_connector.protocol import ENDPOINT_INFO

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(f"vllm.{__name__}")

COUNTERS = {  # name -> help text
    "saved": "Prompts whose KV the producer saved for a consumer.",
    "save_dropped": "Prompts whose KV the producer could not save (the consumer recomputes them).",
    "expired": "Saved entries dropped because no consumer took them within entry_ttl.",
    "evicted": "Saved entries dropped to make room for newer ones (buffer_size reached).",
    "pushed": "Prompts whose KV the producer pushed to the consumer in full (push mode).",
    "loaded": "Loads that wrote the producer's KV into this instance's cache.",
    "push_loaded": "Loads served from KV the producer had pushed (push mode).",
    "await_push_loads": "Loads of decodes sent together with their prefill (mooncake_await_push) that got the KV: "
                        "pushed, or pulled from the producer that began the push (push mode).",
    "await_push_timeouts": "Loads of decodes sent together with their prefill for which no producer began a push "
                           "within push_wait (recomputed; also counted as load_failures).",
    "param_loads": "Loads from the producer the request's params named (verified against the secret if one is set); "
                   "the others load from mooncake.json's prefill_url.",
    "partial_loads": "Loads that got only some of the blocks they claimed (the rest is recomputed).",
    "load_misses": "Loads for which the producer held no KV (recomputed).",
    "load_failures": "Loads that failed (peer down, timeout, layout mismatch; recomputed).",
    "push_expired": "Pushed entries dropped on the consumer because no request took them within push_ttl.",
    "fetched_bytes": "KV bytes received from producers by pull loads.",
    "loaded_bytes": "KV bytes written into this instance's KV cache by loads.",
    "saved_bytes": "KV bytes the producer saved for consumers.",
    "served_bytes": "KV bytes the producer sent to consumers that asked for them.",
    "pushed_bytes": "KV bytes the producer pushed to consumers during prefills.",
}
GAUGES = {"loads_in_flight": "Loads started and not finished yet."}
SAMPLES = ("loads", "push_loads", "saves")  # per completed operation: [tokens, bytes, seconds]


@dataclass
class MooncakeConnectorStats(KVConnectorStats):
    """``data``: the counters, the gauges, and ``SAMPLES``: [tokens, bytes, seconds] per completed pull load, push
    load or save (for the histograms and the log line's averages). A push load's seconds are not a transfer time:
    the wait for the push's commit and the copy from the staging area (the KV moved during the prefill)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0) | dict.fromkeys(GAUGES, -1) | {kind: [] for kind in SAMPLES}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Workers of one step (tensor parallel ranks) or successive steps: counters and samples add up; a gauge
        takes the other's value when it has one."""
        if not other.is_empty():
            for name in COUNTERS:
                self.data[name] += other.data.get(name, 0)
            for name in GAUGES:
                if other.data.get(name, -1) >= 0:
                    self.data[name] = other.data[name]
            for kind in SAMPLES:
                self.data[kind] += other.data.get(kind, [])
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in COUNTERS if self.data[name]}
        for kind in SAMPLES:
            samples: list[Any] = self.data[kind]
            if samples:
                nbytes, seconds = sum(s[1] for s in samples), sum(s[2] for s in samples)
                out[f"{kind}_avg_ms"] = round(1e3 * seconds / len(samples), 2)
                if kind != "push_loads":  # a wait, not a transfer: no rate
                    out[f"{kind}_GB/s"] = round(nbytes / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[kind] for kind in SAMPLES) and not any(self.data[n] for n in COUNTERS) \
            and all(self.data[n] < 0 for n in GAUGES)


class StatsRecorder:
    """The worker's running stats, shared by its threads; ``take`` hands them to vLLM and starts afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = MooncakeConnectorStats()
        self._gauges = dict.fromkeys(GAUGES, 0)
        self._reported_gauges = dict.fromkeys(GAUGES, -1)

    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._stats.data[name] += n

    def sample(self, kind: str, tokens: int, nbytes: int, seconds: float) -> None:
        """One completed operation (``kind``: one of ``SAMPLES``)."""
        with self._lock:
            self._stats.data[kind].append([tokens, nbytes, seconds])

    def counter(self, names: dict[str, str]) -> Callable[[str, int], None]:
        """A buffer's ``on_count``: records its counts named in ``names`` under our names (the others are its own)."""
        def record(name: str, n: int) -> None:
            ours = names.get(name)
            if ours is not None:
                self.count(ours, n)

        return record

    def gauge(self, name: str, delta: int) -> None:
        with self._lock:
            self._gauges[name] += delta

    def take(self) -> MooncakeConnectorStats | None:
        with self._lock:
            for name, value in self._gauges.items():
                if value != self._reported_gauges[name]:
                    self._stats.data[name] = self._reported_gauges[name] = value
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, MooncakeConnectorStats()
        return stats


def endpoint_info(config: ConnectorConfig) -> dict[str, str]:
    """What a proxy needs to know about this instance: role, transfer mode, pipe address per TP rank, engine id, and
    (a consumer, with a secret) the proof of its pipe addresses that a producer checks before pushing there."""
    pipes = config.pipes
    return {"kv_role": config.kv_role, "transfer_mode": config.options.transfer_mode, "pipes": ",".join(pipes),
            "kv_engine_id": config.engine_id,
            "push_proof": "" if config.is_producer else kv_params.push_proof(config.secret, pipes)}


class MooncakePromMetrics(KVConnectorPromMetrics):
    """``vllm:mooncake_kv_<counter>_total``, ``vllm:mooncake_kv_loads_in_flight``, histograms of the time and size
    of loads and saves, and ``vllm:mooncake_kv_endpoint_info`` (1, labelled with ``endpoint_info``)."""

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
                           ("save", "saves (gather from the KV cache into the producer's buffer)")):
            self.histograms[f"{kind}s", 2] = self._per_engine(self._histogram_cls(
                name=f"vllm:mooncake_kv_{kind}_seconds", documentation=f"Duration of {what}.", buckets=seconds,
                labelnames=labelnames))
            self.histograms[f"{kind}s", 1] = self._per_engine(self._histogram_cls(
                name=f"vllm:mooncake_kv_{kind}_bytes", documentation=f"KV bytes moved by {what}.", buckets=sizes,
                labelnames=labelnames))

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
