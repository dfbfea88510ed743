"""The connector's own options (``kv_connector_extra_config``), validated when vLLM creates the connector."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kv_pipe import ConfigError

GiB = 1 << 30


@dataclass(frozen=True)
class ConnectorOptions:
    """Options under ``kv_connector_extra_config``; every one has a default.

    - ``buffer_size``: bytes of KV the producer may hold for consumers to take (back-pressure beyond it).
    - ``save_timeout``: seconds the producer's forward pass may wait for buffer room before it drops an entry.
    - ``mooncake_config_path``: mooncake.json, if MOONCAKE_CONFIG_PATH is not set.
    - ``gil_switch_interval``: seconds; the Python thread switch interval set in the vLLM worker process (0 keeps
      Python's 5 ms). The transfer runs in side threads that compete for the GIL with vLLM's busy engine loop; each
      hand-over costs up to one interval.
    - ``allow_test_corruption``: tests only: a request whose ``kv_transfer_params`` hold
      ``{"mooncake_corrupt_kv_for_testing": true}`` gets its loaded KV scrambled, to prove the KV is really used.
    """

    buffer_size: int = 2 * GiB
    save_timeout: float = 5.0
    mooncake_config_path: str | None = None
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
        size = opts.buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ConfigError(f"kv_connector_extra_config.buffer_size: expected a positive number of bytes, got {size!r}")
        wait = opts.save_timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait <= 0:
            raise ConfigError(f"kv_connector_extra_config.save_timeout: expected seconds > 0, got {wait!r}")
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
