"""Concurrent dispatch between two real vLLM instances in push mode (issue #27, the connector's side): the decode
request goes to the consumer at the same time as the prefill goes to the producer, with
``{"do_remote_prefill": true, "mooncake_await_push": true}`` instead of the producer's answer; the prefill carries
``mooncake_push_to`` (and its proof: the pair has a secret) as the proxy sends it. Also: an awaited push that never
comes is recomputed after ``push_wait``, ``do_remote_prefill: false`` loads nothing, and a decode abandoned by its
client while its prefill runs leaves nothing behind."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import urllib.request

import pytest

from kv_proxy.discovery import push_target
from tests.kv_connector.instance_stats import diff, flush, kv_stats, settled_stats, wait_busy, wait_idle
from tests.kv_connector.instances import ROW_BYTES
from tests.kv_connector.prompts import AWAIT, MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

PUSH_WAIT = 5.0  # the push pair's push_wait (the default)


def prefill_params(consumer) -> dict:
    """What the proxy puts on a prefill for a push-mode consumer: its pipes and their proof, from its /metrics."""
    with urllib.request.urlopen(f"{consumer.url}/metrics", timeout=10) as resp:
        target = push_target(resp.read().decode())
    assert target is not None, f"{consumer.name} does not advertise a push address on /metrics"
    pipes, proof = target
    return {"do_remote_decode": True, "do_remote_prefill": False, "mooncake_push_to": pipes,
            "mooncake_push_proof": proof}


class Dispatched:
    """The prefill and the decode of one prompt, sent at once (each from a thread of ``pool``)."""

    def __init__(self, pool: concurrent.futures.Executor, producer, consumer, tokens: list[int], params: dict) -> None:
        self.prefill = pool.submit(producer.complete, tokens, 1, kv_transfer_params=params)
        self.decode = pool.submit(consumer.complete, tokens, MAX_TOKENS, kv_transfer_params=AWAIT)

    def text(self) -> str:
        """The decode's text, once both answered."""
        self.prefill.result()
        return self.decode.result()


def test_decodes_sent_with_their_prefills_take_the_pushed_kv(push_pair, reference):
    producer, consumer = push_pair
    params = prefill_params(consumer)
    prefix = prompt(3100, 300)  # two whole blocks shared by two prompts
    first = prompt(3101, 400)
    one_by_one = [first, prefix + prompt(3102, 200), prefix + prompt(3103, 250), prompt(3104, 900), first]
    at_once = [prompt(3110 + i, 200 + 150 * i) for i in range(3)]
    expected = {tuple(t): reference.complete(t, MAX_TOKENS) for t in [*one_by_one, *at_once]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        warm = prompt(3099, 200)  # the push link may still be made: this one may go by pull
        assert Dispatched(pool, producer, consumer, warm, params).text() == reference.complete(warm, MAX_TOKENS)
        flush(producer)
        wait_idle(consumer)
        consumer_before, producer_before = kv_stats(consumer), kv_stats(producer)
        start = time.monotonic()
        answers = [Dispatched(pool, producer, consumer, tokens, params).text() for tokens in one_by_one]
        pairs = [Dispatched(pool, producer, consumer, tokens, params) for tokens in at_once]
        answers += [pair.text() for pair in pairs]
        seconds = time.monotonic() - start
    loads = len(one_by_one) + len(at_once)
    change = settled_stats(consumer, consumer_before, loads)
    flush(producer)
    produced = diff(kv_stats(producer), producer_before)
    print(f"concurrent dispatch: {loads} requests in {seconds:.1f} s; consumer {change}; producer {produced}")
    assert answers == [expected[tuple(t)] for t in [*one_by_one, *at_once]]
    # every decode loaded what its producer pushed (the repeated prompt too: the tail past its cached blocks)
    assert change.get("await_push_loads") == loads and change.get("push_loaded") == loads, change
    assert change.get("loaded") == loads and not change.get("load_failures") and not change.get("load_misses")
    assert not change.get("await_push_timeouts") and not change.get("fetched_bytes")
    assert change.get("loaded_bytes", 0) >= ROW_BYTES * loads and change["loaded_bytes"] % ROW_BYTES == 0
    assert produced.get("pushed") == loads and produced.get("pushed_bytes", 0) >= change["loaded_bytes"]
    assert change.get("local_hits", 0) >= 2 * 128 + 3 * 128  # the shared prefix and the repeated prompt


def test_an_awaited_push_that_never_comes_is_recomputed_after_push_wait(push_pair, reference):
    producer, consumer = push_pair
    tokens = prompt(3200, 300)
    wait_idle(consumer)
    before = kv_stats(consumer)
    start = time.monotonic()
    assert consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=AWAIT) == reference.complete(tokens, MAX_TOKENS)
    seconds = time.monotonic() - start
    change = settled_stats(consumer, before, 1)
    print(f"no prefill: answered in {seconds:.1f} s; {change}")
    assert PUSH_WAIT - 0.5 < seconds < PUSH_WAIT + 20
    assert change.get("await_push_timeouts") == 1 and change.get("load_failures") == 1 and not change.get("loaded")
    # the consumer keeps serving: the next one, with its prefill, loads
    other = prompt(3201, 300)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = Dispatched(pool, producer, consumer, other, prefill_params(consumer)).text()
    assert got == reference.complete(other, MAX_TOKENS)
    assert settled_stats(consumer, before, 2).get("await_push_loads") == 1


def test_do_remote_prefill_false_loads_nothing(push_pair, reference):
    """The proxy skipped the remote prefill: the consumer computes the prompt, attempts no load."""
    _, consumer = push_pair
    tokens = prompt(3300, 500)
    wait_idle(consumer)
    before = kv_stats(consumer)
    params = {"do_remote_prefill": False}
    assert consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == reference.complete(tokens, MAX_TOKENS)
    wait_idle(consumer)
    change = diff(kv_stats(consumer), before)
    for name in ("loaded", "load_failures", "load_misses", "external_hits", "loaded_bytes", "fetched_bytes"):
        assert not change.get(name), change


def test_a_decode_abandoned_while_its_prefill_runs(push_pair, reference):
    """The client goes away while the consumer waits for the push (the prefill still to come). vLLM notices when it
    has something to send (here the load then completed first); whenever it aborts the decode, the consumer keeps
    serving: it goes idle with no load in flight, and the same prompt, sent again with its prefill, is answered
    right from pushed KV."""
    producer, consumer = push_pair
    tokens = prompt(3400, 700)
    params = prefill_params(consumer)
    wait_idle(consumer)
    before = kv_stats(consumer)
    body = json.dumps({"model": consumer.model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "stream": True, "kv_transfer_params": AWAIT}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", consumer.port, timeout=10)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        wait_busy(consumer, 10)
    finally:
        conn.close()  # the client is gone before any token: the decode still waits for its push
    producer.complete(tokens, 1, kv_transfer_params=params)  # the prefill ends after the client left, and pushes
    flush(producer)
    wait_idle(consumer, timeout=PUSH_WAIT + 30)
    left = kv_stats(consumer)
    print(f"abandoned: {diff(left, before)}")
    assert not left.get("loads_in_flight"), left
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = Dispatched(pool, producer, consumer, tokens, params).text()
    assert got == reference.complete(tokens, MAX_TOKENS)
    change = diff(settled_stats(consumer, left, 1), {})
    assert change.get("await_push_loads") == 1 and not change.get("load_failures"), change
