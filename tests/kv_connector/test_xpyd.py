"""XpYd on real vLLM through proxy_server.py: any producer to any consumer, by vLLM's disaggregation protocol.

Two producers (core 0) and two consumers (core 1): producer 0 and consumer 0 are a session pair (one mooncake.json:
consumer 0 names producer 0 as its default, for requests without params), producer 1 and consumer 1 have one each
that names only their own pipe address. Two fleets, one after the other:

- pull, P2PHANDSHAKE: the proxy picks a prefill and a decode instance independently; the decode request carries the
  params the producer answered with, so the consumer loads from the producer that prefilled it. Proof, from every
  instance's connector stats: every load served (no miss, no partial load, no failure: nothing recomputed; a producer
  that did not prefill a request lacks its question), bytes fetched by the consumers = bytes served by the producers.
- push, etcd metadata and a secret: the proxy picks the decode instance first, reads its push address (and its
  proof) from its /metrics and puts them on the prefill; every load is served from what the producer pushed
  (nothing fetched, nothing recomputed). And a producer killed while a decode awaits its push (concurrent dispatch):
  the consumer computes the prompt itself after its push_wait.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.processes import kill, signal_group
from harness.vllm import OpenAIClient, VllmServer, connector_config, mooncake_json, start_vllm
from tests.kv_connector.instance_stats import diff, flush, kv_stats, settled_stats, wait_busy
from tests.kv_connector.instances import PUSH_PAIR_SECRET, SERVE_ARGS, etcd_metadata, open_push_links, selected_params
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

SYSTEM = prompt(7000, 384)  # a system prompt every request shares (three blocks)
PULL, PUSH = "pull", "push"
PUSH_WAIT = 5.0  # the consumers' push_wait (the default)
# run_through asserts that every consumer got a request: with the prefix index off the proxy spreads the eight by
# least outstanding, round robin on ties, however spread out they arrive (prefix affinity may keep them all on the
# consumer holding the system prompt when they reach the proxy a few at a time, as under the suite's load)
SPREAD = ("--prefix-index-entries", "0")
COOLDOWN = 1.0  # seconds the proxy skips an instance that failed (its default, 5, only makes the test wait)


def spawn_new(mode: str, request: pytest.FixtureRequest, tiny_model: Path,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[VllmServer, VllmServer]:
    """Producer 1 and consumer 1 of ``mode``, spawned (not waited for)."""
    work = tmp_path_factory.mktemp(f"xpyd-{mode}")
    metadata: dict[str, str] = {}
    if mode == PUSH:
        metadata = {**etcd_metadata(request.getfixturevalue("etcd")), "auth_secret": PUSH_PAIR_SECRET}
    new_producer = VllmServer(f"xpyd-{mode}-producer1", tiny_model, free_port(), 0, work,
                              connector_config("kv_producer", transfer_mode=mode),
                              mooncake_json(work / "producer1.json", **metadata), SERVE_ARGS, worker_process=False)
    new_consumer = VllmServer(f"xpyd-{mode}-consumer1", tiny_model, free_port(), 1, work,
                              connector_config("kv_consumer", transfer_mode=mode),
                              mooncake_json(work / "consumer1.json", **metadata), SERVE_ARGS, worker_process=False)
    return new_producer, new_consumer


@pytest.fixture(scope="module")
def spawned() -> Iterator[dict[str, tuple[VllmServer, VllmServer]]]:
    """Instances spawned ahead of their tests; whatever is left is stopped with the module."""
    pairs: dict[str, tuple[VllmServer, VllmServer]] = {}
    yield pairs
    for pair in pairs.values():
        for server in pair:
            server.stop()


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
          spawned: dict[str, tuple[VllmServer, VllmServer]]) -> Iterator[tuple[list[VllmServer], list[VllmServer]]]:
    """Two producers and two consumers in transfer mode ``request.param``: producer 0 and consumer 0 are the
    session's pair of that mode (``pd_pair``: P2PHANDSHAKE; ``push_pair``: etcd and a secret, which producer 1 and
    consumer 1 share), producer 1 and consumer 1 are started here - push mode's while pull mode's tests run, if
    both are selected (those tests leave a core idle most of the time)."""
    mode = request.param
    producer, consumer = request.getfixturevalue("pd_pair" if mode == PULL else "push_pair")
    if mode not in spawned:
        spawned[mode] = spawn_new(mode, request, tiny_model, tmp_path_factory)
    new_producer, new_consumer = spawned[mode]
    try:
        start_vllm(new_producer, new_consumer)
        # once this fleet is up: not slowing its start
        if mode == PULL and PUSH in selected_params(request, "fleet") and PUSH not in spawned:
            request.getfixturevalue("push_pair")  # up before its partners start (the consumers link to it)
            spawned[PUSH] = spawn_new(PUSH, request, tiny_model, tmp_path_factory)
        yield [producer, new_producer], [consumer, new_consumer]
    finally:
        del spawned[mode]
        new_producer.stop()
        new_consumer.stop()


def run_through(proxy: OpenAIClient, producers: list[VllmServer], consumers: list[VllmServer], reference: VllmServer,
                seeds: range, mode: str = PULL) -> None:
    """Eight requests at once (a shared system prompt, each its own question) through ``proxy``: equal text, and each
    load served in full by the producer that prefilled the request (pull: fetched from it; push: pushed by it)."""
    prompts = [SYSTEM + prompt(seed, 150 + 40 * (seed % 5)) for seed in seeds]
    for producer in producers:  # an idle producer reports what it served before with its next engine step
        flush(producer)
    before = [kv_stats(s) for s in producers + consumers]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda t: proxy.complete(t, MAX_TOKENS), prompts))
    assert answers == [reference.complete(t, MAX_TOKENS) for t in prompts]
    # every request was claimed by some consumer: wait until their loads ended (stats reach /metrics a step later)
    deadline = time.monotonic() + 15
    while True:
        changes = [diff(kv_stats(s), b) for s, b in zip(producers + consumers, before, strict=True)]
        produced, consumed = changes[:len(producers)], changes[len(producers):]
        loads = sum(c.get("loaded", 0) + c.get("load_misses", 0) + c.get("load_failures", 0) for c in consumed)
        served = sum(c.get("served_bytes", 0) for c in produced)
        fetched = sum(c.get("fetched_bytes", 0) for c in consumed)
        pushed = sum(c.get("pushed", 0) for c in produced)
        # push: a producer counts a prompt pushed when it queues the commit, its bytes as its sender thread sends
        # them, and reports both with its next engine step: its bytes may show up a poke later than its count
        loaded = sum(c.get("loaded_bytes", 0) for c in consumed)
        pushed_bytes = sum(c.get("pushed_bytes", 0) for c in produced)
        settled = served == fetched if mode == PULL else pushed >= len(prompts) and pushed_bytes >= loaded
        if loads >= len(prompts) and settled or time.monotonic() > deadline:
            break
        for producer in producers:  # an idle producer reports what it served with its next engine step
            flush(producer)
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
        assert pushed_bytes >= loaded > 0, changes
        return
    assert [c.get("saved", 0) for c in produced] != [0] * len(producers)
    assert sum(c.get("saved", 0) for c in produced) == len(prompts)  # the pokes keep nothing
    # A producer that did not prefill a request lacks its question: a load from it would miss or be partial.
    for c in produced:
        assert c.get("served_bytes", 0) > 0 or not c.get("saved", 0)
    assert fetched == served


@pytest.mark.parametrize("fleet", [PULL], indirect=True)
@pytest.mark.parametrize(("shape", "p", "d"), [("2P2D", 2, 2), ("1P2D", 1, 2), ("2P1D", 2, 1)])
def test_any_producer_to_any_consumer(fleet, proxy_for, reference, shape, p, d):
    producers, consumers = fleet
    proxy = proxy_for(producers[:p], consumers[:d], *SPREAD)
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


@pytest.mark.parametrize("fleet", [PUSH], indirect=True)
def test_push_any_producer_to_any_consumer(fleet, proxy_for, reference):
    """2P2D in push mode, etcd metadata: the proxy learns each consumer's push address from its /metrics."""
    producers, consumers = fleet
    proxy = proxy_for(producers, consumers, *SPREAD)
    open_push_links(producers, consumers)
    run_through(proxy, producers, consumers, reference, range(7500, 7508), mode=PUSH)


