"""Push mode between two real vLLM instances: the producer streams each layer's KV during the prefill, the consumer
finds it staged. Same guarantees as pull: equal text, external hits = prompt tokens - 1, corruption changes the text."""

from __future__ import annotations

import concurrent.futures
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.tamper import CORRUPT_PARAM
from harness.vllm import VllmServer, connector_config, mooncake_json, start_vllm
from kv_connector.param_keys import PUSH_PROOF
from kv_proxy.discovery import push_target
from tests.kv_connector.instance_stats import log_mark
from tests.kv_connector.instances import SERVE_ARGS, open_push_links, start_early
from tests.kv_connector.prompts import HITS, MAX_TOKENS, PROMPT_LENGTHS, disaggregated, prompt

pytestmark = pytest.mark.vllm

PUSHED = re.compile(r"MooncakeConnector: loaded request \S+ \(pushed\)")


@pytest.fixture(scope="module")
def small_consumer(tiny_model: Path, push_pair: tuple[VllmServer, VllmServer],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A push-mode consumer with room for one 1000-token entry, beside the session's push consumer: the session's
    push producer pushes to it when a request's params name it, and it pulls from that producer (its mooncake.json is
    the push pair's, with a pipe address of its own). Spawned only (its test waits for it)."""
    _, paired = push_pair
    work = tmp_path_factory.mktemp("small")
    shared = json.loads(Path(paired.env["MOONCAKE_CONFIG_PATH"]).read_text())
    config = mooncake_json(work / "mooncake.json", **{**shared, "decode_url": f"127.0.0.1:{free_port()}"})
    consumer = VllmServer("small-consumer", tiny_model, free_port(), 1, work,
                          connector_config("kv_consumer", transfer_mode="push", push_staging_size=6 << 20,
                                           kv_digest="always"), config, SERVE_ARGS, worker_process=False)
    yield consumer
    consumer.stop()


@pytest.fixture(scope="module", autouse=True)
def small_consumer_early(request: pytest.FixtureRequest) -> None:
    """The small consumer starts while the first tests run on the session's push pair."""
    start_early(request, "small_consumer")


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


def test_a_full_staging_area_falls_back_to_pull(push_pair, small_consumer, reference):
    """A consumer with room for one 1000-token entry: the second prompt prefilled before any decode goes by pull."""
    producer, _ = push_pair
    consumer = small_consumer
    start_vllm(consumer)
    open_push_links([producer], [consumer])  # a few 3-token entries: the 6 MiB still hold one 4 MiB entry, not two
    with urllib.request.urlopen(f"{consumer.url}/metrics", timeout=10) as resp:
        target = push_target(resp.read().decode())
    assert target is not None
    params = {"do_remote_decode": True, "mooncake_push_to": target[0], PUSH_PROOF: target[1]}
    mark = log_mark(producer)
    first, second = prompt(1300, 1000), prompt(1301, 1000)  # 4 MiB of KV each in float32
    producer.complete(first, 1, kv_transfer_params=params)
    producer.complete(second, 1, kv_transfer_params=params)
    before = consumer.metric(HITS)
    answers = [consumer.complete(tokens, MAX_TOKENS) for tokens in (first, second)]
    assert consumer.metric(HITS) - before == 2 * 999
    assert answers == [reference.complete(tokens, MAX_TOKENS) for tokens in (first, second)]
    log = consumer.log_text()
    assert len(PUSHED.findall(log)) == 1 and len(re.findall(r"loaded request \S+ \(pulled\): 999 tokens", log)) == 1
    with producer.log.open("rb") as said:
        said.seek(mark)
        assert b"the consumer has no push room for request" in said.read()
