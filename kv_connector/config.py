"""The connector's configuration, parsed once per process: vLLM's kv_transfer_config (role, engine id), the
connector's options (``kv_connector_extra_config``) and mooncake.json; and the one rule that maps a role to its
pipe addresses (kv_rank 0: the producer at mooncake.json's prefill_url, 1: the consumer at decode_url; TP rank i
listens on that port + i)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

from kv_connector.options import ConnectorOptions, load_mooncake_config
from kv_pipe import ConfigError, MooncakeTransferEngineConfig
from kv_pipe.config import join_host_port

if TYPE_CHECKING:
    from vllm.config import VllmConfig

ROLES = ("kv_producer", "kv_consumer")


def kv_rank(is_producer: bool) -> int:
    """mooncake.json's index of a role: 0 the producer (prefill_url), 1 the consumer (decode_url)."""
    return 0 if is_producer else 1


def role_pipe(mooncake: MooncakeTransferEngineConfig, is_producer: bool, rank: int) -> str:
    """The pipe address of TP rank ``rank`` of the instance in that role, as mooncake.json names it."""
    return join_host_port(*mooncake.pipe_address(kv_rank(is_producer), rank))


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

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorConfig:
        """Parse and check; raises ``ConfigError`` (at start-up, not on the first request)."""
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_role not in ROLES:
            raise ConfigError(f"kv_role {transfer.kv_role!r}: MooncakeConnector needs \"kv_producer\" (prefill instance) "
                              "or \"kv_consumer\" (decode instance)")
        options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config)
        return cls(transfer.kv_role, options, load_mooncake_config(options),
                   vllm_config.parallel_config.tensor_parallel_size, transfer.engine_id or "",
                   transfer.kv_load_failure_policy == "fail")

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    @property
    def push_mode(self) -> bool:
        return self.options.transfer_mode == "push"

    @cached_property
    def secret(self) -> bytes:
        """Params are signed and checked with it (see kv_connector/params.py); empty: none."""
        return self.mooncake.secret

    @cached_property
    def pipes(self) -> list[str]:
        """This instance's pipe address per TP rank."""
        return role_pipes(self.mooncake, self.is_producer, self.tp_size)

    @cached_property
    def peer_pipes(self) -> list[str]:
        """The other role's pipe address per TP rank, as mooncake.json names it (assuming it runs this TP size): the
        peer of a request whose params name none."""
        return role_pipes(self.mooncake, not self.is_producer, self.tp_size)
