"""The KV pool behind a disaggregated pair (1P1D, pull mode, a real ``mooncake_master``): both instances store what
they computed; a consumer's lookup asks the producer's hand-off and the pool and loads the longest prefix from where
it is held; a producer finds the prompts it prefills in the pool too. Bytes and the colocated text are asserted."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.store import MooncakeMaster
from harness.vllm import VllmServer
from tests.kv_connector.instance_stats import diff, kv_stats
from tests.kv_connector.instances import BLOCK, ROW_BYTES, blocks, start_pair
from tests.kv_connector.pool_traffic import settled, stored_blocks, turn
from tests.kv_connector.prompts import MAX_TOKENS, prefill, prompt

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def pool_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    work = tmp_path_factory.mktemp("pool-pd")
    with MooncakeMaster(work) as master:
        # vLLM's default kv_load_failure_policy (fail), as users run it
        producer, consumer = start_pair(tiny_model, work, "pool-pd", failure_policy=None,
                                        master_server_address=master.address, global_segment_size=32 << 20,
                                        local_buffer_size=16 << 20)
        try:
            yield producer, consumer
        finally:
            producer.stop()
            consumer.stop()


def test_the_seeds_flow_without_params_hands_off_beside_the_pool(pool_pair, reference):
    """The seed's proxy sends no kv_transfer_params: a max_tokens=1 prefill on the producer, then the request on the
    consumer. With a pool beside the hand-off, under vLLM's default policy, the consumer still loads the whole
    prompt (but its last token) from the producer, the longer of the two: the pool holds only its whole blocks."""
    producer, consumer = pool_pair
    tokens = prompt(9850, 3 * BLOCK + 40)
    before, before_p = kv_stats(consumer), kv_stats(producer)
    producer.complete(tokens, 1)
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    change = settled(consumer, before, "loaded", 1)
    assert change.get("loaded") == 1 and change.get("fetched_bytes") == blocks(len(tokens) - 1) * ROW_BYTES, change
    assert not change.get("load_failures") and not change.get("pool_loaded"), change
    assert settled(producer, before_p, "pool_saved_blocks", 3).get("pool_saved_blocks") == 3  # and it pooled them


def test_a_follow_up_turns_prefill_finds_the_previous_answer_in_the_pool(pool_pair, reference):
    """Turn 1 is disaggregated: the producer stores the prompt's whole blocks when its prefill ends, the consumer the
    blocks that hold its answer when the decode ends. Turn 2's prefill on the producer finds the prompt in its own
    prefix cache and the block holding the answer in the pool: it loads that block and computes the rest; the consumer
    has the history cached and loads the rest from the producer."""
    producer, consumer = pool_pair
    tokens = prompt(9800, 500)
    before, before_p = kv_stats(consumer), kv_stats(producer)
    body = {"model": consumer.model, "prompt": tokens, "max_tokens": 24, "temperature": 0.0, "return_token_ids": True,
            "kv_transfer_params": prefill(producer, tokens)}
    answer = consumer.post("/v1/completions", body)["choices"][0]["token_ids"]
    history = tokens + answer
    change = settled(consumer, before, "pool_saved_blocks", 1)
    assert change.get("loaded") == 1 and change.get("fetched_bytes") == blocks(len(tokens) - 1) * ROW_BYTES, \
        change  # the prompt's blocks, from the producer
    produced = settled(producer, before_p, "pool_saved_blocks", 1)
    assert produced.get("pool_saved_blocks") == len(tokens) // BLOCK, produced  # the prompt's whole blocks
    assert change.get("pool_saved_blocks") == stored_blocks(len(history)) - len(tokens) // BLOCK, change  # the rest
    second = history + prompt(9801, 100)
    before, before_p = kv_stats(consumer), kv_stats(producer)
    params = prefill(producer, second)
    produced = settled(producer, before_p, "pool_loaded", 1)
    answer_blocks = stored_blocks(len(history)) - len(tokens) // BLOCK
    assert produced.get("local_hits") == len(tokens) // BLOCK * BLOCK, produced
    assert produced.get("pool_loaded_bytes") == answer_blocks * ROW_BYTES, produced
    assert consumer.complete(second, MAX_TOKENS, kv_transfer_params=params) == reference.complete(second, MAX_TOKENS)
    change = settled(consumer, before, "loaded", 1)
    assert change.get("local_hits") == stored_blocks(len(history)) * BLOCK, change
    assert change.get("fetched_bytes") == (blocks(len(second) - 1) - stored_blocks(len(history))) * ROW_BYTES, change


def test_the_longer_of_the_hand_off_and_the_pool_is_loaded_from_where_it_is_held(pool_pair, reference):
    """The consumer computed a document (a request sent straight to it, found nowhere) and stored it in the pool. The
    producer prefills document + question: it loads the document from the pool and computes the rest. The consumer
    then holds the document in its own prefix cache and loads the rest from the producer, which holds more than the
    pool."""
    producer, consumer = pool_pair
    document = prompt(9810, 3 * BLOCK)
    before = kv_stats(consumer)
    turn(consumer, document + prompt(9811, 10), 1)
    assert settled(consumer, before, "pool_saved_blocks", 3).get("pool_saved_blocks") == 3
    question = document + prompt(9812, 150)
    before_p, before_c = kv_stats(producer), kv_stats(consumer)
    params = prefill(producer, question)
    produced = settled(producer, before_p, "pool_loaded", 1)
    assert produced.get("pool_loaded") == 1 and produced.get("pool_loaded_bytes") == 3 * ROW_BYTES, produced
    assert consumer.complete(question, MAX_TOKENS, kv_transfer_params=params) == \
        reference.complete(question, MAX_TOKENS)
    change = settled(consumer, before_c, "loaded", 1)
    assert change.get("local_hits") == 3 * BLOCK, change
    assert change.get("fetched_bytes") == (blocks(len(question) - 1) - 3) * ROW_BYTES, change
    assert not change.get("pool_loaded"), change


def test_through_the_proxy_a_follow_up_the_pool_holds_skips_its_remote_prefill(pool_pair, proxy_for, reference):
    """The proxy reads the pool off the instances' /metrics. A first turn goes the usual way (prefill, then decode);
    the next turn adds a short message to its history: the pool and the consumer hold all but a tail the consumer
    computes itself, so the proxy sends it straight there (``--pool-tail``), with ``mooncake_pool_only``: no prefill
    on the producer, the right text."""
    producer, consumer = pool_pair
    proxy = proxy_for([producer], [consumer])
    tokens = prompt(9830, 3 * BLOCK + 40)
    answer = proxy.post("/v1/completions", {"model": consumer.model, "prompt": tokens, "max_tokens": 24,
                                            "temperature": 0.0, "return_token_ids": True})["choices"][0]["token_ids"]
    time.sleep(1.0)  # the decode's pool save, and a moment for the proxy to have read both instances' /metrics
    follow = tokens + answer + prompt(9831, 20)
    before_p = kv_stats(producer)
    assert proxy.complete(follow, MAX_TOKENS) == reference.complete(follow, MAX_TOKENS)
    prefilled = diff(kv_stats(producer), before_p)
    assert not prefilled.get("saved"), prefilled  # no remote prefill
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    assert 'reason="pooled"' in text and "mooncake_proxy_prefill_skipped_total 1.0" in text
