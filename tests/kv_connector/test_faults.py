"""Faults on real vLLM instances (pull mode, a pair of its own): prefills whose decode never comes filling the
producer's buffer, entries expiring, the producer killed and restarted under traffic, the consumer killed and
restarted. Every answer equals the colocated reference throughout."""

from __future__ import annotations

import concurrent.futures
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.processes import kill, signal_group
from harness.vllm import OpenAIClient, VllmServer
from tests.kv_connector.conftest import ROW_BYTES, blocks, diff, kv_stats, settled_stats, start_pair
from tests.kv_connector.test_mooncake_connector import MAX_TOKENS, prompt

BUFFER = 12 << 20  # room for two 1000-token entries (4 MiB of KV each)
TTL = 4.0
PACE = 0.2  # seconds between a client's requests under traffic: steady traffic, and a few hundred answers to check


@pytest.fixture(scope="module")
def fault_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("faults"), "faults", confine=True,
                                    producer_extra={"buffer_size": BUFFER, "entry_ttl": TTL})
    yield producer, consumer
    producer.stop()
    consumer.stop()


@pytest.fixture(autouse=True)
def live_pair(fault_pair: tuple[VllmServer, VllmServer]) -> None:
    """Each test starts with both instances serving: a test that killed one need not restart it when nothing else
    follows it (a restart costs tens of seconds here)."""
    for server in fault_pair:
        if server.proc.poll() is not None:
            server.restart()


def producer_stats(producer: VllmServer, before: dict[str, float], key: str, at_least: float) -> dict[str, float]:
    """The producer's stats change once ``key`` reached ``at_least`` (they reach /metrics with its engine steps)."""
    deadline = time.monotonic() + 10
    while True:
        change = diff(kv_stats(producer), before)
        if change.get(key, 0) >= at_least or time.monotonic() > deadline:
            return change
        producer.complete([1, 2, 3], 1)  # a step, to carry the stats
        time.sleep(0.1)


def test_orphans_fill_the_buffer_without_stalling_the_producer(fault_pair, reference):
    """14 prefills of 4 MiB of KV each, none decoded, into a 12 MiB buffer: every prefill takes as long as the first
    ones (the oldest entries are evicted), and the newest still loads."""
    producer, consumer = fault_pair
    before = kv_stats(producer)
    latencies = []
    prompts = [prompt(2000 + i, 1000) for i in range(14)]
    for tokens in prompts:
        start = time.monotonic()
        producer.complete(tokens, 1)
        latencies.append(time.monotonic() - start)
    change = producer_stats(producer, before, "evicted", 12)
    print(f"prefill seconds: {[round(t, 3) for t in latencies]}, producer stats: {change}")
    assert change.get("saved", 0) >= 14 and change.get("evicted", 0) + change.get("expired", 0) >= 12
    assert max(latencies[3:]) < 2 * statistics.median(latencies[:3]) + 0.5, "prefills slowed down as the buffer filled"
    before = kv_stats(consumer)
    assert consumer.complete(prompts[-1], MAX_TOKENS) == reference.complete(prompts[-1], MAX_TOKENS)
    moved = settled_stats(consumer, before, 1)
    assert moved.get("loaded") == 1 and moved.get("fetched_bytes") == blocks(999) * ROW_BYTES
    before = kv_stats(consumer)
    assert consumer.complete(prompts[0], MAX_TOKENS) == reference.complete(prompts[0], MAX_TOKENS)  # evicted
    assert settled_stats(consumer, before, 1).get("load_misses") == 1


def test_entries_nobody_takes_expire(fault_pair, reference):
    producer, consumer = fault_pair
    tokens = prompt(2100, 300)
    before = kv_stats(producer)
    producer.complete(tokens, 1)
    time.sleep(TTL + 1.5)
    assert producer_stats(producer, before, "expired", 1).get("expired", 0) >= 1
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    assert settled_stats(consumer, before, 1).get("load_misses") == 1


