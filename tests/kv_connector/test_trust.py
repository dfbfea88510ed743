"""Who may say where KV comes from and goes to (finding 2 of the trust review), on the real push-mode pair, which
shares a secret: the producer signs the params it answers with, the consumer proves its push address on /metrics.
A request sent straight to an instance with params naming another host is served without ever contacting it."""

from __future__ import annotations

import shutil
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm import OpenAIClient
from kv_connector import params as kv_params
from kv_proxy.discovery import push_target
from tests.kv_connector.instance_stats import diff, kv_stats, settled_stats
from tests.kv_connector.instances import PUSH_PAIR_SECRET
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm


class Intruder:
    """A listener on 127.0.0.1 standing for a host a client names; counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def intruder() -> Iterator[Intruder]:
    listener = Intruder()
    yield listener
    listener.close()


def test_the_producer_signs_its_params_and_the_consumer_loads_with_them(push_pair, reference):
    producer, consumer = push_pair
    tokens = prompt(2100, 400)
    answer = producer.post("/v1/completions", {"model": producer.model, "prompt": tokens, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})
    params = answer["kv_transfer_params"]
    assert params[kv_params.PROOF] == kv_params.producer_params(
        params[kv_params.PIPE], params[kv_params.ENGINE], params[kv_params.REQUEST], PUSH_PAIR_SECRET.encode()
    )[kv_params.PROOF]
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == reference.complete(tokens, MAX_TOKENS)
    change = settled_stats(consumer, before, 1)
    assert change.get("loaded") == change.get("param_loads") == 1 and change.get("loaded_bytes", 0) > 0, change


@pytest.mark.parametrize("proof", [None, "0" * 64, "signed for another pipe"])
def test_forged_params_sent_straight_to_the_consumer_are_recomputed_never_loaded(push_pair, reference, intruder,
                                                                                 proof):
    """Finding 2: without signatures, a client's params made the consumer link to a host of the client's choosing
    and load KV from it into its prefix cache, where other users' requests would find it."""
    producer, consumer = push_pair
    tokens = prompt(2200 + len(str(proof)), 300)
    forged = {"do_remote_prefill": True, "remote_pipe": [intruder.address], "remote_engine_id": "x",
              "remote_tp_size": 1, "remote_request_id": "r"}
    if proof == "signed for another pipe":
        genuine = kv_params.producer_params(["127.0.0.1:1"], "x", "r", PUSH_PAIR_SECRET.encode())
        forged[kv_params.PROOF] = genuine[kv_params.PROOF]
    elif proof is not None:
        forged[kv_params.PROOF] = proof
    before = kv_stats(consumer)
    assert consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=forged) == reference.complete(tokens, MAX_TOKENS)
    change = diff(kv_stats(consumer), before)
    assert not change.get("external_hits") and not change.get("loaded") and not change.get("load_misses"), change
    assert intruder.connections == 0
    assert "is not proven to come from an instance of this fleet" in consumer.log_text()


def test_a_push_target_without_its_proof_is_not_pushed_to(push_pair, reference, intruder):
    """Finding 2: a client's mooncake_push_to reached the producer, which linked to it (a link and two threads
    retrying per target). Without the consumer's proof the producer keeps the KV for pull and contacts nobody."""
    producer, consumer = push_pair
    tokens = prompt(2300, 300)
    before = kv_stats(producer)
    producer.complete(tokens, 1, kv_transfer_params={"do_remote_decode": True, "mooncake_push_to": [intruder.address]})
    assert consumer.complete(tokens, MAX_TOKENS) == reference.complete(tokens, MAX_TOKENS)  # pulled
    assert intruder.connections == 0
    assert not diff(kv_stats(producer), before).get("pushed")
    assert "mooncake_push_proof: missing" in producer.log_text()


def test_the_consumer_publishes_the_proof_of_its_push_address(push_pair):
    _, consumer = push_pair
    with urllib.request.urlopen(f"{consumer.url}/metrics", timeout=10) as resp:
        target = push_target(resp.read().decode())
    assert target is not None
    pipes, proof = target
    assert proof == kv_params.push_proof(PUSH_PAIR_SECRET.encode(), pipes)


def test_vllm_router_in_front_of_a_fleet_with_a_secret(push_pair, reference, tmp_path):
    """vLLM's own router passes the producer's params through unchanged, proof included: with a secret, requests
    through it still load the KV the producer pushed (none is recomputed for want of a proof)."""
    producer, consumer = push_pair
    router = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    assert router, "vllm-router is not installed: scripts/setup.sh installs it with the test extras"
    port = free_port()
    cmd = [router, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
           "--prefill", producer.url, "--decode", consumer.url]
    log = tmp_path / "router.log"
    proc = spawn(cmd, log)
    try:
        wait_ready(proc, cmd, log, http_ok(f"http://127.0.0.1:{port}/health"), "vllm-router", 60)
        client = OpenAIClient(f"http://127.0.0.1:{port}", consumer.model)
        prompts = [prompt(2400 + i, 250 + 60 * i) for i in range(3)]
        before, mark = kv_stats(consumer), len(consumer.log_text())
        assert [client.complete(t, MAX_TOKENS) for t in prompts] == [reference.complete(t, MAX_TOKENS) for t in prompts]
        change = settled_stats(consumer, before, len(prompts))
        # each load named its producer by params (verified: with a secret unproven params never reach a load)
        assert change.get("loaded") == change.get("param_loads") == len(prompts), change
        assert not change.get("load_failures"), change
        assert "is not proven to come from" not in consumer.log_text()[mark:]
    finally:
        stop(proc)
