"""The connector's own options (``kv_connector_extra_config``), validated when vLLM creates the connector."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_pipe import ConfigError, MooncakeTransferEngineConfig
from kv_pipe.config import CONFIG_ENV

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TRANSFER_MODES = ("pull", "push")
DIGEST_MODES = ("off", "sampled", "always")  # kv_connector/digest.py
HOLD_MODES = ("auto", "always")

GiB = 1 << 30


@dataclass(frozen=True)
class ConnectorOptions:
    """Options under ``kv_connector_extra_config``; every one has a default.

    - ``buffer_size``: producer: bytes of KV held for consumers to take; a save that does not fit evicts the oldest
      entries nobody took (the newest prompt is the likeliest to be decoded next). A save never waits.
    - ``entry_ttl``: producer: seconds an entry nobody took is kept (a prefill whose decode never came).
    - ``load_timeout``: consumer: seconds one load may take (request, transfer, copy) before it is given up and the
      prompt recomputed.
    - ``load_concurrency``: consumer: loads in flight at once (the fetch of one overlaps the copy of another).
    - ``lookup_timeout``: consumer: seconds a lookup (how much of a prompt the producer holds, asked before the
      prompt is claimed) may take once a thread took it; past it the prompt is computed here. It covers a lookup
      queued behind a few large loads on a busy link; a producer that could not be reached is then not asked for 2 s,
      so a dead one costs the first request at most this much.
    - ``mooncake_config_path``: mooncake.json, if MOONCAKE_CONFIG_PATH is not set.
    - ``transfer_mode``: "pull" (the consumer fetches a request's KV once the prefill is done) or "push" (the producer
      streams each layer's KV to the consumer while the prefill runs). Both instances must use the same mode.
    - ``link_idle``: seconds after which a link to a peer instance that carried nothing is closed (made again on
      next use).
    - ``push_staging_size``: consumer, push mode: bytes of pushed KV it may hold; when full, the producer serves
      further requests by pull.
    - ``push_ttl``: consumer, push mode: seconds a pushed entry waits for its decode request before it is dropped.
    - ``push_wait``: consumer, push mode: seconds a load waits for a push that has begun to be committed.
    - ``gil_switch_interval``: seconds; the Python thread switch interval set in the vLLM worker process (0 keeps
      Python's 5 ms). The transfer runs in side threads that compete for the GIL with vLLM's busy engine loop; each
      hand-over costs up to one interval.
    - ``recompute_tokens``: consumer: how many of a prompt's last tokens it computes itself instead of loading them
      (at least 1: vLLM computes the last one to sample from). 0 (the default) picks 1, or 2 for an MLA model on
      the CPU, whose single-token (decode) attention path disagrees with its prefill path (docs/architecture.md).
    - ``receive_into_cache``: consumer, pull, a host KV cache: receive a load straight into the cache's blocks (the
      cache is registered with the engine once; one copy less per loaded byte: more load throughput) instead of
      into a buffer copied into them. Then a load whose transfer stalls cannot end at ``load_timeout``: it waits
      until the stalled receive ends or the pipe's ``timeout`` (+5 s) passed, since the blocks may not be handed
      back while a write can still land. Off by default: a load ends by ``load_timeout`` whatever the network does.
    - ``kv_digest``: "off", "sampled" (the default) or "always": the consumer checks that a load's blocks hold the
      bytes the producer saved (kv_connector/digest.py), every ``kv_digest_sample``-th load or every one; a
      mismatch fails the load. A producer with "off" sends no digests (a consumer with "always" then fails its
      loads, one with "sampled" skips the check).
    - ``kv_digest_sample``: consumer, ``kv_digest`` "sampled": one load in this many is checked (default 16).
    - ``hold_blocks``: producer: "auto" (the default) or "always": whether vLLM keeps a finished request's blocks
      until the copies out of them ended (``request_finished`` answers True; the workers report the request in
      ``finished_sending``). "auto" holds them where those copies are asynchronous (a GPU cache); on the host they
      end within the step. "always" holds them on the host too, one step longer (tests use it to drive the path).
    - ``allow_test_corruption``: tests only: a request whose ``kv_transfer_params`` hold
      ``{"mooncake_corrupt_kv_for_testing": true}`` gets its loaded KV scrambled, to prove the KV is really used
      (no digest check for it); the values "flip_byte", "wrong_block", "stale" and "forged_digest" (pull: a byte and
      its block's digest changed; only the seal of a secret catches it) make faults the digest catches.
    """

    buffer_size: int = 2 * GiB
    entry_ttl: float = 30.0
    load_timeout: float = 10.0
    load_concurrency: int = 4
    lookup_timeout: float = 2.0
    mooncake_config_path: str | None = None
    transfer_mode: str = "pull"
    link_idle: float = 300.0
    push_staging_size: int = GiB
    push_ttl: float = 30.0
    push_wait: float = 5.0
    gil_switch_interval: float = 0.0001
    recompute_tokens: int = 0
    receive_into_cache: bool = False
    kv_digest: str = "sampled"
    kv_digest_sample: int = 16
    hold_blocks: str = "auto"
    allow_test_corruption: bool = False

    @classmethod
    def from_extra_config(cls, extra: Any) -> ConnectorOptions:
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
                              f"known keys: {', '.join(sorted(known))}")
        opts = cls(**extra)
        for name in ("buffer_size", "push_staging_size", "load_concurrency", "kv_digest_sample"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                what = "a positive number of bytes" if name.endswith("_size") else "a positive integer"
                raise ConfigError(f"kv_connector_extra_config.{name}: expected {what}, got {value!r}")
        for name in ("entry_ttl", "load_timeout", "push_ttl", "push_wait", "link_idle", "lookup_timeout"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise ConfigError(f"kv_connector_extra_config.{name}: expected seconds > 0 (and < 1e6), got {value!r}")
        if opts.kv_digest not in DIGEST_MODES:
            raise ConfigError(f"kv_connector_extra_config.kv_digest: expected one of {', '.join(DIGEST_MODES)}, got "
                              f"{opts.kv_digest!r}")
        if opts.hold_blocks not in HOLD_MODES:
            raise ConfigError(f"kv_connector_extra_config.hold_blocks: expected \"auto\" or \"always\", got "
                              f"{opts.hold_blocks!r}")
        if opts.transfer_mode not in TRANSFER_MODES:
            raise ConfigError(f"kv_connector_extra_config.transfer_mode: expected \"pull\" or \"push\", got "
                              f"{opts.transfer_mode!r}")
        interval = opts.gil_switch_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                interval == 0 or 1e-6 <= interval <= 0.1):
            raise ConfigError("kv_connector_extra_config.gil_switch_interval: expected seconds between 1e-6 and 0.1 "
                              f"(or 0 to keep Python's default), got {interval!r}")
        if opts.mooncake_config_path is not None and not isinstance(opts.mooncake_config_path, str):
            raise ConfigError("kv_connector_extra_config.mooncake_config_path: expected a path string")
        if isinstance(opts.recompute_tokens, bool) or not isinstance(opts.recompute_tokens, int) or \
                not 0 <= opts.recompute_tokens <= 4096:
            raise ConfigError("kv_connector_extra_config.recompute_tokens: expected an integer from 1 to 4096 (or 0 "
                              f"for the default), got {opts.recompute_tokens!r}")
        for name in ("allow_test_corruption", "receive_into_cache"):
            if not isinstance(getattr(opts, name), bool):
                raise ConfigError(f"kv_connector_extra_config.{name}: expected true or false")
        return opts


def load_mooncake_config(options: ConnectorOptions) -> MooncakeTransferEngineConfig:
    """mooncake.json, from MOONCAKE_CONFIG_PATH or the ``mooncake_config_path`` option."""
    if os.environ.get(CONFIG_ENV):
        return MooncakeTransferEngineConfig.load_from_env()
    if options.mooncake_config_path:
        return MooncakeTransferEngineConfig.from_file(options.mooncake_config_path)
    raise ConfigError(f"{CONFIG_ENV} is not set: point it at your mooncake.json (see mooncake.json.example), or set "
                      "kv_connector_extra_config.mooncake_config_path")


def recompute_tokens(vllm_config: VllmConfig, options: ConnectorOptions) -> int:
    """How many of a prompt's last tokens a consumer computes itself (see ``ConnectorOptions.recompute_tokens``)."""
    if options.recompute_tokens:
        return options.recompute_tokens
    from vllm.platforms import current_platform  # vLLM's platform is known only inside vLLM

    return 2 if vllm_config.model_config.use_mla and current_platform.is_cpu() else 1


UNQUANTIZED = ("auto", "float16", "bfloat16", "float", "float32", "half")
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(vllm_config: VllmConfig) -> None:
    """The KV moves as raw bytes: an unquantized cache, or an fp8 one (its bytes mean the same on both instances
    when their k/v scales agree, which every load checks: the scales are part of the layout descriptor). Other
    quantized caches (per-token scales, packed formats) are refused up front."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in UNQUANTIZED + FP8:
        raise ConfigError(f"--kv-cache-dtype {cache_dtype}: MooncakeConnector moves a KV cache in the model's dtype or "
                          f"in {', '.join(FP8)} (with equal k/v scales on both instances); serve both instances with "
                          "one of those")
    # vLLM releases that still have --calculate-kv-scales (0.32 has none) set the scales from the first batch, after
    # the connector read them: two instances could then agree on scales that are not the ones they use
    if cache_dtype in FP8 and getattr(vllm_config.cache_config, "calculate_kv_scales", False):
        raise ConfigError(f"--calculate-kv-scales with --kv-cache-dtype {cache_dtype}: MooncakeConnector checks that "
                          "both instances quantize the KV with the same k/v scales when it starts, but this flag has "
                          "vLLM estimate them later, from the first batch each instance serves; drop "
                          "--calculate-kv-scales (use a checkpoint's scales, or the default 1.0)")
