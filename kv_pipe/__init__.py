"""Layer 1: a FIFO of tensors between two processes over the Mooncake Transfer Engine.

Upper layers import from this package only (its API: docs/api.md)."""

from kv_pipe import auth
from kv_pipe.addresses import is_loopback, join_host_port, parse_host_port
from kv_pipe.base import KVPipeBase
from kv_pipe.config import (
    CONFIG_ENV,
    SECRET_ENV,
    STORE_KEYS,
    MooncakeTransferEngineConfig,
    physical_memory,
    read_config_file,
)
from kv_pipe.endpoint import PipeEndpoint
from kv_pipe.errors import (
    ConfigError,
    PeerDisconnected,
    PipeClosed,
    PipeError,
    PipeStalled,
    PipeTimeout,
    ProtocolError,
    TransferError,
    unknown_keys_error,
)
from kv_pipe.memory import RecyclePool, WarmPool, copy_bytes
from kv_pipe.mooncake_pipe import MooncakePipe
from kv_pipe.scatter import Scatter

__all__ = [
    "CONFIG_ENV", "SECRET_ENV", "STORE_KEYS", "ConfigError", "KVPipeBase", "MooncakePipe", "MooncakeTransferEngineConfig",
    "PeerDisconnected", "PipeClosed", "PipeEndpoint", "PipeError", "PipeStalled", "PipeTimeout", "ProtocolError",
    "RecyclePool", "Scatter", "TransferError", "WarmPool", "auth", "copy_bytes", "is_loopback", "join_host_port",
    "parse_host_port", "physical_memory", "read_config_file", "unknown_keys_error",
]
