"""XpYd on real vLLM through proxy_server.py: any producer to any consumer, by vLLM's disaggregation protocol.

Two producers (core 0) and two consumers (core 1); each instance's mooncake.json names only its own pipe address
(consumer 0's also names producer 0 as its default, for requests without params). Two fleets, one after the other
(the pull fleet's producer 0 and consumer 0 are the session's ``pd_pair``, the push fleet is its own):

- pull, P2PHANDSHAKE: the proxy picks a prefill and a decode instance independently; the decode request carries the
  params the producer answered with, so the consumer loads from the producer that prefilled it. Proof, from every
  instance's connector stats: every load served (no miss, no partial load, no failure: nothing recomputed; a producer
  that did not prefill a request lacks its question), bytes fetched by the consumers = bytes served by the producers.
- push, etcd metadata: the proxy picks the decode instance first, reads its push address from its /metrics and puts
  it on the prefill; every load is served from what the producer pushed (nothing fetched, nothing recomputed).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.processes import http_ok, kill, spawn, stop, wait_ready
from harness.vllm import REPO, OpenAIClient, VllmServer, connector_config, mooncake_json, start_vllm
from proxy.protocols import push_address
from tests import servers
from tests.kv_connector.conftest import SERVE_ARGS, diff, kv_stats, settled_stats
from tests.kv_connector.test_mooncake_connector import MAX_TOKENS, prompt

SYSTEM = prompt(7000, 384)  # a system prompt every request shares (three blocks)
PULL, PUSH = "pull", "push"
COOLDOWN = 1.0  # seconds the proxy skips an instance that failed (its default, 5, only makes the test wait)


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[VllmServer], list[VllmServer]]]:
    """Two producers and two consumers in transfer mode ``request.param`` (pull: P2PHANDSHAKE, producer 0 and
    consumer 0 the session's ``pd_pair``; push: etcd, all four started here)."""
    mode = request.param
    work = tmp_path_factory.mktemp(f"xpyd-{mode}")
    with contextlib.ExitStack() as stack:
        metadata = {}
        producers, consumers = [], []
        if mode == PUSH:
            try:
                etcd = stack.enter_context(servers.etcd_server(work))
            except servers.ServerUnavailable as e:
                pytest.fail(str(e))
            metadata = {"metadata_server": f"etcd://{etcd}", "metadata_backend": "etcd"}
        else:  # consumer 0's mooncake.json names producer 0 (the pair's one file)
            producer, consumer = request.getfixturevalue("pd_pair")
            producers.append(producer)
            consumers.append(consumer)
        started = []
        for i in range(len(producers), 2):
            config = mooncake_json(work / f"producer{i}.json", **metadata)
            producers.append(VllmServer(f"xpyd-{mode}-producer{i}", tiny_model, free_port(), 0, work,
                                        connector_config("kv_producer", transfer_mode=mode), config, SERVE_ARGS))
            started.append(producers[-1])
        first_producer = json.loads(Path(producers[0].env["MOONCAKE_CONFIG_PATH"]).read_text())["prefill_url"]
        for i in range(len(consumers), 2):
            extra = {"prefill_url": first_producer} if i == 0 else {}
            config = mooncake_json(work / f"consumer{i}.json", **extra, **metadata)
            consumers.append(VllmServer(f"xpyd-{mode}-consumer{i}", tiny_model, free_port(), 1, work,
                                        connector_config("kv_consumer", transfer_mode=mode), config, SERVE_ARGS))
            started.append(consumers[-1])
        try:
            start_vllm(*started)
            yield producers, consumers
        finally:
            for server in started:
                server.stop()


@pytest.fixture(scope="module")
def proxy_for(tmp_path_factory: pytest.TempPathFactory):
    """Starts proxy_server.py in front of the given instances; all stopped at the end of the module."""
    procs = []

    def start(producers: list[VllmServer], consumers: list[VllmServer], *options: str) -> OpenAIClient:
        port = free_port()
        cmd = [sys.executable, str(REPO / "proxy_server.py"), "--host", "127.0.0.1", "--port", str(port), *options]
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
                seeds: range, mode: str = PULL) -> None:
    """Eight requests at once (a shared system prompt, each its own question) through ``proxy``: equal text, and each
    load served in full by the producer that prefilled the request (pull: fetched from it; push: pushed by it)."""
    prompts = [SYSTEM + prompt(seed, 150 + 40 * (seed % 5)) for seed in seeds]
    for producer in producers:  # an idle producer reports what it served before with its next engine step
        producer.complete([1, 2, 3], 1)
    before = [kv_stats(s) for s in producers + consumers]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda t: proxy.complete(t, MAX_TOKENS), prompts))
    assert answers == [reference.complete(t, MAX_TOKENS) for t in prompts]
    # every request was claimed by some consumer: wait until their loads ended (stats reach /metrics a step later)
    deadline = time.monotonic() + 15
    pokes = 0
    while True:
        changes = [diff(kv_stats(s), b) for s, b in zip(producers + consumers, before, strict=True)]
        produced, consumed = changes[:len(producers)], changes[len(producers):]
        loads = sum(c.get("loaded", 0) + c.get("load_misses", 0) + c.get("load_failures", 0) for c in consumed)
        served = sum(c.get("served_bytes", 0) for c in produced)
        fetched = sum(c.get("fetched_bytes", 0) for c in consumed)
        pushed = sum(c.get("pushed", 0) for c in produced)
        settled = served == fetched if mode == PULL else pushed >= len(prompts)
        if loads >= len(prompts) and settled or time.monotonic() > deadline:
            break
        for producer in producers:  # an idle producer reports what it served with its next engine step
            producer.complete([1, 2, 3], 1)
        pokes += 1
        time.sleep(0.2)
    assert loads == len(prompts), f"{loads} loads for {len(prompts)} requests: {changes}"
    print("producers", produced, "consumers", consumed)
    assert all(c.get("loaded") for c in consumed), f"a consumer got no request: {consumed}"
    for c in consumed:
        assert not c.get("load_misses") and not c.get("load_failures") and not c.get("partial_loads"), consumed
    if mode == PUSH:
        # every load taken from a push, and each producer pushed exactly the requests it prefilled
        assert sum(c.get("push_loaded", 0) for c in consumed) == len(prompts), consumed
        assert pushed == len(prompts) and not fetched and not served, changes
        assert sum(c.get("pushed_bytes", 0) for c in produced) >= sum(c.get("loaded_bytes", 0) for c in consumed) > 0
        return
    assert [c.get("saved", 0) for c in produced] != [0] * len(producers)
    assert sum(c.get("saved", 0) for c in produced) == len(prompts) + pokes * len(producers)
    # A producer that did not prefill a request lacks its question: a load from it would miss or be partial.
    for c in produced:
        assert c.get("served_bytes", 0) > 0 or c.get("saved", 0) == pokes
    assert fetched == served


