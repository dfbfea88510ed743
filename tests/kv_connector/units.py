"""Inputs for the connector's unit tests (no vLLM server): a parsed configuration, and vLLM's own scheduler-side
objects (``Request``, ``KVCacheBlocks``, ``SchedulerOutput``) built directly."""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, KVConnectorBlockState, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from kv_connector.config import ConnectorConfig, ConnectorOptions
from kv_lookup_buffer import StoreConfig
from kv_pipe import MooncakeTransferEngineConfig

PREFILL, DECODE = "10.0.0.1:13003", "10.0.0.2:13103"
MASTER = "10.0.0.9:50051"
SECRET = "s" * 40


def config(role: str = "kv_consumer", tp: int = 1, secret: str = "", mode: str = "pull",
           engine_id: str = "engine-1", pool: bool = False) -> ConnectorConfig:
    """``pool``: with a KV pool (a master at ``MASTER``)."""
    return ConnectorConfig(role, ConnectorOptions(transfer_mode=mode),
                           MooncakeTransferEngineConfig(prefill_url=PREFILL, decode_url=DECODE, auth_secret=secret,
                                                        allow_unauthenticated=not secret),
                           tp, engine_id, store=StoreConfig(MASTER) if pool else None)


def request(req_id: str, prompt_len: int, params: Any = None) -> Request:
    """A real vLLM request whose prompt is ``prompt_len`` tokens, carrying ``params`` as its kv_transfer_params."""
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(req_id, list(range(prompt_len)), SamplingParams(max_tokens=4, extra_args=extra), None)


def kv_blocks(block_ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in block_ids),))


def step(new: dict[str, tuple[int, int]] | None = None, cached: dict[str, tuple[int, int]] | None = None,
         block_ids: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """One scheduler step: ``new`` / ``cached`` requests as req_id -> (tokens computed before, tokens scheduled);
    ``block_ids``: each request's blocks, as the connector's block state offers them."""
    new, cached, block_ids = new or {}, cached or {}, block_ids or {}
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData(req_id, None, [], None, None, (block_ids.get(req_id, []),), start, None)
                              for req_id, (start, _) in new.items()]
    data = CachedRequestData.make_empty()
    data.req_ids = list(cached)
    data.num_computed_tokens = [start for start, _ in cached.values()]
    out.scheduled_cached_reqs = data
    out.num_scheduled_tokens = {req_id: n for req_id, (_, n) in (new | cached).items()}
    out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
    out.kv_connector_block_state = KVConnectorBlockState(set(block_ids), lambda req_id: (block_ids[req_id],), {})
    return out
