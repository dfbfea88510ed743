"""Transfer statistics: counted in the worker (``StatsRecorder``), carried to vLLM's metrics as plain, msgpack-able
data (``vllm_stats.py`` wraps them in vLLM's classes), logged in its periodic "KV Transfer metrics" line and exported on
``/metrics`` as ``vllm:mooncake_kv_*``. No vLLM here: the worker's data path runs without it.

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
from dataclasses import dataclass, field
from typing import Any

COUNTERS = {  # name -> help text
    "saved": "Prompts whose KV the producer saved for a consumer.",
    "save_dropped": "Prompts whose KV the producer could not save (the consumer recomputes them).",
    "expired": "Saved entries dropped because no consumer took them within entry_ttl.",
    "evicted": "Saved entries dropped to make room for newer ones (buffer_size reached).",
    "pushed": "Prompts whose KV the producer pushed to the consumer in full (push mode).",
    "push_dropped": "Pushes the producer gave up mid-prefill (no room in its pinned memory, sleep mode): served by "
                    "pull instead (push mode).",
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
    "load_failures": "Loads that failed (peer down, timeout, layout mismatch, KV digest mismatch; recomputed).",
    "digest_checks": "Loads whose blocks were read back and matched the producer's KV digests (kv_digest).",
    "digest_mismatches": "Loads whose blocks did not hold what the producer saved (failed; also load_failures).",
    "digest_missing": "Checked loads whose producer sent no KV digests (kv_digest off there; failed under always).",
    "digest_unchecked": "Checked loads of parts of blocks (producer and consumer of different TP sizes) whose "
                        "producer sent a digest per block, not per head: not checked.",
    "push_expired": "Pushed entries dropped on the consumer because no request took them within push_ttl.",
    "lookups": "Consumer: lookups that asked the producer how much of a prompt it holds before claiming it (per TP "
               "rank).",
    "lookup_hits": "Consumer: lookups that found some of the prompt's KV (held for the request's load).",
    "lookup_misses": "Consumer: lookups that found none of the prompt's KV (the prompt is computed here).",
    "lookup_errors": "Consumer: lookups that could not tell (producer unreachable or backing off, no answer within "
                     "lookup_timeout, malformed answer): the prompt is computed here.",
    "lookup_hit_tokens": "Consumer: prompt tokens lookups found held by the producer.",
    "leases": "Producer: entries a consumer's lookup found, held for that consumer's load.",
    "leases_expired": "Producer: leases that ended unused (the consumer that found the entry never came for it).",
    "fetched_bytes": "KV bytes received from producers by pull loads.",
    "loaded_bytes": "KV bytes written into this instance's KV cache by loads.",
    "saved_bytes": "KV bytes the producer saved for consumers.",
    "served_bytes": "KV bytes the producer sent to consumers that asked for them.",
    "pushed_bytes": "KV bytes the producer pushed to consumers during prefills.",
    "pool_lookups": "Lookups that asked the KV pool how much of a prompt it holds (per TP rank).",
    "pool_lookup_hits": "Pool lookups that found some of the prompt's blocks.",
    "pool_lookup_misses": "Pool lookups that found none of the prompt's blocks.",
    "pool_lookup_errors": "Pool lookups that could not tell (master unreachable or slow): nothing loaded from it.",
    "pool_hit_tokens": "Prompt tokens pool lookups found in the pool.",
    "pool_loaded": "Loads that wrote KV from the pool into this instance's cache (also counted in loaded).",
    "pool_load_misses": "Loads from the pool that found none of their blocks any more (evicted, their holder gone; "
                        "recomputed, or failed under kv_load_failure_policy fail).",
    "pool_loaded_bytes": "KV bytes loads wrote from the pool into this instance's cache.",
    "pool_saved_blocks": "Blocks this instance stored in the pool (those there already are skipped).",
    "pool_saved_bytes": "KV bytes this instance stored in the pool.",
    "pool_save_errors": "Requests whose blocks could not be stored in the pool (master unreachable, no room).",
    "pool_rejected": "Pool objects that failed their check (forged, altered, mis-keyed, or stored without this "
                     "fleet's secret): removed, not loaded.",
    "pool_timeouts": "Pool calls that did not end within their deadline (a frozen master or holder).",
    "pool_errors": "Pool calls that failed (master or holder unreachable, an error code).",
}
GAUGES = {"loads_in_flight": "Loads started and not finished yet."}
SAMPLES = ("loads", "push_loads", "saves", "lookup_times", "pool_loads", "pool_saves",
           "pool_lookup_times")  # per completed operation: [tokens, bytes, seconds]


@dataclass
class TransferStats:
    """``data``: the counters, the gauges, and ``SAMPLES``: [tokens, bytes, seconds] per completed pull load, push
    load, save or lookup (for the histograms and the log line's averages; a lookup moves no bytes). A push load's
    seconds are not a transfer time: the wait for the push's commit and the copy from the staging area (the KV moved
    during the prefill)."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0) | dict.fromkeys(GAUGES, -1) | {kind: [] for kind in SAMPLES}

    def aggregate(self, other: TransferStats) -> TransferStats:
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
                if kind not in ("push_loads", "lookup_times", "pool_lookup_times"):  # a wait, not a transfer
                    out[f"{kind}_GB/s"] = round(nbytes / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[kind] for kind in SAMPLES) and not any(self.data[n] for n in COUNTERS) \
            and all(self.data[n] < 0 for n in GAUGES)


class StatsRecorder:
    """The worker's running stats, shared by its threads; ``take`` hands them to vLLM and starts afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()
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

    def take(self) -> TransferStats | None:
        with self._lock:
            for name, value in self._gauges.items():
                if value != self._reported_gauges[name]:
                    self._stats.data[name] = self._reported_gauges[name] = value
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, TransferStats()
        return stats
