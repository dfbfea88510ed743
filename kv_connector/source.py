"""Where a consumer's load reads a request's KV, decided in one place: the producer the request's params name (checked
against the secret), else the one mooncake.json names. Pull reads from ``LoadSource.pipes``; push takes the entry
from the link of ``LoadSource.peer(rank)``. The scheduler decides when it claims the load; the worker only follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kv_connector import params as kv_params
from kv_connector.config import ConnectorConfig


@dataclass(frozen=True)
class LoadSource:
    """The producer a load reads from: its pipe address per TP rank."""

    pipes: list[str]
    from_params: bool  # named by the request's params (else mooncake.json's producer)
    same_tp: bool  # the producer runs this instance's TP size: its rank r pairs with our rank r

    def peer(self, rank: int) -> str | None:
        """The producer rank paired with our ``rank`` (push links go rank to rank); None if the TP sizes differ."""
        return self.pipes[rank] if self.same_tp else None


def load_source(params: dict[str, Any] | None, config: ConnectorConfig) -> LoadSource:
    """Where to load the KV of a request with these ``kv_transfer_params`` from. Raises ``params.ParamsError`` if
    they name a producer unusably (malformed, or unproven with a secret): such a request is recomputed, never loaded
    from a guessed place."""
    remote = kv_params.remote_prefill(params, config.secret)
    if remote is None:  # a proxy that forwards no params, or prefill and decode sent by hand
        return LoadSource(config.peer_pipes, from_params=False, same_tp=True)
    return LoadSource(remote.pipes, from_params=True, same_tp=len(remote.pipes) == config.tp_size)
