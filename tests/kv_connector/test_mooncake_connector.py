"""MooncakeConnector between two real vLLM instances: the consumer decodes from the producer's KV, with the same text
as the colocated reference instance."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.tamper import CORRUPT_PARAM
from harness.vllm import REPO, OpenAIClient, VllmServer, build_model, connector_config, mooncake_json, start_vllm
from tests.kv_connector.instance_stats import kv_stats, settled_stats
from tests.kv_connector.instances import SERVE_ARGS, start_early
from tests.kv_connector.prompts import HITS, MAX_TOKENS, PROMPT_LENGTHS, disaggregated, prompt

pytestmark = pytest.mark.vllm


def test_consumer_decodes_from_the_producers_kv(pd_pair, reference):
    producer, consumer = pd_pair
    matches, hits = [], []
    for i, length in enumerate(PROMPT_LENGTHS):
        tokens = prompt(i, length)
        before = consumer.metric(HITS)
        got = disaggregated(producer, consumer, tokens)
        hits.append(consumer.metric(HITS) - before)
        matches.append(got == reference.complete(tokens, MAX_TOKENS))
    print(f"matches {sum(matches)}/{len(matches)}, external hits {hits}")
    assert all(matches), f"outputs differ for prompt lengths {[n for n, m in zip(PROMPT_LENGTHS, matches, strict=True) if not m]}"
    assert hits == [n - 1 for n in PROMPT_LENGTHS]  # every prompt token but the last, which vLLM recomputes
    log = consumer.log_text()
    assert log.count("MooncakeConnector: loaded request") >= len(PROMPT_LENGTHS), "loads failed and were recomputed"
    assert "the producer's KV layout matches" in log
    assert producer.log_text().count("MooncakeConnector: saved request") >= len(PROMPT_LENGTHS)


def test_corrupted_kv_changes_the_output(pd_pair, reference):
    # Fresh prompts: the consumer's prefix cache keeps what it loaded, so a prompt is never asked twice.
    producer, consumer = pd_pair
    for seed in (100, 101):
        tokens = prompt(seed, 400)
        corrupted = disaggregated(producer, consumer, tokens, kv_transfer_params={CORRUPT_PARAM: True})
        assert corrupted != reference.complete(tokens, MAX_TOKENS), (
            "scrambling the transferred KV did not change the answer: is the KV used at all?")
    assert consumer.log_text().count("corrupting the KV of request") == 2


def test_through_the_proxy(pd_pair, reference, tmp_path: Path):
    """The whole stack as a user runs it: proxy_server.py, with its defaults, in front of the producer and the
    consumer. Prompts of 700, 260 and 100 tokens are prefilled on the producer and loaded (the default never skips).
    With --routing estimate the first streamed requests are prefilled remotely while the proxy learns what a prefill
    and a load cost; every answer, streamed or not, equals the reference. With --skip-prefill-below 256 a prompt of
    100 tokens is computed by the consumer, loading nothing, and answers the same."""
    producer, consumer = pd_pair

    def through(options: list[str], prompts: list[tuple[int, int, bool]]) -> tuple[str, str]:
        """Each (seed, length, stream) prompt through a fresh proxy with ``options``; its log and /metrics."""
        port = free_port()
        cmd = [sys.executable, str(REPO / "proxy_server.py"), "--prefill", producer.url, "--decode", consumer.url,
               "--host", "127.0.0.1", "--port", str(port), *options]
        log = tmp_path / f"proxy-{port}.log"
        proc = spawn(cmd, log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(proc, cmd, log, http_ok(url + "/health"), "proxy", 60)
            proxy = OpenAIClient(url, consumer.model)
            for seed, length, streamed in prompts:
                tokens = prompt(seed, length)
                before = consumer.metric(HITS)
                expected = reference.complete(tokens, MAX_TOKENS)
                answer = stream(url, consumer.model, tokens) if streamed else proxy.complete(tokens, MAX_TOKENS)
                assert answer == expected, (seed, length, streamed)
                loaded = consumer.metric(HITS) - before
                assert loaded in (0, length - 1), loaded  # whole or nothing: the prompt is new to both instances
                prompts_loaded.append(loaded > 0)
            with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                return log.read_text(), response.read().decode()
        finally:
            stop(proc)

    prompts_loaded: list[bool] = []
    _, metrics = through([], [(400, 700, False), (401, 260, False), (402, 100, False)])
    assert prompts_loaded == [True, True, True]
    assert 'mooncake_proxy_route_decisions_total{choice="remote",reason="never"} 3.0' in metrics
    prompts_loaded.clear()
    _, metrics = through(["--routing", "estimate"], [(403 + i, 300 + 100 * i, True) for i in range(4)]
                         + [(407, 500, False)])
    assert prompts_loaded[:3] == [True, True, True]
    assert 'mooncake_proxy_route_decisions_total{choice="remote",reason="not_learned"} 3.0' in metrics
    learned = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("mooncake_proxy_estimated_cost_seconds{")}
    # a fit of a few noisy times may come out flat (per token 0, all in the base): what it predicts must be positive
    assert learned['cost="prefill_per_token",instance="0",role="prefill"'] + \
        learned['cost="prefill_base",instance="0",role="prefill"'] > 0
    assert learned['cost="load_per_token",instance="0",role="decode"'] + \
        learned['cost="load_base",instance="0",role="decode"'] > 0
    prompts_loaded.clear()
    log, _ = through(["--skip-prefill-below", "256"], [(408, 100, False), (409, 300, False)])
    assert prompts_loaded == [False, True]
    assert "skipped the prefill" in log


def stream(url: str, model: str, tokens: list[int]) -> str:
    """A streamed completion through ``url``: the text of its SSE events."""
    body = json.dumps({"model": model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if line.startswith(b"data: ") and data != "[DONE]":
                text.extend(choice["text"] for choice in json.loads(data)["choices"])
    return "".join(text)


@pytest.fixture(scope="module")
def kv32k_consumer(pd_pair: tuple[VllmServer, VllmServer],
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A consumer serving another model (kv32k: 8 layers, 64 KiB of KV per token in float32) configured to load from
    the shared pair's producer: spawned only (its test waits for it)."""
    producer, _ = pd_pair
    work = tmp_path_factory.mktemp("kv32k")
    producer_pipe = json.loads(Path(producer.env["MOONCAKE_CONFIG_PATH"]).read_text())["prefill_url"]
    config = mooncake_json(work / "mooncake.json", prefill_url=producer_pipe)
    bigger_cache = [*SERVE_ARGS[:-4], "--kv-cache-memory-bytes", str(256 << 20), *SERVE_ARGS[-2:]]  # 64 KiB/token
    consumer = VllmServer("consumer-kv32k", build_model("kv32k", quiet=True), free_port(), 1, work,
                          connector_config("kv_consumer"), config, bigger_cache, worker_process=False)
    yield consumer
    consumer.stop()


