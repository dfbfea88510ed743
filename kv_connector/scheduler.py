"""The connector's scheduler side (vLLM's EngineCore process): decides what to save and what to load; knows requests
and block ids, never touches KV.

Producer: every prompt is saved in the step that completes its prefill (push mode also streams it step by step).
Consumer: a request claims its prompt, except the blocks this instance already holds in its own prefix cache and
the last token (vLLM recomputes that one), as one asynchronous load into exactly the blocks it lacks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_connector.metadata import CORRUPT_PARAM, LoadRequest, MooncakeConnectorMetadata, PushStep, SaveRequest

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class ConnectorScheduler:
    def __init__(self, is_producer: bool, block_size: int, push: bool = False) -> None:
        self.is_producer = is_producer
        self.block_size = block_size
        self.push = push
        self.prompts: dict[str, list[int]] = {}  # producer: prompts still prefilling
        self.pushing: set[str] = set()  # producer, push mode: prompts whose first step was announced to the worker
        self.local_hits: dict[str, int] = {}  # consumer: locally cached tokens when the load was claimed
        self.claimed: set[str] = set()  # consumer: one load attempt per request (a failed one is recomputed, not retried)
        self.loads: list[LoadRequest] = []  # consumer: loads to start in the next step

    # ---------------------------------------------------------------- consumer
    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """``num_computed_tokens``: this instance's own prefix-cache hit, block aligned (vLLM passes it so)."""
        if self.is_producer:
            return 0, False
        claim = len(request.prompt_token_ids or ()) - 1 - num_computed_tokens  # vLLM recomputes the last token
        if claim <= 0 or request.request_id in self.claimed:
            return 0, False
        self.local_hits[request.request_id] = num_computed_tokens
        return claim, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.is_producer:
            self.prompts[request.request_id] = list(request.prompt_token_ids or ())
            return
        if num_external_tokens <= 0:
            return
        self.claimed.add(request.request_id)
        local = self.local_hits.pop(request.request_id, 0)
        first, end = local // self.block_size, _blocks(local + num_external_tokens, self.block_size)
        block_ids = list(blocks.get_block_ids()[0])  # every block of the request, the cached ones first
        corrupt = bool((request.kv_transfer_params or {}).get(CORRUPT_PARAM))
        self.loads.append(LoadRequest(request.request_id, list(request.prompt_token_ids or ()), first,
                                      block_ids[first:end], num_external_tokens, corrupt))

    # ---------------------------------------------------------------- both
    def build_meta(self, out: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=self.loads, idle=out.total_num_scheduled_tokens == 0)
        self.loads = []
        if not self.is_producer:
            return meta
        starts = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, start in starts.items():
            prompt = self.prompts.get(req_id)
            end = start + out.num_scheduled_tokens.get(req_id, 0)
            if prompt is None or start >= len(prompt):
                continue
            block_ids = list(out.kv_connector_block_state.get_block_ids(req_id)[0][:_blocks(len(prompt), self.block_size)])
            if self.push:
                first = req_id not in self.pushing
                self.pushing.add(req_id)
                meta.pushes.append(PushStep(req_id, block_ids, min(end, len(prompt)), len(prompt),
                                            prompt if first else None))
            if len(prompt) <= end:  # the step that completes this prompt
                meta.saves.append(SaveRequest(req_id, prompt, block_ids))
                del self.prompts[req_id]
                self.pushing.discard(req_id)
        return meta

    def forget(self, req_id: str) -> None:
        self.prompts.pop(req_id, None)
        self.pushing.discard(req_id)
        self.local_hits.pop(req_id, None)
        self.claimed.discard(req_id)