@pytest.mark.parametrize("fleet", [PULL], indirect=True)
@pytest.mark.parametrize(("shape", "p", "d"), [("2P2D", 2, 2), ("1P2D", 1, 2), ("2P1D", 2, 1)])
def test_any_producer_to_any_consumer(fleet, proxy_for, reference, shape, p, d):
    producers, consumers = fleet
    proxy = proxy_for(producers[:p], consumers[:d])
    base = {"2P2D": 7100, "1P2D": 7200, "2P1D": 7300}[shape]
    run_through(proxy, producers[:p], consumers[:d], reference, range(base, base + 8))


@pytest.mark.parametrize("fleet", [PULL], indirect=True)
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


def open_push_links(producers: list[VllmServer], consumers: list[VllmServer]) -> None:
    """A producer links to a consumer it pushes to on the first request for it, and serves that request by pull
    (the link is made in the background): open every producer-to-consumer link before measuring."""
    for consumer in consumers:
        with urllib.request.urlopen(f"{consumer.url}/metrics", timeout=10) as resp:
            pipes = push_address(resp.read().decode())
        assert pipes, f"{consumer.name} does not advertise a push address on /metrics"
        for producer in producers:
            params = {"do_remote_decode": True, "mooncake_push_to": pipes}
            deadline = time.monotonic() + 20
            while True:
                before = kv_stats(producer).get("pushed", 0)
                producer.complete([5, 6, 7], 1, kv_transfer_params=params)
                producer.complete([1, 2, 3], 1)  # its stats reach /metrics with the next step
                if kv_stats(producer).get("pushed", 0) > before:
                    break
                assert time.monotonic() < deadline, f"{producer.name} never pushed to {consumer.name}"
                time.sleep(0.2)


@pytest.mark.parametrize("fleet", [PUSH], indirect=True)
def test_push_any_producer_to_any_consumer(fleet, proxy_for, reference):
    """2P2D in push mode, etcd metadata: the proxy learns each consumer's push address from its /metrics."""
    producers, consumers = fleet
    proxy = proxy_for(producers, consumers)
    open_push_links(producers, consumers)
    run_through(proxy, producers, consumers, reference, range(7500, 7508), mode=PUSH)


@pytest.mark.parametrize("fleet", [PULL], indirect=True)
def test_a_producer_killed_and_restarted(fleet, proxy_for, reference):
    """2P2D: producer 1 is killed: the proxy sends every prefill to producer 0 and every load is still served. Once
    producer 1 is back (same address), the consumers link to it again: its requests load from it, nothing lost."""
    producers, consumers = fleet
    proxy = proxy_for(producers, consumers, "--cooldown", str(COOLDOWN))
    kill(producers[1].proc)
    prompts = [SYSTEM + prompt(seed, 200) for seed in range(7600, 7604)]
    before = [kv_stats(c) for c in consumers]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda t: proxy.complete(t, MAX_TOKENS), prompts))
    assert answers == [reference.complete(t, MAX_TOKENS) for t in prompts]
    deadline = time.monotonic() + 15
    while True:  # stats reach /metrics with the step after the load
        changes = [diff(kv_stats(c), b) for c, b in zip(consumers, before, strict=True)]
        ended = sum(c.get(k, 0) for c in changes for k in ("loaded", "load_misses", "load_failures"))
        if ended >= len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert sum(c.get("loaded", 0) for c in changes) == len(prompts) and not any(
        c.get("load_failures") or c.get("load_misses") for c in changes), changes
    producers[1].restart()
    time.sleep(COOLDOWN + 0.5)  # the proxy's cooldown of the instance that failed
    run_through(proxy, producers, consumers, reference, range(7700, 7708))