@pytest.fixture(scope="module", autouse=True)
def kv32k_consumer_early(request: pytest.FixtureRequest) -> None:
    """The kv32k consumer starts while the first tests run on the session's pair."""
    start_early(request, "kv32k_consumer")


def test_layout_mismatch_is_refused_clearly(pd_pair, reference, kv32k_consumer):
    """The kv32k consumer loads from the shared pair's producer: it refuses the producer's layout, says why, and
    recomputes; the producer keeps serving its own consumer."""
    producer, own_consumer = pd_pair
    consumer = kv32k_consumer
    start_vllm(consumer)
    try:
        tokens = prompt(300, 300)
        start = time.monotonic()
        answer = disaggregated(producer, consumer, tokens)
        assert time.monotonic() - start < 60
        assert answer == consumer.complete(prompt(300, 300), MAX_TOKENS)  # its own model's answer, recomputed
        log = consumer.log_text()
        assert "differs from this instance's (model: producer LlamaForCausalLM:" in log
        assert "layers: producer 4 vs this instance 8" in log
    finally:
        consumer.stop()
    tokens = prompt(301, 300)
    before = kv_stats(own_consumer)
    assert disaggregated(producer, own_consumer, tokens) == reference.complete(tokens, MAX_TOKENS)
    assert settled_stats(own_consumer, before, 1).get("loaded") == 1