@pytest.mark.parametrize("fleet", [PULL], indirect=True)
def test_a_producer_killed_and_restarted(fleet, proxy_for, reference):
    """2P2D: producer 1 is killed: the proxy sends every prefill to producer 0 and every load is still served. Once
    producer 1 is back (same address), the consumers link to it again: its requests load from it, nothing lost."""
    producers, consumers = fleet
    proxy = proxy_for(producers, consumers, "--cooldown", str(COOLDOWN), *SPREAD)
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


@pytest.mark.parametrize("fleet", [PUSH], indirect=True)
def test_a_producer_killed_while_its_push_is_awaited(fleet, proxy_for, reference):
    """Concurrent dispatch, the proxy in front of producer 1 and consumer 1: producer 1 is frozen, so the decode waits
    for a push that never begins, then killed. The client gets one answer, the reference's, computed by consumer 1
    (nothing loaded) within its push_wait of the kill; the proxy counts the background prefill failed. Consumer 1
    keeps serving: the next request, prefilled by producer 0, loads what producer 0 pushed. (The module's last test:
    producer 1 stays down.)"""
    producers, consumers = fleet
    open_push_links(producers, consumers)
    proxy = proxy_for(producers[1:], consumers[1:])
    tokens = SYSTEM + prompt(7800, 400)
    expected = reference.complete(tokens, MAX_TOKENS)
    before = kv_stats(consumers[1])
    signal_group(producers[1].proc, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(proxy.complete, tokens, MAX_TOKENS)
        wait_busy(consumers[1], 30, answer.done)
        time.sleep(0.5)  # the decode waits for the push
        kill(producers[1].proc)
        killed = time.monotonic()
        text = answer.result(timeout=PUSH_WAIT + 60)
        seconds = time.monotonic() - killed
    change = settled_stats(consumers[1], before, 1)
    print(f"producer killed while its push was awaited: answered {seconds:.1f} s after the kill; {change}")
    assert text == expected
    assert seconds < PUSH_WAIT + 15
    assert change.get("load_failures") == 1 and not change.get("loaded") and not change.get("loaded_bytes"), change
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as resp:
        assert "mooncake_proxy_background_prefill_failed_total 1.0" in resp.read().decode()
    proxy = proxy_for(producers[:1], consumers[1:])
    other = SYSTEM + prompt(7801, 300)
    before = kv_stats(consumers[1])
    assert proxy.complete(other, MAX_TOKENS) == reference.complete(other, MAX_TOKENS)
    change = settled_stats(consumers[1], before, 1)
    assert change.get("await_push_loads") == 1 and change.get("push_loaded") == 1, change
