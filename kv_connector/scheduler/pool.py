"""The KV pool's scheduler side, for any role with a pool: which ended requests' blocks go into the pool. A request
that ends with whole blocks of computed KV (its prompt, and with ``pool_save_output`` its answer: a conversation's
next turn then finds its whole history) has them stored by the workers, off the forward path; vLLM holds the blocks
(``request_finished`` answers True) until every worker has copied them out and reported the request in
``finished_sending``. Blocks a lookup found in the pool already are not stored again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kv_connector.metadata import PoolSave

if TYPE_CHECKING:
    from vllm.v1.request import Request

NULL_BLOCK = 0  # vLLM's null block (padding where a sliding window dropped blocks): never stored


class PoolSaves:
    def __init__(self, block_size: int, save_output: bool = True) -> None:
        self.block_size = block_size
        self.save_output = save_output
        self.in_pool: dict[str, int] = {}  # request -> prompt tokens its lookup found in the pool
        self.to_save: list[PoolSave] = []

    def found(self, req_id: str, tokens: int) -> None:
        """The pool holds ``tokens`` of the request's prompt (whole blocks from its start)."""
        self.in_pool[req_id] = tokens

    def finished(self, request: Request, block_ids: list[int]) -> bool:
        """The request ended: whether its blocks are held for a pool save (queued for the next step's metadata)."""
        known = self.in_pool.pop(request.request_id, 0)
        tokens = list(request.all_token_ids if self.save_output else request.prompt_token_ids or ())
        blocks = min(request.num_computed_tokens, len(tokens), len(block_ids) * self.block_size) // self.block_size
        ids = list(block_ids[:blocks])
        if NULL_BLOCK in ids:  # blocks a sliding window let go: only those before them hold this prompt's KV
            ids = ids[:ids.index(NULL_BLOCK)]
        first = known // self.block_size
        if len(ids) <= first:
            return False
        self.to_save.append(PoolSave(request.request_id, tokens[:len(ids) * self.block_size], ids, first))
        return True

    def take(self) -> list[PoolSave]:
        out, self.to_save = self.to_save, []
        return out
