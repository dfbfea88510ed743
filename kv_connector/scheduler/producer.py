"""The producer's scheduler side (vLLM's EngineCore process of the prefill instance): decides what to save; knows
requests and block ids, never touches KV.

Every prompt is saved in the step that completes its prefill (a consumer may come for it without being told where
it waits); in push mode each step of a prefill is also announced to the worker (``PushStep``), which streams the
blocks that step completes. A request that asked for remote decode finishes with params saying where its KV waits
(``params.producer_params``). Only a request whose params say ``"do_remote_decode": false`` is neither saved nor
pushed: it is served here whole (a proxy that skipped its disaggregation, see ``params.py``).

``hold``: a finished request whose blocks a save or a push copied from is held (vLLM keeps its blocks) until every
worker reported it in ``finished_sending`` - on a GPU those copies run after the step that queued them, while the
next step may already reuse the blocks (``staging``). The workers learn of it in the next step's ``held``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from kv_connector import params as kv_params
from kv_connector import prompt_blocks as blocks
from kv_connector.metadata import MooncakeConnectorMetadata, PushStep, SaveRequest
from kv_connector.param_keys import DO_REMOTE_DECODE
from kv_connector.scheduler.steps import scheduled_starts

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kv_connector.config import ConnectorConfig

logger = init_logger(f"vllm.{__name__}")


class ProducerScheduler:
    def __init__(self, config: ConnectorConfig, block_size: int, hold: bool = False) -> None:
        self.config = config
        self.hold = hold
        self.held: list[str] = []  # finished and held since the last step
        self.block_size = block_size
        self.push = config.push_mode
        self.pipes = config.pipes  # where consumers find this instance's KV (one pipe per TP rank)
        self.prompts: dict[str, list[int]] = {}  # prompts still prefilling
        self.saved: set[str] = set()  # requests whose prompt was saved (until they finish)
        self.push_to: dict[str, list[str] | None] = {}  # push mode: the consumer each request goes to
        self.pushing: set[str] = set()  # push mode: prompts whose first step was announced to the worker
        self.abandoned: list[str] = []  # push mode: of those, ended before their prompt was complete

    def num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # a producer loads nothing

    def after_alloc(self, request: Request, kv_blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get(DO_REMOTE_DECODE) is False:
            return  # served here whole: no consumer will come for its KV
        self.prompts[request.request_id] = list(request.prompt_token_ids or ())
        if self.push:
            self.push_to[request.request_id] = self._push_target(request)

    def _push_target(self, request: Request) -> list[str] | None:
        """The consumer the request's params name (None: mooncake.json's; []: not pushed, saved for pull)."""
        try:
            return kv_params.push_targets(request.kv_transfer_params, len(self.pipes), self.config.secret)
        except kv_params.ParamsError as e:
            logger.error("MooncakeConnector: request %s: unusable kv_transfer_params (%s): its KV is kept for pull "
                         "instead of pushed", request.request_id, e)
            return []

    def build_meta(self, out: SchedulerOutput) -> MooncakeConnectorMetadata:
        meta = MooncakeConnectorMetadata(idle=out.total_num_scheduled_tokens == 0, abandoned=self.abandoned,
                                         held=self.held, preempted=sorted(out.preempted_req_ids or ()))
        self.abandoned, self.held = [], []
        for req_id, start in scheduled_starts(out).items():
            prompt = self.prompts.get(req_id)
            if prompt is None or start >= len(prompt):
                continue
            end = start + out.num_scheduled_tokens.get(req_id, 0)
            block_ids = list(out.kv_connector_block_state.get_block_ids(req_id)[0]
                             [:blocks.num_blocks(len(prompt), self.block_size)])
            if self.push:
                meta.pushes.append(self._push_step(req_id, prompt, block_ids, end))
            if len(prompt) <= end:  # the step that completes this prompt
                meta.saves.append(SaveRequest(req_id, prompt, block_ids))
                self.saved.add(req_id)
                del self.prompts[req_id]
                self.pushing.discard(req_id)
        return meta

    def _push_step(self, req_id: str, prompt: list[int], block_ids: list[int], end: int) -> PushStep:
        """The request's first step carries its prompt and target: the worker announces the push then."""
        first = req_id not in self.pushing
        self.pushing.add(req_id)
        return PushStep(req_id, block_ids, min(end, len(prompt)), len(prompt), prompt if first else None,
                        self.push_to.get(req_id) if first else None)

    def finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """A request ended: forget it; whether its blocks are held (``hold``: a save or a push copied from them),
        and for one that asked for remote decode, params saying where its KV waits (its prompt was saved in the step
        that completed it)."""
        req_id = request.request_id
        saved = req_id in self.saved
        held = self.hold and (saved or req_id in self.pushing)
        if held:
            self.held.append(req_id)
        self.saved.discard(req_id)
        self.prompts.pop(req_id, None)
        if req_id in self.pushing:  # its push began, its prompt never completed: the worker ends the push
            self.pushing.discard(req_id)
            self.abandoned.append(req_id)
        pushed = self.push and self.push_to.pop(req_id, None) != []  # [] : kept for pull, nothing was sent
        params = request.kv_transfer_params
        if not saved or not isinstance(params, dict) or not params.get("do_remote_decode") or not self.pipes:
            return held, None
        return held, kv_params.producer_params(self.pipes, self.config.engine_id, req_id, self.config.secret, pushed)
