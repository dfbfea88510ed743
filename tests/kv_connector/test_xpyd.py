"""XpYd on real vLLM through proxy_server.py: any producer to any consumer, by vLLM's disaggregation protocol.

Two producers (core 0) and two consumers (core 1); each instance's mooncake.json names only its own pipe address
(consumer 0's also names producer 0 as its default, for requests without params). The proxy picks a prefill and a
decode instance independently; the decode request carries the params the producer answered with, so the consumer
loads from the producer that prefilled it. Proof, from every instance's connector stats: every load served (no
miss, no partial load, no failure: nothing recomputed; a producer that did not prefill a request lacks its question),
bytes fetched by the consumers = bytes served by the producers.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kv_connector.conftest import SERVE_ARGS, connector_config, diff, kv_stats, mooncake_json, settled_stats
from tests.kv_connector.test_mooncake_connector import MAX_TOKENS, prompt
from tests.servers import REPO, OpenAIClient, VllmServer, free_port, http_ok, spawn, start_vllm, stop, wait_ready

SYSTEM = prompt(7000, 384)  # a system prompt every request shares (three blocks)


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[VllmServer], list[VllmServer]]]:
    work = tmp_path_factory.mktemp("xpyd")
    producers, consumers = [], []
    for i in range(2):
        config = mooncake_json(work / f"producer{i}.json")
        producers.append(VllmServer(f"xpyd-producer{i}", tiny_model, free_port(), 0, work, connector_config("kv_producer"),
                                    config, SERVE_ARGS))
    first_producer = json.loads((work / "producer0.json").read_text())["prefill_url"]
    for i in range(2):
        extra = {"prefill_url": first_producer} if i == 0 else {}
        config = mooncake_json(work / f"consumer{i}.json", **extra)
        consumers.append(VllmServer(f"xpyd-consumer{i}", tiny_model, free_port(), 1, work,
                                    connector_config("kv_consumer"), config, SERVE_ARGS))
    start_vllm(*producers, *consumers)
    yield producers, consumers
    for server in producers + consumers:
        server.stop()


@pytest.fixture(scope="module")
def proxy_for(tmp_path_factory: pytest.TempPathFactory):
    """Starts proxy_server.py in front of the given instances; all stopped at the end of the module."""
    procs = []

    def start(producers: list[VllmServer], consumers: list[VllmServer]) -> OpenAIClient:
        port = free_port()
        cmd = [sys.executable, str(REPO / "proxy_server.py"), "--host", "127.0.0.1", "--port", str(port)]
        for p in producers:
            cmd += ["--prefill", p.url]
        for c in consumers:
            cmd += ["--decode", c.url]
        log = tmp_path_factory.mktemp("proxy") / "proxy.log"
        proc = spawn(cmd, log)
        procs.append(proc)
        wait_ready(proc, cmd, log, http_ok(f"http://127.0.0.1:{port}/health"), "proxy", 60)
        return OpenAIClient(f"http://127.0.0.1:{port}", consumers[0].model)

    yield start
    for proc in procs:
        stop(proc)


def run_through(proxy: OpenAIClient, producers: list[VllmServer], consumers: list[VllmServer], reference: VllmServer,
                seeds: range) -> None:
    """Eight requests at once (a shared system prompt, each its own question) through ``proxy``: equal text, and each
    load served in full by the producer that prefilled the request."""
    prompts = [SYSTEM + prompt(seed, 150 + 40 * (seed % 5)) for seed in seeds]
    before = [kv_stats(s) for s in producers + consumers]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda t: proxy.complete(t, MAX_TOKENS), prompts))
    assert answers == [reference.complete(t, MAX_TOKENS) for t in prompts]
    # every request was claimed by some consumer: wait until their loads ended (stats reach /metrics a step later)
    deadline = time.monotonic() + 15
    pokes = 0
    while True:
        changes = [diff(kv_stats(s), b) for s, b in zip(producers + consumers, before, strict=True)]
        loads = sum(c.get("loaded", 0) + c.get("load_misses", 0) + c.get("load_failures", 0)
                    for c in changes[len(producers):])
        served = sum(c.get("served_bytes", 0) for c in changes[:len(producers)])
        fetched = sum(c.get("fetched_bytes", 0) for c in changes[len(producers):])
        if loads >= len(prompts) and served == fetched or time.monotonic() > deadline:
            break
        for producer in producers:  # an idle producer reports what it served with its next engine step
            producer.complete([1, 2, 3], 1)
        pokes += 1
        time.sleep(0.2)
    assert loads == len(prompts), f"{loads} loads for {len(prompts)} requests: {changes}"
    produced, consumed = changes[:len(producers)], changes[len(producers):]
    print("producers", produced, "consumers", consumed)
    assert [c.get("saved", 0) for c in produced] != [0] * len(producers)
    assert sum(c.get("saved", 0) for c in produced) == len(prompts) + pokes * len(producers)
    # A producer that did not prefill a request lacks its question: a load from it would miss or be partial.
    for c in consumed:
        assert not c.get("load_misses") and not c.get("load_failures") and not c.get("partial_loads"), consumed
    for c in produced:
        assert c.get("served_bytes", 0) > 0 or c.get("saved", 0) == pokes
    assert sum(c.get("fetched_bytes", 0) for c in consumed) == sum(c.get("served_bytes", 0) for c in produced)


@pytest.mark.parametrize(("shape", "p", "d"), [("2P2D", 2, 2), ("1P2D", 1, 2), ("2P1D", 2, 1)])
def test_any_producer_to_any_consumer(fleet, proxy_for, reference, shape, p, d):
    producers, consumers = fleet
    proxy = proxy_for(producers[:p], consumers[:d])
    base = {"2P2D": 7100, "1P2D": 7200, "2P1D": 7300}[shape]
    run_through(proxy, producers[:p], consumers[:d], reference, range(base, base + 8))


def test_without_params_the_configured_producer_is_used(fleet, reference):
    """The seed's usage: prefill and decode sent by hand (no params): consumer 0 loads from producer 0, named in
    its mooncake.json."""
    producers, consumers = fleet
    tokens = SYSTEM + prompt(7400, 300)
    before = kv_stats(consumers[0])
    producers[0].complete(tokens, 1)
    assert consumers[0].complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    change = settled_stats(consumers[0], before, 1)
    assert change.get("loaded") == 1 and change.get("fetched_bytes", 0) > 0, diff(kv_stats(consumers[0]), before)
