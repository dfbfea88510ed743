"""The KV pool's scheduler side, for any role with a pool: which blocks go into the pool, and when.

- **A prompt, as soon as it is computed**: in the step that completes a request's prompt, its whole blocks (but
  those its lookup found in the pool already, and those it loaded from a producer, which stores them) are copied out
  by the workers after that step's forward pass, while the request goes on decoding, and put in the background:
  another instance asking for the prompt a moment later (a shared document, the next question) finds it.
- **The rest, when the request ends** (``pool_save_output``): the whole blocks after the prompt's, which hold its
  answer, so that a conversation's next turn finds its whole history. vLLM holds those blocks (``request_finished``
  answers True) until every worker has copied them out and reported the request in ``finished_sending``. A request
  that ended before its prompt was computed stores the whole blocks it computed the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_connector.metadata import PoolSave
from kv_connector.scheduler.steps import scheduled_starts

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

NULL_BLOCK = 0  # vLLM's null block (padding where a sliding window dropped blocks): never stored


def poolable(request: Request) -> bool:
    """Whether a request's KV is the KV of its token ids alone, which is what a pool key names: not with a LoRA
    adapter, multimodal inputs, prompt embeddings or a ``cache_salt`` (vLLM keys its own prefix cache with those
    too; such requests neither look in the pool nor store there)."""
    return (getattr(request, "lora_request", None) is None and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None and not getattr(request, "cache_salt", None))


def _before_null(ids: list[int]) -> list[int]:
    """Blocks a sliding window let go are vLLM's null block: only those before it hold this prompt's KV."""
    return ids[:ids.index(NULL_BLOCK)] if NULL_BLOCK in ids else ids


class PoolSaves:
    """``hold_copies``: a device cache, whose copies out of it run after the step that queued them: a request whose
    prompt was copied out in its step is held when it ends until that copy ended (as a producer's saves are)."""

    def __init__(self, block_size: int, save_output: bool = True, hold_copies: bool = False) -> None:
        self.block_size = block_size
        self.save_output = save_output
        self.hold_copies = hold_copies
        self.held: list[str] = []  # requests held since the last step for copies of theirs, not for a save
        self.in_pool: dict[str, int] = {}  # request -> prompt tokens its lookup found in the pool
        self.prompts: dict[str, list[int]] = {}  # requests whose prompt is still being computed
        self.stored: dict[str, int] = {}  # request -> whole blocks of its prompt stored when it was computed
        self.to_save: list[PoolSave] = []

    def found(self, req_id: str, tokens: int) -> None:
        """The pool holds ``tokens`` of the request's prompt (whole blocks from its start), or will: the instance
        that computed them stores them (a producer's hand-off)."""
        self.in_pool[req_id] = max(tokens, self.in_pool.get(req_id, 0))

    def after_alloc(self, request: Request) -> None:
        if request.request_id not in self.stored and poolable(request):
            self.prompts.setdefault(request.request_id, list(request.prompt_token_ids or ()))

    def build_meta(self, out: SchedulerOutput) -> list[PoolSave]:
        """The saves of this step: the prompts it completes, and the requests that ended since the last step."""
        state = out.kv_connector_block_state
        for req_id, start in scheduled_starts(out).items():
            prompt = self.prompts.get(req_id)
            if prompt is None or start + out.num_scheduled_tokens.get(req_id, 0) < len(prompt):
                continue
            del self.prompts[req_id]
            blocks = len(prompt) // self.block_size
            found = state.get_block_ids(req_id) if state is not None else None
            ids = _before_null(list(found[0][:blocks])) if found else []
            first = self.in_pool.get(req_id, 0) // self.block_size
            self.stored[req_id] = len(ids)
            if len(ids) > first:
                self.to_save.append(PoolSave(req_id, prompt[:len(ids) * self.block_size], ids, first, in_step=True))
        saves, self.to_save = self.to_save, []
        return saves

    def take_held(self) -> list[str]:
        out, self.held = self.held, []
        return out

    def finished(self, request: Request, block_ids: list[int], loading: bool = False) -> bool:
        """The request ended: whether its blocks are held, for a pool save (queued for the next step's metadata) or
        for its prompt's copy out of a device cache. ``loading``: a load into its blocks has not ended (it was
        aborted while its KV came): its blocks hold nothing to store, and vLLM itself holds them for the load."""
        req_id = request.request_id
        known = self.in_pool.pop(req_id, 0) // self.block_size
        self.prompts.pop(req_id, None)
        stored = self.stored.pop(req_id, None)
        if loading or not poolable(request):
            return False
        save = self._output_save(request, block_ids, max(known, stored or 0), stored is not None)
        if save is not None:
            self.to_save.append(save)
            return True
        copying = stored is not None and self.hold_copies  # its prompt's copy out of the device cache
        if copying:
            self.held.append(req_id)
        return copying

    def _output_save(self, request: Request, block_ids: list[int], first: int, prompt_stored: bool) -> PoolSave | None:
        """The save of an ended request's whole blocks from ``first`` on (None: nothing left to store)."""
        if prompt_stored and not self.save_output:
            return None
        tokens = list(request.all_token_ids if self.save_output else request.prompt_token_ids or ())
        blocks = min(request.num_computed_tokens, len(tokens), len(block_ids) * self.block_size) // self.block_size
        ids = _before_null(list(block_ids[:blocks]))
        if len(ids) <= first:
            return None
        return PoolSave(request.request_id, tokens[:len(ids) * self.block_size], ids, first)
