"""Faults on real vLLM instances (pull mode, a pair of its own, under vLLM's default ``kv_load_failure_policy``,
``fail``, as users run it): prefills whose decode never comes filling the producer's buffer, entries expiring, the
producer killed and restarted under traffic, the consumer killed and restarted. Every answer equals the colocated
reference throughout: a prompt the producer no longer holds is found empty and computed on the consumer; a load that
was found and then broke ends its request with an error, which the proxy answers by sending it again whole.

Where the suite runs as root the pair is on two hosts (harness/netns.py): the producer and the consumer each in a
network namespace of its own, the KV, the side channel and the Transfer Engine's metadata (etcd, on the producer's
host) crossing a software wire between them, with the secret and ``engine_ports`` set, the proxy and the reference
in the root namespace. The tests of the wire itself (delay and loss, a partition mid-load and its healing) run only
there; elsewhere the pair is on 127.0.0.1 and they are skipped, saying why."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import netns
from harness.netns import Host, Wire
from harness.processes import kill, signal_group
from harness.vllm import OpenAIClient, VllmServer
from kv_proxy.protocols import NO_LOAD
from tests import servers
from tests.kv_connector.instance_stats import diff, kv_stats, looked_up, settled_stats
from tests.kv_connector.instances import ROW_BYTES, blocks, start_pair
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

BUFFER = 12 << 20  # room for two 1000-token entries (4 MiB of KV each)
TTL = 4.0
PACE = 0.2  # seconds between a client's requests under traffic: steady traffic, and a few hundred answers to check


SECRET = "two-hosts-secret-" + "5" * 32
ENGINE_PORTS = [17000, 17099]
LOAD_TIMEOUT = 10.0  # the consumer's load_timeout (the default)


@dataclass(frozen=True)
class Network:
    producer: Host
    consumer: Host
    wire: Wire
    etcd: str  # "host:port" on the producer's host


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Network | None]:
    """Two hosts and the wire between them, etcd on the producer's host; None where they cannot be made."""
    if netns.unavailable() is not None:
        yield None
        return
    with netns.two_hosts() as (producer, consumer, wire), servers.etcd_server(
            tmp_path_factory.mktemp("etcd"), host=producer.kv, prefix=producer.prefix(), probe_host=producer.http) as etcd:
        yield Network(producer, consumer, wire, etcd)


@pytest.fixture
def two_hosts(network: Network | None) -> Iterator[Network]:
    """The network, for a test of the wire (skipped on 127.0.0.1); the wire is whole again after it."""
    if network is None:
        pytest.skip(f"the pair runs on 127.0.0.1: {netns.unavailable()}")
    yield network
    network.wire.heal()
    network.wire.set()


@pytest.fixture(scope="module")
def fault_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
               network: Network | None) -> Iterator[tuple[VllmServer, VllmServer]]:
    where: dict = {} if network is None else {
        "hosts": (network.producer, network.consumer), "auth_secret": SECRET, "engine_ports": ENGINE_PORTS,
        "metadata_server": f"etcd://{network.etcd}", "metadata_backend": "etcd"}
    producer, consumer = start_pair(tiny_model, tmp_path_factory.mktemp("faults"), "faults", confine=True,
                                    producer_extra={"buffer_size": BUFFER, "entry_ttl": TTL},
                                    consumer_extra={"load_timeout": LOAD_TIMEOUT}, failure_policy=None, **where)
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
    reference.ensure_ready()  # not starting beside the timed prefills
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
    assert looked_up(consumer, before, 1).get("lookup_misses") == 1  # found empty: computed here, no load


def test_entries_nobody_takes_expire(fault_pair, reference):
    producer, consumer = fault_pair
    tokens = prompt(2100, 300)
    before = kv_stats(producer)
    producer.complete(tokens, 1)
    time.sleep(TTL + 1.5)
    assert producer_stats(producer, before, "expired", 1).get("expired", 0) >= 1
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    assert looked_up(consumer, before, 1).get("lookup_misses") == 1


