"""Layer 1: a FIFO of tensors between two processes over the Mooncake Transfer Engine."""

from kv_pipe.base import KVPipeBase
from kv_pipe.config import MooncakeTransferEngineConfig
from kv_pipe.errors import (
    ConfigError,
    PeerDisconnected,
    PipeClosed,
    PipeError,
    PipeStalled,
    PipeTimeout,
    ProtocolError,
    TransferError,
)
from kv_pipe.mooncake_pipe import MooncakePipe

__all__ = [
    "ConfigError", "KVPipeBase", "MooncakePipe", "MooncakeTransferEngineConfig", "PeerDisconnected", "PipeClosed",
    "PipeError", "PipeStalled", "PipeTimeout", "ProtocolError", "TransferError",
]