def proxy_metric(proxy: OpenAIClient, name: str) -> float:
    """The sum of a counter's samples on the proxy's /metrics."""
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_producer_killed_and_restarted_under_traffic(fault_pair, proxy_for, reference):
    """Two clients keep sending requests while the only producer is killed and restarted (one kill and restart for
    both, a restart costs tens of seconds here):

    - ``direct`` sends the prefill, then the decode to the consumer whatever the prefill did (a proxy without a
      fallback): while the producer is down the consumer recomputes, and notices at once (no request waits for a
      timeout);
    - ``proxy`` goes through the proxy with its defaults: every request is answered; while no producer can take them
      the proxy sends them whole to the consumer (counted on its /metrics, logged once per outage).

    Every answer is the reference's; once the producer is back, loads resume without restarting the consumer. (The
    pair is confined to a core each: see ``VllmServer``.)"""
    producer, consumer = fault_pair
    proxy = proxy_for([producer], [consumer], "--cooldown", "1")
    stop = threading.Event()
    phase = ["up"]
    results: list[tuple[str, str, list[int], str, float]] = []  # client, phase, prompt, answer, decode seconds
    errors: list[str] = []

    def direct(tokens: list[int]) -> str:
        try:
            producer.complete(tokens, 1, timeout=30)
        except OSError:
            pass  # down: the decode goes to the consumer anyway
        return consumer.complete(tokens, 8)

    def client(k: int, kind: str) -> None:
        i = 0
        while not stop.is_set():
            tokens = prompt(3000 + 1000 * k + i, 300 + 40 * (i % 5))
            i += 1
            try:
                start = time.monotonic()
                answer = direct(tokens) if kind == "direct" else proxy.complete(tokens, 8)
                results.append((kind, phase[0], tokens, answer, time.monotonic() - start))
            except OSError as e:  # an HTTP error status too
                errors.append(f"{kind}, {phase[0]}: {e}")
            stop.wait(PACE)

    clients = [threading.Thread(target=client, args=(k, kind)) for k, kind in enumerate(("direct", "proxy"))]
    for t in clients:
        t.start()
    try:
        time.sleep(3)
        kill(producer.proc)
        phase[0] = "down"
        time.sleep(4)
        phase[0] = "restarting"
        producer.restart()
        phase[0] = "back"
        before = kv_stats(consumer)
        time.sleep(5)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=120)
    after = settled_stats(consumer, before, 1)
    assert not errors, errors[:3]
    phases = ("up", "down", "restarting", "back")
    counts = {(kind, p): sum(r[0] == kind and r[1] == p for r in results) for kind in ("direct", "proxy") for p in phases}
    print(counts)
    assert all(n >= 2 for n in counts.values()), f"too little traffic in some phase: {counts}"
    slowest_down = max(r[4] for r in results if r[0] == "direct" and r[1] in ("down", "restarting"))
    assert slowest_down < 3.0, f"a decode waited {slowest_down:.1f} s while the producer was down"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # the reference batches them
        expected = list(pool.map(lambda r: reference.complete(r[2], 8), results))
    wrong = [r[:2] for r, answer in zip(results, expected, strict=True) if r[3] != answer]
    assert not wrong, f"{len(wrong)} of {len(results)} answers differ from the reference ({wrong[:5]})"
    assert proxy_metric(proxy, "mooncake_proxy_prefill_fallbacks_total") >= counts["proxy", "down"]
    assert after.get("loaded", 0) >= 1 and after.get("fetched_bytes", 0) > 0, "loads did not resume"


def test_consumer_killed_and_restarted(fault_pair, reference):
    producer, consumer = fault_pair
    kill(consumer.proc)
    producer.complete(prompt(2201, 500), 1)  # the producer keeps serving while its consumer is gone
    consumer.restart()  # longer than entry_ttl: that entry expires meanwhile
    tokens = prompt(2200, 500)
    producer.complete(tokens, 1)
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    moved = settled_stats(consumer, before, 1)
    assert moved.get("loaded") == 1 and moved.get("fetched_bytes") == blocks(499) * ROW_BYTES


def test_producer_killed_in_the_middle_of_a_load(fault_pair, reference):
    """The consumer's load has asked the producer (frozen, SIGSTOP: the transfer cannot finish) when the producer is
    killed: the load fails as soon as the connection dies, not after load_timeout (10 s), the prompt is recomputed
    and the answer is right. The producer stays down (``live_pair`` restarts it if another test follows)."""
    producer, consumer = fault_pair
    tokens = prompt(2300, 800)
    producer.complete(tokens, 1)
    before = kv_stats(consumer)
    signal_group(producer.proc, signal.SIGSTOP)
    outcome: dict[str, object] = {}

    def decode() -> None:
        start = time.monotonic()
        outcome["answer"] = consumer.complete(tokens, MAX_TOKENS)
        outcome["seconds"] = time.monotonic() - start

    client = threading.Thread(target=decode)
    client.start()
    try:
        time.sleep(1.5)  # the load has asked the frozen producer by now
        if "answer" in outcome:
            said = [line for line in consumer.log_text().splitlines() if "Mooncake" in line or "drop_select" in line]
            raise AssertionError(f"the consumer answered in {outcome['seconds']:.2f} s while its producer was frozen: "
                                 f"stats change {diff(kv_stats(consumer), before)}; its last connector log lines:\n"
                                 + "\n".join(said[-8:]))
        kill(producer.proc)
        client.join(timeout=60)
        assert outcome.get("answer") == reference.complete(tokens, MAX_TOKENS)
        print(f"the consumer answered {outcome['seconds']:.2f} s after the request (the producer was killed at 1.5 s)")
        assert outcome["seconds"] < 1.5 + 4.0, f"the consumer waited {outcome['seconds']:.1f} s"
        change = settled_stats(consumer, before, 1)
        assert change.get("load_failures") == 1 and not change.get("loaded"), change
    finally:
        client.join(timeout=60)
