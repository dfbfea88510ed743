"""The connector's configuration, parsed once per process and checked at start-up: vLLM's kv_transfer_config (role,
engine id), the connector's options (``kv_connector_extra_config``, every key in docs/configuration.md) and
mooncake.json; and the one rule that maps a role to its pipe addresses (kv_rank 0: the producer at mooncake.json's
prefill_url, 1: the consumer at decode_url; TP rank i listens on that port + i)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from kv_lookup_buffer import StoreConfig
from kv_pipe import (
    CONFIG_ENV,
    ConfigError,
    MooncakeTransferEngineConfig,
    is_loopback,
    join_host_port,
    parse_host_port,
    read_config_file,
    unknown_keys_error,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TRANSFER_MODES = ("pull", "push")
DIGEST_MODES = ("off", "sampled", "always")  # kv_connector/worker/digest.py
HOLD_MODES = ("auto", "always")
PLACEMENTS = ("spread", "local")  # where pool puts go: the master's choice, or this instance's segment first

GiB = 1 << 30


@dataclass(frozen=True)
class ConnectorOptions:
    """Options under ``kv_connector_extra_config``; every one has a default. What each means: docs/configuration.md."""

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
    pool_namespace: str = ""
    pool_save_output: bool = True
    pool_lookups: bool = True
    pool_placement: str = "spread"

    @classmethod
    def from_extra_config(cls, extra: Any) -> ConnectorOptions:
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise unknown_keys_error("kv_connector_extra_config", unknown, known)
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
        for name in ("receive_into_cache", "pool_save_output", "pool_lookups"):
            if not isinstance(getattr(opts, name), bool):
                raise ConfigError(f"kv_connector_extra_config.{name}: expected true or false")
        if opts.pool_placement not in PLACEMENTS:
            raise ConfigError("kv_connector_extra_config.pool_placement: expected \"spread\" (the master places each "
                              "object, Mooncake's default) or \"local\" (this instance's own segment first), got "
                              f"{opts.pool_placement!r}")
        if not isinstance(opts.pool_namespace, str) or len(opts.pool_namespace) > 256:
            raise ConfigError("kv_connector_extra_config.pool_namespace: expected a string of at most 256 characters")
        return opts


def load_mooncake_config(options: ConnectorOptions) -> tuple[MooncakeTransferEngineConfig, StoreConfig | None]:
    """mooncake.json: the pipe's keys and, if ``master_server_address`` is set, the KV pool's (Mooncake Store's).
    From the ``mooncake_config_path`` option if set (a setting of this connector wins over the environment, which
    connectors composed in vLLM's MultiConnector share), else from MOONCAKE_CONFIG_PATH."""
    path = options.mooncake_config_path or os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(f"{CONFIG_ENV} is not set: point it at your mooncake.json (see mooncake.json.example), or "
                          "set kv_connector_extra_config.mooncake_config_path")
    data = read_config_file(path)
    return MooncakeTransferEngineConfig.from_dict(data, source=str(path)), StoreConfig.from_dict(data, source=str(path))


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


ROLES = ("kv_producer", "kv_consumer", "kv_both")


def kv_rank(is_producer: bool) -> int:
    """mooncake.json's index of a role: 0 the producer (prefill_url), 1 the consumer (decode_url)."""
    return 0 if is_producer else 1


def role_pipe(mooncake: MooncakeTransferEngineConfig, is_producer: bool, rank: int) -> str:
    """The pipe address of TP rank ``rank`` of the instance in that role, as mooncake.json names it."""
    return join_host_port(*mooncake.pipe_address(kv_rank(is_producer), rank))


def store_host(config: ConnectorConfig) -> str:
    """The address other pool clients reach this instance's store client at (its segment's data moves there):
    mooncake.json's ``local_hostname``, else ``VLLM_HOST_IP`` (vLLM's own), else the host of this role's pipe
    (prefill_url's for kv_both)."""
    assert config.store is not None
    if config.store.local_hostname:
        return config.store.local_hostname
    if os.environ.get("VLLM_HOST_IP"):
        return os.environ["VLLM_HOST_IP"]
    return config.mooncake.pipe_address(kv_rank(not config.has_producer), 0)[0]


def role_pipes(mooncake: MooncakeTransferEngineConfig, is_producer: bool, tp_size: int) -> list[str]:
    """The pipe address per TP rank of an instance in that role running ``tp_size`` ranks."""
    return [role_pipe(mooncake, is_producer, rank) for rank in range(tp_size)]


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector reads from the configuration (see the module docstring). What is derived from it and
    read per request (the secret, the pipe addresses) is worked out once."""

    kv_role: str
    options: ConnectorOptions
    mooncake: MooncakeTransferEngineConfig
    tp_size: int
    engine_id: str
    fail_loads: bool = False  # vLLM's kv_load_failure_policy is "fail": a failed load ends its request with an error
    store: StoreConfig | None = None  # the KV pool (mooncake.json's master_server_address); None: no pool

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        """Parse and check; raises ``ConfigError`` (at start-up, not on the first request)."""
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ROLES:
            raise ConfigError(f"kv_role {transfer.kv_role!r}: MooncakeConnector needs \"kv_producer\" (prefill instance) "
                              "or \"kv_consumer\" (decode instance), or \"kv_both\" (an instance that prefills and "
                              "decodes, sharing the KV pool)")
        options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        mooncake, store = load_mooncake_config(options)
        if transfer.kv_role == "kv_both" and store is None:
            raise ConfigError("kv_role \"kv_both\" shares KV through the KV pool only: set master_server_address (the "
                              "mooncake_master's \"host:port\") in mooncake.json, or run the instance as kv_producer or "
                              "kv_consumer")
        config = cls(transfer.kv_role, options, mooncake, vllm_config.parallel_config.tensor_parallel_size,
                     transfer.engine_id or "", transfer.kv_load_failure_policy == "fail", store)
        config.check_pool_exposure()
        return config

    def check_pool_exposure(self) -> None:
        """A pool beyond loopback without a secret: anyone who reaches its master or members could plant KV that
        every member loads. Refused, as the pipe is, unless ``allow_unauthenticated``."""
        if self.store is None or self.secret or self.mooncake.allow_unauthenticated:
            return
        master = parse_host_port(self.store.master_server_address, "master_server_address")[0]
        exposed = [h for h in (master, store_host(self)) if not is_loopback(h)]
        if exposed:
            raise ConfigError(
                f"the KV pool reaches beyond this host ({exposed[0]}) and no secret is set: anyone who reaches its "
                "master or its members could plant KV this instance loads. Set the same \"auth_secret\" (32+ "
                "characters) in every instance's mooncake.json or MOONCAKE_KV_SECRET in their environment; or, on a "
                "network where every host is trusted, set \"allow_unauthenticated\": true")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def is_both(self) -> bool:
        """kv_both: no pipe, no peer; KV comes from and goes to the pool."""
        return self.kv_role == "kv_both"

    @property
    def has_producer(self) -> bool:
        """A consumer: requests load from a producer's hand-off (and the pool)."""
        return self.kv_role == "kv_consumer"

    @property
    def looks_in_pool(self) -> bool:
        return self.store is not None and self.options.pool_lookups

    @property
    def loads(self) -> bool:
        """This instance loads KV: a consumer, or any instance that looks in a pool."""
        return self.has_producer or self.looks_in_pool

    @property
    def push_mode(self) -> bool:
        return self.options.transfer_mode == "push"

    @cached_property
    def secret(self) -> bytes:
        """Params are signed and checked with it (see kv_connector/params.py); empty: none."""
        return self.mooncake.secret

    @cached_property
    def pipes(self) -> list[str]:
        """This instance's pipe address per TP rank (none for kv_both)."""
        return [] if self.is_both else role_pipes(self.mooncake, self.is_producer, self.tp_size)

    @cached_property
    def peer_pipes(self) -> list[str]:
        """The other role's pipe address per TP rank, as mooncake.json names it (assuming it runs this TP size): the
        peer of a request whose params name none."""
        return role_pipes(self.mooncake, not self.is_producer, self.tp_size)
