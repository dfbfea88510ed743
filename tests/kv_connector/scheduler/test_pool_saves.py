"""The KV pool's scheduler side (``PoolSaves``) against vLLM's own request and scheduler-output objects: a prompt is
stored in the step that computes it, the rest of a request when it ends; nothing of a request whose load has not
ended, or whose KV is not its token ids' alone; a device cache holds a request whose prompt was copied out in its
step."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.v1.request import Request

from kv_connector.scheduler.pool import PoolSaves, poolable
from tests.kv_connector.units import request, step

BLOCK = 16


def ended(req: Request, computed: int, output: list[int]) -> Request:
    req.append_output_token_ids(output)
    req.num_computed_tokens = computed
    return req


def test_a_prompt_is_stored_in_the_step_that_computes_it_and_the_answer_when_it_ends():
    saves = PoolSaves(BLOCK)
    req = request("r", 50)
    saves.after_alloc(req)
    ids = list(range(1, 5))
    assert saves.build_meta(step(new={"r": (0, 40)}, block_ids={"r": ids})) == []  # not all of the prompt yet
    (prompt,) = saves.build_meta(step(cached={"r": (40, 10)}, block_ids={"r": ids}))
    assert prompt.in_step and prompt.block_ids == ids[:3] and prompt.first_block == 0
    assert prompt.token_ids == list(range(48))
    assert saves.finished(ended(req, 50 + 20 - 1, list(range(100, 120))), ids + [5])  # held for its answer
    (answer,) = saves.build_meta(step())
    assert not answer.in_step and answer.first_block == 3 and answer.block_ids == ids  # 69 tokens: 4 whole blocks


def test_blocks_the_lookup_found_in_the_pool_are_not_stored_again():
    saves = PoolSaves(BLOCK)
    req = request("r", 64)
    saves.after_alloc(req)
    saves.found("r", 32)
    (prompt,) = saves.build_meta(step(new={"r": (32, 32)}, block_ids={"r": [1, 2, 3, 4]}))
    assert prompt.first_block == 2


def test_nothing_is_stored_of_a_request_aborted_while_its_load_runs():
    """vLLM counts the tokens a load claimed as computed before they arrive: those blocks hold nothing yet."""
    saves = PoolSaves(BLOCK)
    req = request("r", 64)
    saves.after_alloc(req)
    req.num_computed_tokens = 63  # the claim
    assert not saves.finished(req, [1, 2, 3, 4], loading=True)
    assert saves.build_meta(step()) == []


def test_a_request_whose_kv_is_not_its_tokens_alone_is_never_pooled():
    salted = Request("s", list(range(64)), SamplingParams(max_tokens=4), None, cache_salt="tenant-a")
    assert not poolable(salted) and poolable(request("r", 64))
    saves = PoolSaves(BLOCK)
    saves.after_alloc(salted)
    assert saves.build_meta(step(new={"s": (0, 64)}, block_ids={"s": [1, 2, 3, 4]})) == []
    assert not saves.finished(ended(salted, 70, [1] * 7), [1, 2, 3, 4])


def test_a_device_cache_holds_a_request_whose_prompt_was_copied_out_in_its_step():
    """The copy of an in-step save runs after that step: a request that ends right then keeps its blocks until it
    ran (reported in held, as a producer's are), even with nothing more to store."""
    saves = PoolSaves(BLOCK, save_output=False, hold_copies=True)
    req = request("r", 32)
    saves.after_alloc(req)
    assert len(saves.build_meta(step(new={"r": (0, 32)}, block_ids={"r": [1, 2]}))) == 1
    assert saves.finished(ended(req, 32, [7]), [1, 2])
    assert saves.take_held() == ["r"] and saves.build_meta(step()) == []
    host = PoolSaves(BLOCK, save_output=False)  # a host cache's copy ran in its step
    other = request("o", 32)
    host.after_alloc(other)
    host.build_meta(step(new={"o": (0, 32)}, block_ids={"o": [1, 2]}))
    assert not host.finished(ended(other, 32, [7]), [1, 2]) and host.take_held() == []


def test_null_blocks_end_what_is_stored():
    saves = PoolSaves(BLOCK)
    req = request("r", 64)
    saves.after_alloc(req)
    (prompt,) = saves.build_meta(step(new={"r": (0, 64)}, block_ids={"r": [5, 6, 0, 0]}))
    assert prompt.block_ids == [5, 6]