def proxy_metric(proxy: OpenAIClient, name: str) -> float:
    """The sum of a counter's samples on the proxy's /metrics."""
    with urllib.request.urlopen(f"{proxy.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_kv_crosses_the_link_between_the_hosts(two_hosts, fault_pair, proxy_for, reference):
    """Six requests with a shared system prompt, three at a time, through the proxy (in the root namespace): every
    answer is the reference's, each loaded from the other host, and the KV crossed the wire. Each instance listens
    on its own host's addresses: the side channel on the KV link's, the Transfer Engine within ``engine_ports``."""
    producer, consumer = fault_pair
    proxy = proxy_for([producer], [consumer])
    system = prompt(2500, 384)
    prompts = [system + prompt(2510 + i, 150 + 30 * i) for i in range(6)]
    before, crossed = kv_stats(consumer), two_hosts.wire.bytes_to_consumer
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda tokens: proxy.complete(tokens, MAX_TOKENS), prompts))
    assert answers == [reference.complete(tokens, MAX_TOKENS) for tokens in prompts]
    moved = settled_stats(consumer, before, 6)
    crossed = two_hosts.wire.bytes_to_consumer - crossed
    print(f"two hosts: {moved.get('fetched_bytes', 0) / 2**20:.1f} MiB of KV loaded, {crossed / 2**20:.1f} MiB crossed "
          f"the wire to the consumer's host; stats change {moved}")
    assert moved.get("loaded") == 6 and not moved.get("load_failures"), moved
    assert crossed >= moved["fetched_bytes"] > 0
    config = json.loads(Path(producer.env["MOONCAKE_CONFIG_PATH"]).read_text())
    for host, server, url in ((two_hosts.producer, producer, config["prefill_url"]),
                              (two_hosts.consumer, consumer, config["decode_url"])):
        listening = host.listening()
        print(f"{server.name} listens on {sorted(listening)}")
        side_port = int(url.rsplit(":", 1)[1])
        assert (host.kv, side_port) in listening, (url, listening)
        assert (host.http, server.port) in listening, listening
        others = [(ip, port) for ip, port in listening if port not in (side_port, server.port)
                  and ip not in ("127.0.0.1", "::1") and not ENGINE_PORTS[0] <= port <= ENGINE_PORTS[1]
                  and f"{ip}:{port}" != two_hosts.etcd and (ip, port) != (two_hosts.producer.http,
                                                                   int(two_hosts.etcd.rsplit(":", 1)[1]))]
        assert not others, f"{server.name} listens outside its side channel, HTTP port and engine_ports: {others}"


def test_delay_and_loss_on_the_wire(two_hosts, fault_pair, reference):
    """20 ms each way and 1% of the frames lost: every load completes, exact."""
    producer, consumer = fault_pair
    two_hosts.wire.set(delay=0.02, loss=0.01)
    prompts = [prompt(2600 + i, 400 + 150 * i) for i in range(4)]
    before, crossed = kv_stats(consumer), two_hosts.wire.bytes_to_consumer
    seconds = []
    for tokens in prompts:
        producer.complete(tokens, 1)
        start = time.monotonic()
        assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
        seconds.append(round(time.monotonic() - start, 2))
    moved = settled_stats(consumer, before, 4)
    print(f"delay 20 ms, loss 1%: decodes took {seconds} s; {moved.get('fetched_bytes', 0) / 2**20:.1f} MiB loaded, "
          f"{(two_hosts.wire.bytes_to_consumer - crossed) / 2**20:.1f} MiB crossed; stats change {moved}")
    assert moved.get("loaded") == 4 and not moved.get("load_failures"), moved
    assert moved.get("fetched_bytes") == sum(blocks(len(tokens) - 1) for tokens in prompts) * ROW_BYTES


def test_a_partition_mid_load_ends_it_within_load_timeout_then_loads_resume(two_hosts, fault_pair, proxy_for,
                                                                            reference):
    """Through the proxy, under the default policy: the wire is cut once the first MiB of a 4 MiB load crossed, and
    stays cut. The load fails by load_timeout (plus a small margin), which ends the request with an error; the proxy
    sends it again whole to the consumer, and the client gets the right answer. Once healed, the next prompt loads."""
    producer, consumer = fault_pair
    proxy = proxy_for([producer], [consumer])
    tokens = prompt(2700, 1000)
    before, retried = kv_stats(consumer), proxy_metric(proxy, "mooncake_proxy_decode_retries_total")
    two_hosts.wire.cut_after(1 << 20)
    start = time.monotonic()
    answer = proxy.complete(tokens, MAX_TOKENS, timeout=120)
    seconds = time.monotonic() - start
    assert two_hosts.wire.is_cut, "the load finished before the wire was cut"
    change = settled_stats(consumer, before, 1)
    retries = proxy_metric(proxy, "mooncake_proxy_decode_retries_total") - retried
    print(f"partition mid-load: answered after {seconds:.2f} s through the proxy (load_timeout {LOAD_TIMEOUT:g} s), "
          f"{retries:g} retried whole; stats change {change}")
    assert answer == reference.complete(tokens, MAX_TOKENS)
    assert change.get("load_failures") == 1 and not change.get("loaded"), change
    assert retries == 1
    assert seconds < LOAD_TIMEOUT + 5.0, f"the request took {seconds:.1f} s"
    two_hosts.wire.heal()
    tokens = prompt(2701, 800)
    producer.complete(tokens, 1)
    before = kv_stats(consumer)
    start = time.monotonic()
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)
    healed = settled_stats(consumer, before, 1)
    print(f"healed: the next decode took {time.monotonic() - start:.2f} s; stats change {healed}")
    assert healed.get("loaded") == 1 and healed.get("fetched_bytes") == blocks(799) * ROW_BYTES, healed


