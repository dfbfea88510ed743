"""The consumer's scheduler side (vLLM's EngineCore process of the decode instance): decides what to load; knows
requests and block ids, never touches KV.

A request claims its prompt, except the blocks this instance already holds in its own prefix cache and its last
``recompute`` tokens (vLLM computes at least the last one itself), as one asynchronous load into exactly the blocks
it lacks, from the producer ``source.load_source`` picks (none: a request whose params say
``do_remote_prefill: false`` claims nothing). A request gets one load attempt: a failed one is recomputed, not
retried.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from kv_connector import blocks
from kv_connector import params as kv_params
from kv_connector.metadata import CORRUPT_PARAM, TEST_FAULTS, LoadRequest, MooncakeConnectorMetadata
from kv_connector.source import LoadSource, load_source

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kv_connector.config import ConnectorConfig

logger = init_logger(f"vllm.{__name__}")


class ConsumerScheduler:
    """``recompute``: how many of a prompt's last tokens this instance computes itself (at least the last one).
    Under vLLM's ``kv_load_failure_policy`` ``fail`` (``config.fail_loads``: a failed load ends its request with an
    error) only a request whose params name its producer (or await its push) loads; one without params, which would
    load from mooncake.json's producer whether or not that holds its prompt, is computed here instead."""

    def __init__(self, config: ConnectorConfig, block_size: int, recompute: int = 1) -> None:
        self.config = config
        self.block_size = block_size
        self.recompute = max(recompute, 1)
        self.claims: dict[str, tuple[LoadSource, int]] = {}  # claimed, not allocated yet: (source, local hit tokens)
        self.claimed: set[str] = set()  # one load attempt per request
        self.loads: list[LoadRequest] = []  # loads to start in the next step

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """``num_computed_tokens``: this instance's own prefix-cache hit, block aligned (vLLM passes it so)."""
        claim = blocks.claim_tokens(len(request.prompt_token_ids or ()), num_computed_tokens, self.recompute)
        if claim <= 0 or request.request_id in self.claimed:
            return 0, False
        try:
            source = load_source(request.kv_transfer_params, self.config)
        except kv_params.ParamsError as e:
            logger.error("MooncakeConnector: request %s: unusable kv_transfer_params (%s): recomputing its prompt",
                         request.request_id, e)
            self.claimed.add(request.request_id)
            return 0, False
        if source is None or (self.config.fail_loads and not source.from_params and not source.await_push):
            # its params ask for no load, or a guess under the fail policy: computed here
            self.claimed.add(request.request_id)
            return 0, False
        self.claims[request.request_id] = (source, num_computed_tokens)
        return claim, True

    def after_alloc(self, request: Request, kv_blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        claim = self.claims.pop(request.request_id, None)
        if claim is None or num_external_tokens <= 0:
            return
        source, local = claim
        self.claimed.add(request.request_id)
        first, end = blocks.load_span(local, num_external_tokens, self.block_size)
        block_ids = list(kv_blocks.get_block_ids()[0])  # every block of the request, the cached ones first
        switch = request.kv_transfer_params.get(CORRUPT_PARAM) if request.kv_transfer_params else None
        self.loads.append(LoadRequest(request.request_id, list(request.prompt_token_ids or ()), first,
                                      block_ids[first:end], num_external_tokens, source, switch is True,
                                      switch if isinstance(switch, str) and switch in TEST_FAULTS else ""))

    def build_meta(self, out: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(loads=self.loads, idle=out.total_num_scheduled_tokens == 0)
        self.loads = []
        return meta

    def finished(self, request: Request) -> dict[str, Any] | None:
        """A request ended: forget it (a consumer answers no params)."""
        self.claims.pop(request.request_id, None)
        self.claimed.discard(request.request_id)
        return None
