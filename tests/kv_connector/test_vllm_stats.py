"""The connector's Prometheus metrics on a real producer's and consumer's ``/metrics`` (kv_connector/vllm_stats.py): every
counter, the loads-in-flight gauge and the histograms are there from the start, and one real transfer moves them by
exactly what moved - in pull mode (the load is a transfer) and in push mode (the consumer's wait is not)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from harness.vllm import VllmServer
from kv_connector.stats import COUNTERS, GAUGES
from tests.kv_connector.instance_stats import flush
from tests.kv_connector.instances import ROW_BYTES, blocks
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

PREFIX = "vllm:mooncake_kv_"
HISTOGRAMS = ("load_seconds", "load_bytes", "push_load_seconds", "push_load_bytes", "save_seconds", "save_bytes")


def scrape(server: VllmServer) -> tuple[dict[str, float], dict[str, str]]:
    """Every ``vllm:mooncake_kv_*`` sample summed over labels (histogram buckets left out), and each metric's TYPE."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE " + PREFIX):
            _, _, name, kind = line.split(" ", 3)
            types[name.removeprefix(PREFIX)] = kind
        elif line.startswith(PREFIX) and "_bucket{" not in line:
            name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix(PREFIX)
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values, types


def change(server: VllmServer, before: dict[str, float], key: str, at_least: float, poke: bool = False) -> dict[str, float]:
    """The change since ``before`` once ``key`` grew by ``at_least`` (stats reach /metrics with the engine's steps;
    ``poke``: send a tiny request to make one)."""
    deadline = time.monotonic() + 15
    while True:
        now, _ = scrape(server)
        diff = {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}
        if diff.get(key, 0.0) >= at_least or time.monotonic() > deadline:
            return diff
        if poke:
            server.complete([1, 2, 3], 1)
        time.sleep(0.1)


def test_every_metric_is_exported_with_its_type(pair):
    for server in pair:
        values, types = scrape(server)
        for name in COUNTERS:
            assert types.get(f"{name}_total") == "counter" and f"{name}_total" in values, name
        for name in GAUGES:
            assert types.get(name) == "gauge" and name in values, name
        for name in HISTOGRAMS:
            assert types.get(name) == "histogram" and f"{name}_count" in values, name
        assert types.get("endpoint_info") == "gauge"


def test_one_transfer_moves_the_metrics_by_what_moved(pair, mode, reference):
    producer, consumer = pair
    tokens = prompt(1150 if mode == "pull" else 1160, 700)  # seeds of their own: test_real_traffic's run first
    kv_bytes = blocks(len(tokens) - 1) * ROW_BYTES  # the consumer claims all but the last token
    for server in pair:  # what an earlier test moved reaches /metrics with the next engine step: before the window
        flush(server)
    before_p, _ = scrape(producer)
    before_c, _ = scrape(consumer)
    # as the proxy sends them: the producer's answer (push mode: it says it pushes the prompt) goes on the decode
    answer = producer.post("/v1/completions", {"model": producer.model, "prompt": tokens, "max_tokens": 1,
                                               "kv_transfer_params": {"do_remote_decode": True}})
    params = answer["kv_transfer_params"]
    assert params.get("mooncake_pushed", False) is (mode == "push"), params
    assert consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == reference.complete(tokens, MAX_TOKENS)
    c = change(consumer, before_c, "loaded_total", 1)
    kind, other = ("load", "push_load") if mode == "pull" else ("push_load", "load")
    assert c.get("loaded_total") == 1 and c.get("loaded_bytes_total") == kv_bytes, c
    assert c.get(f"{kind}_seconds_count") == 1 and c.get(f"{kind}_bytes_sum") == kv_bytes, c
    assert f"{other}_seconds_count" not in c and c.get(f"{kind}_seconds_sum", 0) > 0, c
    assert c.get("fetched_bytes_total", 0) == (kv_bytes if mode == "pull" else 0), c
    assert scrape(consumer)[0]["loads_in_flight"] == 0
    if mode == "pull":
        p = change(producer, before_p, "served_bytes_total", kv_bytes, poke=True)
        assert p.get("served_bytes_total") == kv_bytes, p
        assert p.get("saved_total", 0) >= 1 and p.get("save_seconds_count") == p.get("saved_total"), p
    else:
        p = change(producer, before_p, "pushed_bytes_total", blocks(len(tokens)) * ROW_BYTES, poke=True)
        assert p.get("pushed_total") == 1 and p.get("pushed_bytes_total") == blocks(len(tokens)) * ROW_BYTES, p