def test_producer_killed_mid_load_through_the_proxy(two_hosts, fault_pair, proxy_for, reference):
    """Under the default policy, through the proxy: the wire slowed (30 ms each way) so that a 4 MiB load takes a
    while; once a quarter of it crossed, the producer is killed. The consumer's load fails as its connection dies,
    the request ends with an error, the proxy sends it again whole, and the client gets the right answer within
    load_timeout plus the retry. (``live_pair`` restarts the producer for the next test.)"""
    producer, consumer = fault_pair
    proxy = proxy_for([producer], [consumer])
    tokens = prompt(2800, 1000)
    two_hosts.wire.set(delay=0.03)
    before, retried = kv_stats(consumer), proxy_metric(proxy, "mooncake_proxy_decode_retries_total")
    outcome: dict[str, object] = {}

    def request() -> None:
        start = time.monotonic()
        outcome["answer"] = proxy.complete(tokens, MAX_TOKENS, timeout=120)
        outcome["seconds"] = time.monotonic() - start

    crossed = two_hosts.wire.bytes_to_consumer
    client = threading.Thread(target=request)
    client.start()
    try:
        deadline = time.monotonic() + 60
        while two_hosts.wire.bytes_to_consumer - crossed < 1 << 20 and "answer" not in outcome:
            assert time.monotonic() < deadline, "the load never began"
            time.sleep(0.005)
        assert "answer" not in outcome, "the load ended before the producer could be killed"
        kill(producer.proc)
        client.join(timeout=120)
    finally:
        client.join(timeout=120)
        two_hosts.wire.set()
    change = settled_stats(consumer, before, 1)
    retries = proxy_metric(proxy, "mooncake_proxy_decode_retries_total") - retried
    print(f"producer killed mid-load: answered after {outcome.get('seconds', 0):.2f} s through the proxy, {retries:g} "
          f"retried whole; stats change {change}")
    assert outcome.get("answer") == reference.complete(tokens, MAX_TOKENS)
    assert change.get("load_failures") == 1 and not change.get("loaded"), change
    assert retries == 1
    assert outcome["seconds"] < LOAD_TIMEOUT + 5.0


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
    retried: list[str] = []  # the phases in which the direct client's decode failed and was sent again whole

    def direct(tokens: list[int]) -> str:
        try:
            producer.complete(tokens, 1, timeout=30)
        except OSError:
            pass  # down: the decode goes to the consumer anyway
        try:
            return consumer.complete(tokens, 8)
        except urllib.error.HTTPError as e:  # a load found and then broken by the kill, under "fail": sent whole
            if e.code != 500:
                raise
            retried.append(phase[0])
            return consumer.complete(tokens, 8, kv_transfer_params=NO_LOAD)

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
    assert len(retried) <= 1, f"direct decodes failed {len(retried)} times ({retried}): only one kill could do that"
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


def test_a_frozen_producer_killed_while_its_lookup_waits(fault_pair, reference):
    """The producer is frozen (SIGSTOP) when the decode comes straight to the consumer: its lookup waits for an
    answer; the producer is killed 1.5 s in. The lookup fails as soon as the connection dies (or at lookup_timeout,
    2 s, whichever comes first), nothing is claimed, the consumer computes the prompt: the right answer, no error,
    no load. The producer stays down (``live_pair`` restarts it if another test follows)."""
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
        time.sleep(1.5)  # the lookup has asked the frozen producer by now
        if "answer" in outcome:
            said = [line for line in consumer.log_text().splitlines() if "Mooncake" in line or "drop_select" in line]
            raise AssertionError(f"the consumer answered in {outcome['seconds']:.2f} s while its producer was frozen: "
                                 f"stats change {diff(kv_stats(consumer), before)}; its last connector log lines:\n"
                                 + "\n".join(said[-8:]))
        kill(producer.proc)
        client.join(timeout=60)
        assert outcome.get("answer") == reference.complete(tokens, MAX_TOKENS)
        print(f"the consumer answered {outcome['seconds']:.2f} s after the request (the producer was killed at 1.5 s)")
        assert outcome["seconds"] < 2.0 + 3.0, f"the consumer waited {outcome['seconds']:.1f} s"
        change = looked_up(consumer, before, 1)
        assert change.get("lookup_errors") == 1 and not change.get("loaded") and not change.get("load_failures"), change
    finally:
        client.join(timeout=60)
