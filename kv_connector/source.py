"""Where a consumer's load reads a request's KV, decided in one place: nowhere if its params say
``do_remote_prefill: false``; the producer the request's params name (checked against the secret), else the one
mooncake.json names; or, for a decode sent together with its prefill (``mooncake_await_push``, push mode), whichever
producer pushes the prompt to this consumer. Pull reads from ``LoadSource.pipes``; push takes the entry from the link
of ``LoadSource.peer(rank)`` (an awaited push: from any push link, see ``worker.push.PushTransfer``). The scheduler decides
when it claims the load; the worker only follows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kv_connector import params as kv_params
from kv_connector.config import ConnectorConfig
from kv_connector.param_keys import AWAIT_PUSH

logger = logging.getLogger(f"vllm.{__name__}")
_told_await_push_in_pull_mode = False


@dataclass(frozen=True)
class LoadSource:
    """The producer a load reads from: its pipe address per TP rank."""

    pipes: list[str]
    from_params: bool  # named by the request's params (else mooncake.json's producer)
    same_tp: bool  # the producer runs this instance's TP size: its rank r pairs with our rank r
    await_push: bool = False  # no producer named (``pipes`` empty): take the push of whichever producer begins one
    pushed: bool = False  # the named producer pushes the prompt here (or says to pull it): wait for that news

    def peer(self, rank: int) -> str | None:
        """The producer rank paired with our ``rank`` (push links go rank to rank); None if the TP sizes differ or no
        producer is known yet (an awaited push), or there is none (the pool only)."""
        return self.pipes[rank] if self.same_tp and not self.await_push and self.pipes else None

    @property
    def pool_only(self) -> bool:
        """No producer to ask: the KV pool is the only place the prompt's KV may be."""
        return not self.pipes and not self.await_push


AWAITED_PUSH = LoadSource([], from_params=False, same_tp=True, await_push=True)
POOL_ONLY = LoadSource([], from_params=False, same_tp=True)  # an instance that loads from the KV pool only


def load_source(params: dict[str, Any] | None, config: ConnectorConfig) -> LoadSource | None:
    """Where to load the KV of a request with these ``kv_transfer_params`` from; None: load nothing, compute the
    prompt here. Raises ``params.ParamsError`` if they are unusable (malformed, or a producer unproven with a
    secret): such a request is recomputed, never loaded from a guessed place."""
    global _told_await_push_in_pull_mode
    if not config.has_producer:  # kv_both, or a producer: it computes its prompts, finding what it can in the pool
        return POOL_ONLY
    asked = kv_params.decode_params(params, config.secret)
    if not asked.load:
        return None
    if asked.pool_only:  # the proxy skipped the prefill for what the pool holds
        return POOL_ONLY if config.store is not None else None
    if asked.await_push:
        if config.push_mode:
            return AWAITED_PUSH
        if not _told_await_push_in_pull_mode:  # the proxy's choice, not a fault: said once
            _told_await_push_in_pull_mode = True
            logger.info("MooncakeConnector: requests that await a push (%s) are computed here: this consumer runs "
                        "in pull mode, nobody pushes to it", AWAIT_PUSH)
        return None
    if asked.pipes is None:  # a proxy that forwards no params, or prefill and decode sent by hand
        return LoadSource(config.peer_pipes, from_params=False, same_tp=True)
    same_tp = len(asked.pipes) == config.tp_size
    return LoadSource(asked.pipes, from_params=True, same_tp=same_tp,
                      pushed=asked.pushed and config.push_mode and same_tp)  # pushes go rank to rank


def push_link_source(peer: str, rank: int) -> LoadSource:
    """An awaited push's producer said "pull": load from it, the peer of the push link its notice came on (made and
    authenticated by the pipe's handshake, never named by a client). Push links go rank to rank, so only this rank's
    address is known; push mode's pull reads rank to rank and never looks at the others."""
    return LoadSource([""] * rank + [peer], from_params=False, same_tp=True)
