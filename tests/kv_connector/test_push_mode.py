"""Push mode between two real vLLM instances: the producer streams each layer's KV during the prefill, the consumer
finds it staged. Same guarantees as pull: equal text, external hits = prompt tokens - 1, corruption changes the text."""

from __future__ import annotations

import concurrent.futures
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.vllm import VllmServer, start_vllm
from kv_connector.metadata import CORRUPT_PARAM
from tests.kv_connector.conftest import start_early, start_pair
from tests.kv_connector.test_mooncake_connector import HITS, MAX_TOKENS, PROMPT_LENGTHS, disaggregated, prompt

PUSHED = re.compile(r"MooncakeConnector: loaded request \S+ \(pushed\)")


@pytest.fixture(scope="module")
def small_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """A push pair whose consumer has room for one 1000-token entry: spawned only (its test waits for it)."""
    pair = start_pair(tiny_model, tmp_path_factory.mktemp("small"), "small", {"push_staging_size": 6 << 20},
                      mode="push", wait=False)
    yield pair
    for server in pair:
        server.stop()


@pytest.fixture(scope="module", autouse=True)
def small_pair_early(request: pytest.FixtureRequest) -> None:
    """The small pair starts while the first tests run on the session's push pair."""
    start_early(request, "small_pair")


def test_consumer_decodes_from_pushed_kv(push_pair, reference):
    producer, consumer = push_pair
    matches, hits = [], []
    loaded_before = len(PUSHED.findall(consumer.log_text()))
    for i, length in enumerate(PROMPT_LENGTHS):  # up to 1000 tokens: chunked prefill (512-token batch budget)
        tokens = prompt(1000 + i, length)
        before = consumer.metric(HITS)
        got = disaggregated(producer, consumer, tokens)
        hits.append(consumer.metric(HITS) - before)
        matches.append(got == reference.complete(tokens, MAX_TOKENS))
    print(f"push: matches {sum(matches)}/{len(matches)}, external hits {hits}")
    assert all(matches)
    assert hits == [n - 1 for n in PROMPT_LENGTHS]
    assert len(PUSHED.findall(consumer.log_text())) - loaded_before == len(PROMPT_LENGTHS), "not every load was pushed"
    assert "push mode): " in producer.log_text()


def test_several_requests_prefilling_in_one_step(push_pair, reference):
    """Four prompts sent at once: the producer prefills them in shared steps and pushes each one's blocks."""
    producer, consumer = push_pair
    prompts = [prompt(1100 + i, 300 + 90 * i) for i in range(4)]
    before = consumer.metric(HITS)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda t: producer.complete(t, 1), prompts))  # concurrent prefills
    answers = [consumer.complete(tokens, MAX_TOKENS) for tokens in prompts]
    assert consumer.metric(HITS) - before == sum(len(t) - 1 for t in prompts)
    assert answers == [reference.complete(tokens, MAX_TOKENS) for tokens in prompts]


def test_corrupted_pushed_kv_changes_the_output(push_pair, reference):
    producer, consumer = push_pair
    for seed in (1200, 1201):
        tokens = prompt(seed, 400)
        corrupted = disaggregated(producer, consumer, tokens, kv_transfer_params={CORRUPT_PARAM: True})
        assert corrupted != reference.complete(tokens, MAX_TOKENS)
    assert consumer.log_text().count("corrupted the KV of request") == 2


def test_a_full_staging_area_falls_back_to_pull(small_pair, reference):
    """A consumer with room for one 1000-token entry: the second prompt prefilled before any decode goes by pull."""
    producer, consumer = small_pair
    start_vllm(producer, consumer)
    first, second = prompt(1300, 1000), prompt(1301, 1000)  # 4 MiB of KV each in float32
    producer.complete(first, 1)
    producer.complete(second, 1)
    before = consumer.metric(HITS)
    answers = [consumer.complete(tokens, MAX_TOKENS) for tokens in (first, second)]
    assert consumer.metric(HITS) - before == 2 * 999
    assert answers == [reference.complete(tokens, MAX_TOKENS) for tokens in (first, second)]
    log = consumer.log_text()
    assert len(PUSHED.findall(log)) == 1 and len(re.findall(r"loaded request \S+ \(pulled\): 999 tokens", log)) == 1
    assert "the consumer has no push room for request" in producer.log_text()
