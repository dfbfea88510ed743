"""The connector's own options (``kv_connector_extra_config``), validated when vLLM creates the connector."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kv_pipe import ConfigError
from kv_pipe.config import TRANSFER_MODES

GiB = 1 << 30


@dataclass(frozen=True)
class ConnectorOptions:
    """Options under ``kv_connector_extra_config``; every one has a default.

    - ``buffer_size``: bytes of KV the producer may hold for consumers to take (back-pressure beyond it).
    - ``save_timeout``: seconds the producer's forward pass may wait for buffer room before it drops an entry.
    - ``mooncake_config_path``: mooncake.json, if MOONCAKE_CONFIG_PATH is not set.
    - ``transfer_mode``: "pull" (the consumer fetches a request's KV once the prefill is done) or "push" (the producer
      streams each layer's KV to the consumer while the prefill runs); default: mooncake.json's ``transfer_mode``,
      else "pull". Both instances must use the same mode.
    - ``push_staging_size``: consumer, push mode: bytes of pushed KV it may hold; when full, the producer serves
      further requests by pull.
    - ``push_ttl``: consumer, push mode: seconds a pushed entry waits for its decode request before it is dropped.
    - ``push_wait``: consumer, push mode: seconds a load waits for a push still on its way to complete.
    - ``gil_switch_interval``: seconds; the Python thread switch interval set in the vLLM worker process (0 keeps
      Python's 5 ms). The transfer runs in side threads that compete for the GIL with vLLM's busy engine loop; each
      hand-over costs up to one interval.
    - ``allow_test_corruption``: tests only: a request whose ``kv_transfer_params`` hold
      ``{"mooncake_corrupt_kv_for_testing": true}`` gets its loaded KV scrambled, to prove the KV is really used.
    """

    buffer_size: int = 2 * GiB
    save_timeout: float = 5.0
    mooncake_config_path: str | None = None
    transfer_mode: str | None = None
    push_staging_size: int = GiB
    push_ttl: float = 60.0
    push_wait: float = 5.0
    gil_switch_interval: float = 0.0001
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
        for name in ("buffer_size", "push_staging_size"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name}: expected a positive number of bytes, got {value!r}")
        for name in ("save_timeout", "push_ttl", "push_wait"):
            value = getattr(opts, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"kv_connector_extra_config.{name}: expected seconds > 0, got {value!r}")
        if opts.transfer_mode is not None and opts.transfer_mode not in TRANSFER_MODES:
            raise ConfigError(f"kv_connector_extra_config.transfer_mode: expected \"pull\" or \"push\", got "
                              f"{opts.transfer_mode!r}")
        interval = opts.gil_switch_interval
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                interval == 0 or 1e-6 <= interval <= 0.1):
            raise ConfigError("kv_connector_extra_config.gil_switch_interval: expected seconds between 1e-6 and 0.1 "
                              f"(or 0 to keep Python's default), got {interval!r}")
        if opts.mooncake_config_path is not None and not isinstance(opts.mooncake_config_path, str):
            raise ConfigError("kv_connector_extra_config.mooncake_config_path: expected a path string")
        if not isinstance(opts.allow_test_corruption, bool):
            raise ConfigError("kv_connector_extra_config.allow_test_corruption: expected true or false")
        return opts
