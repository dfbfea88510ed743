"""The connector's scheduler side (vLLM's EngineCore process): decides what to save and what to load; knows requests
and block ids, never touches KV.

Producer: every prompt is saved in the step that completes its prefill (push mode also streams it step by step); a
request that asked for remote decode finishes with params saying where its KV waits (``params``).
Consumer: a request claims its prompt, except the blocks this instance already holds in its own prefix cache and
its last ``recompute`` tokens (vLLM computes at least the last one itself), as one asynchronous load into exactly
the blocks it lacks, from the producer its params name (else the configured one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from kv_connector import params as kv_params
from kv_connector.metadata import CORRUPT_PARAM, LoadRequest, MooncakeConnectorMetadata, PushStep, SaveRequest

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


logger = init_logger(f"vllm.{__name__}")


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class ConnectorScheduler:
    """``pipes``: this instance's pipe address per TP rank; ``engine_id``: vLLM's id of this instance;
    ``recompute``: consumer: how many of a prompt's last tokens it computes itself (at least the last one)."""

    def __init__(self, is_producer: bool, block_size: int, push: bool = False, pipes: list[str] | None = None,
                 engine_id: str = "", recompute: int = 1, secret: bytes = b"") -> None:
        self.is_producer = is_producer
        self.block_size = block_size
        self.push = push
        self.pipes = pipes or []
        self.tp_size = max(len(self.pipes), 1)
        self.engine_id = engine_id
        self.recompute = max(recompute, 1)
        self.secret = secret  # params are signed and checked with it (see kv_connector/params.py)
        self.push_to: dict[str, list[str] | None] = {}  # producer, push mode: the consumer each request goes to
        self.remote: dict[str, kv_params.RemotePrefill | None] = {}  # consumer: the producer each claim loads from
        self.prompts: dict[str, list[int]] = {}  # producer: prompts still prefilling
        self.saved: set[str] = set()  # producer: requests whose prompt was saved (until they finish)
        self.pushing: set[str] = set()  # producer, push mode: prompts whose first step was announced to the worker
        self.local_hits: dict[str, int] = {}  # consumer: locally cached tokens when the load was claimed
        self.claimed: set[str] = set()  # consumer: one load attempt per request (a failed one is recomputed, not retried)
        self.loads: list[LoadRequest] = []  # consumer: loads to start in the next step

    # ---------------------------------------------------------------- consumer
    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """``num_computed_tokens``: this instance's own prefix-cache hit, block aligned (vLLM passes it so)."""
        if self.is_producer:
            return 0, False
        claim = len(request.prompt_token_ids or ()) - self.recompute - num_computed_tokens
        if claim <= 0 or request.request_id in self.claimed:
            return 0, False
        try:
            self.remote[request.request_id] = kv_params.remote_prefill(request.kv_transfer_params, self.secret)
        except kv_params.ParamsError as e:
            logger.error("MooncakeConnector: request %s: unusable kv_transfer_params (%s): recomputing its prompt",
                         request.request_id, e)
            self.claimed.add(request.request_id)
            return 0, False
        self.local_hits[request.request_id] = num_computed_tokens
        return claim, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.is_producer:
            self.prompts[request.request_id] = list(request.prompt_token_ids or ())
            if self.push:
                try:
                    self.push_to[request.request_id] = kv_params.push_targets(request.kv_transfer_params, self.tp_size,
                                                                                   self.secret)
                except kv_params.ParamsError as e:
                    logger.error("MooncakeConnector: request %s: unusable kv_transfer_params (%s): its KV is kept for "
                                 "pull instead of pushed", request.request_id, e)
                    self.push_to[request.request_id] = []  # no push: the worker saves it for pull
            return
        remote = self.remote.pop(request.request_id, None)
        if num_external_tokens <= 0:
            return
        self.claimed.add(request.request_id)
        local = self.local_hits.pop(request.request_id, 0)
        first, end = local // self.block_size, _blocks(local + num_external_tokens, self.block_size)
        block_ids = list(blocks.get_block_ids()[0])  # every block of the request, the cached ones first
        corrupt = bool((request.kv_transfer_params or {}).get(CORRUPT_PARAM))
        self.loads.append(LoadRequest(request.request_id, list(request.prompt_token_ids or ()), first,
                                      block_ids[first:end], num_external_tokens,
                                      remote.pipes if remote is not None else None, corrupt))

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
                                            prompt if first else None, self.push_to.get(req_id) if first else None))
            if len(prompt) <= end:  # the step that completes this prompt
                meta.saves.append(SaveRequest(req_id, prompt, block_ids))
                self.saved.add(req_id)
                del self.prompts[req_id]
                self.pushing.discard(req_id)
        return meta

    def finished(self, request: Request) -> dict[str, Any] | None:
        """A request ended: forget it; a producer's request that asked for remote decode gets params saying where its
        KV waits (its prompt was saved in the step that completed it)."""
        req_id = request.request_id
        saved = req_id in self.saved
        self.saved.discard(req_id)
        self.prompts.pop(req_id, None)
        self.pushing.discard(req_id)
        self.push_to.pop(req_id, None)
        self.local_hits.pop(req_id, None)
        self.remote.pop(req_id, None)
        self.claimed.discard(req_id)
        params = request.kv_transfer_params or {}
        if not saved or not params.get("do_remote_decode") or not self.pipes:
            return None
        return kv_params.producer_params(self.pipes, self.engine_id, req_id, self.secret)
