"""mooncake.json's Mooncake Store keys (the pool), read and checked up front. The names and meanings are Mooncake's own,
as vLLM's ``MooncakeStoreConnector`` reads them (``vllm/distributed/mooncake_store.py``), so that one file serves both
connectors; the keys the store shares with the Transfer Engine (``metadata_server``, ``protocol``, ``device_name``) are
the pipe's (``kv_pipe.MooncakeTransferEngineConfig``). The pool is on when ``master_server_address`` is set.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from kv_pipe import STORE_KEYS, ConfigError, parse_host_port, physical_memory

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_SEGMENT = 4 * GiB  # vLLM's defaults for both sizes
DEFAULT_BUFFER = 4 * GiB
MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller segment
MODES = ("embedded", "standalone-store")
_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40}


def parse_size(value: Any, field: str) -> int:
    """Bytes, as an integer or a string with a unit (``"512MB"``, ``"4 GB"``, ``"1.5gb"``: binary units, as vLLM
    reads them)."""
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a number of bytes or a size such as \"4GB\", got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(b|kb|mb|gb|tb)?\s*", value.lower())
        if match:
            return int(float(match.group(1)) * _UNITS[match.group(2) or "b"])
    raise ConfigError(f"{field}: expected a number of bytes or a size such as \"4GB\" or \"512MB\", got {value!r}")


@dataclass(frozen=True)
class StoreConfig:
    """``master_server_address``: the ``mooncake_master`` (``host:port`` of its RPC port). ``global_segment_size``:
    memory each worker rank gives the pool (objects of any instance may land in it; 0 with ``mode``
    ``"standalone-store"``, where a separate ``mooncake_client`` process holds the pool's memory).
    ``local_buffer_size``: host memory each worker rank stages its puts and gets through. ``tenant_id``: objects of
    another tenant are invisible. ``enable_offload`` is vLLM's (SSD offload); this connector does not offload.
    ``local_hostname``: the address other clients reach this one at (Mooncake's key; default: the instance's)."""

    master_server_address: str
    global_segment_size: int = DEFAULT_SEGMENT
    local_buffer_size: int = DEFAULT_BUFFER
    mode: str = "embedded"
    tenant_id: str = "default"
    enable_offload: bool = False
    local_hostname: str = ""

    def __post_init__(self) -> None:
        parse_host_port(self.master_server_address, "master_server_address")
        ram = physical_memory()
        segment = parse_size(self.global_segment_size, "global_segment_size")
        buffer = parse_size(self.local_buffer_size, "local_buffer_size")
        if self.mode not in MODES:
            raise ConfigError(f"mode: expected \"embedded\" (each worker rank gives global_segment_size bytes to the "
                              f"pool) or \"standalone-store\" (a mooncake_client process does), got {self.mode!r}")
        if self.mode == "embedded" and not MIN_SEGMENT <= segment <= ram:
            raise ConfigError(f"global_segment_size: expected bytes from {MIN_SEGMENT} (16 MiB, Mooncake's least) to "
                              f"this machine's RAM ({ram}) with mode \"embedded\", got {self.global_segment_size!r}; "
                              "e.g. \"4GB\"")
        if self.mode == "standalone-store" and segment != 0:
            raise ConfigError("global_segment_size: must be 0 with mode \"standalone-store\" (the pool's memory is "
                              "the mooncake_client process's)")
        if not 0 < buffer <= ram:
            raise ConfigError(f"local_buffer_size: expected bytes > 0 and at most this machine's RAM ({ram}), got "
                              f"{self.local_buffer_size!r}; e.g. \"1GB\"")
        if not isinstance(self.tenant_id, str) or not self.tenant_id.strip():
            raise ConfigError(f"tenant_id: expected a non-empty string, got {self.tenant_id!r}")
        if not isinstance(self.local_hostname, str) or (self.local_hostname and any(
                c in self.local_hostname for c in " /")):
            raise ConfigError(f"local_hostname: expected a host name or IP address, got {self.local_hostname!r}")
        if not isinstance(self.enable_offload, bool):
            raise ConfigError(f"enable_offload: expected true or false, got {self.enable_offload!r}")
        object.__setattr__(self, "global_segment_size", segment)
        object.__setattr__(self, "local_buffer_size", buffer)
        object.__setattr__(self, "tenant_id", self.tenant_id.strip())

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> StoreConfig | None:
        """The store keys of mooncake.json's ``data`` (the other keys are the pipe's); None without
        ``master_server_address`` (no pool), in which case no other store key may be set."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        given = {k: v for k, v in data.items() if k in STORE_KEYS}
        try:
            if "master_server_address" not in given:
                if given:
                    raise ConfigError(f"{', '.join(sorted(given))} set without master_server_address: add the "
                                      "mooncake_master's \"host:port\" to use the pool, or remove them")
                return None
            config = cls(**given)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        if config.enable_offload:
            logger.warning("%s: enable_offload is read by vLLM's MooncakeStoreConnector; MooncakeConnector keeps its "
                           "pool in memory only", source)
        return config
