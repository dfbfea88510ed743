"""Per-request transfer statistics, carried from the worker to vLLM's metrics logger (plain, msgpack-able data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_COUNTERS = ("saved", "save_dropped", "loaded", "load_misses", "load_failures", "pushed", "push_loaded")


@dataclass
class MooncakeConnectorStats(KVConnectorStats):
    """``data``: counters plus ``transfers``, a list of [tokens, bytes, seconds] per completed load or save."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {name: 0 for name in _COUNTERS} | {"transfers": []}

    def count(self, name: str) -> None:
        self.data[name] += 1

    def record(self, tokens: int, nbytes: int, seconds: float) -> None:
        self.data["transfers"].append([tokens, nbytes, seconds])

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for name in _COUNTERS:
                self.data[name] += other.data.get(name, 0)
            self.data["transfers"] += other.data.get("transfers", [])
        return self

    def reduce(self) -> dict[str, int | float]:
        transfers: list[Any] = self.data["transfers"]
        nbytes = sum(t[1] for t in transfers)
        seconds = sum(t[2] for t in transfers)
        return {name: self.data[name] for name in _COUNTERS} | {
            "transfers": len(transfers),
            "tokens": sum(t[0] for t in transfers),
            "MiB": round(nbytes / 2**20, 1),
            "avg_ms": round(1e3 * seconds / len(transfers), 2) if transfers else 0.0,
            "GB/s": round(nbytes / seconds / 1e9, 3) if seconds else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data["transfers"] and not any(self.data[name] for name in _COUNTERS)
