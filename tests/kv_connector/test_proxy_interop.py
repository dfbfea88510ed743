"""proxy_server.py in front of vLLM's built-in MooncakeConnector (``--protocol bootstrap``), on real vLLM.

vLLM's connector runs here through ``benchmarks/peers/builtin_mooncake_shim.py`` (a CPU device shim, its bootstrap
server bound to 127.0.0.1, each KV send logged with its bytes). Proof that the proxy speaks its protocol: the
answers equal the colocated reference, the consumer counts external prefix-cache hits, and the producer's log shows
KV sends that succeeded, carrying every block of every prompt.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm import REPO, OpenAIClient, VllmServer, start_vllm
from tests.kv_connector.instance_stats import kv_stats
from tests.kv_connector.instances import ROW_BYTES, SERVE_ARGS, blocks
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

SEND = re.compile(r"BENCH builtin send start=[\d.]+ end=[\d.]+ bytes=(\d+) descs=\d+ ret=(-?\d+)")


@pytest.fixture(scope="module")
def builtin_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer, int]]:
    """vLLM's own MooncakeConnector: a producer (core 0) and a consumer (core 1); yields them and the producer's
    bootstrap port."""
    work = tmp_path_factory.mktemp("builtin")
    bootstrap = free_port()
    shim = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "builtin_mooncake_shim",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    peers = str(REPO / "benchmarks" / "peers")
    env = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap),
           "PYTHONPATH": os.pathsep.join(p for p in (peers, os.environ.get("PYTHONPATH")) if p)}
    producer = VllmServer("builtin-producer", tiny_model, free_port(), 0, work,
                          {**shim, "kv_role": "kv_producer", "engine_id": "interop-prefill"}, None, SERVE_ARGS, env,
                          worker_process=False)
    consumer = VllmServer("builtin-consumer", tiny_model, free_port(), 1, work,
                          {**shim, "kv_role": "kv_consumer", "engine_id": "interop-decode"}, None, SERVE_ARGS, env,
                          worker_process=False)
    try:
        start_vllm(producer, consumer)
        yield producer, consumer, bootstrap
    finally:
        producer.stop()
        consumer.stop()


def start_proxy(tmp: Path, producer: VllmServer, consumer: VllmServer, *args: str) -> tuple[OpenAIClient, object]:
    port = free_port()
    cmd = [sys.executable, str(REPO / "proxy_server.py"), "--port", str(port), "--prefill", producer.url, "--decode",
           consumer.url, *args]
    log = tmp / "proxy.log"
    proc = spawn(cmd, log)
    wait_ready(proc, cmd, log, http_ok(f"http://127.0.0.1:{port}/health"), "proxy", 60)
    return OpenAIClient(f"http://127.0.0.1:{port}", consumer.model), proc


def test_our_proxy_fronts_vllms_builtin_mooncake_connector(builtin_pair, reference, tmp_path):
    producer, consumer, bootstrap = builtin_pair
    proxy, proc = start_proxy(tmp_path, producer, consumer, "--protocol", "bootstrap", "--bootstrap",
                              f"http://127.0.0.1:{bootstrap}")
    try:
        prompts = [prompt(seed, 300 + 100 * (seed % 4)) for seed in range(8100, 8106)]
        hits_before = kv_stats(consumer)["external_hits"]
        sends_before = len(SEND.findall(producer.log_text()))
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda t: proxy.complete(t, MAX_TOKENS), prompts))
        assert answers == [reference.complete(t, MAX_TOKENS) for t in prompts]
        # its sends may carry several requests at once: count bytes, every block of every prompt
        sends = SEND.findall(producer.log_text())[sends_before:]
        assert all(ret == "0" for _, ret in sends), sends
        assert sum(int(n) for n, _ in sends) == sum(blocks(len(p)) for p in prompts) * ROW_BYTES, sends
        assert kv_stats(consumer)["external_hits"] - hits_before >= sum(len(p) - 128 for p in prompts)
    finally:
        stop(proc)
