"""The KV pool across two hosts (harness/netns.py: two network namespaces joined by a software wire that can delay
and cut): the ``mooncake_master`` on host A, a ``kv_both`` instance on each host, the fleet's secret and
``engine_ports`` set, the test and the colocated reference in the root namespace. A conversation's next turn on host
B loads its history from A's segment across the wire; a partition in the middle of that load ends it by its deadline
and the prompt is computed (the right text); with the master cut off, B answers every request, computed, and loads
from the pool again once the wire heals. Runs where the suite runs as root; skipped elsewhere, saying why."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import netns
from harness.netns import Host, Wire
from harness.ports import free_port
from harness.store import MooncakeMaster
from harness.vllm import VllmServer, connector_config, start_vllm
from tests.kv_connector.instance_stats import kv_stats
from tests.kv_connector.instances import BLOCK, ROW_BYTES, SERVE_ARGS
from tests.kv_connector.pool_traffic import settled, stored_blocks, turn
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

SECRET = "pool-two-hosts-" + "6" * 32
ENGINE_PORTS = [17100, 17199]
LOAD_TIMEOUT = 6.0


@dataclass(frozen=True)
class Fleet:
    a: VllmServer
    b: VllmServer
    host_a: Host
    host_b: Host
    wire: Wire


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two hosts cannot be made here: {why}")
    work = tmp_path_factory.mktemp("pool-two-hosts")
    with netns.two_hosts() as (host_a, host_b, wire), \
            MooncakeMaster(work, host=host_a.kv, prefix=host_a.prefix()) as master:
        servers = []
        for name, host, core in (("pool-host-a", host_a, 0), ("pool-host-b", host_b, 1)):
            config = work / f"{name}.json"
            config.write_text(json.dumps({
                "prefill_url": f"{host.kv}:{free_port()}", "decode_url": f"{host.kv}:{free_port()}",
                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "timeout": 5, "auth_secret": SECRET,
                "engine_ports": ENGINE_PORTS, "master_server_address": master.address, "local_hostname": host.kv,
                "global_segment_size": 32 << 20, "local_buffer_size": 16 << 20}))
            # A keeps what it stores in its own segment, so that B's loads cross the wire (B: the master places)
            placement = "local" if host is host_a else "spread"
            servers.append(VllmServer(name, tiny_model, free_port(), core, work,
                                      connector_config("kv_both", load_timeout=LOAD_TIMEOUT, pool_placement=placement),
                                      config, SERVE_ARGS,
                                      host=host.http, prefix=host.prefix(), worker_process=False))
        try:
            start_vllm(*servers)
            yield Fleet(servers[0], servers[1], host_a, host_b, wire)
        finally:
            wire.heal()
            for server in servers:
                server.stop()


def first_turn(fleet: Fleet, seed: int, length: int) -> list[int]:
    """A first turn on host A, stored in the pool (A's own segment); the history the next turn carries."""
    before = kv_stats(fleet.a)
    tokens = prompt(seed, length)
    _, answer = turn(fleet.a, tokens)
    history = tokens + answer
    assert settled(fleet.a, before, "pool_saved_blocks", stored_blocks(len(history))).get("pool_saved_blocks") == \
        stored_blocks(len(history))
    return history


def test_the_next_turn_on_the_other_host_loads_its_history_across_the_wire(fleet, reference):
    history = first_turn(fleet, 9950, 700)
    second = history + prompt(9951, 100)
    before, crossed = kv_stats(fleet.b), fleet.wire.bytes_to_consumer
    assert turn(fleet.b, second, MAX_TOKENS)[0] == reference.complete(second, MAX_TOKENS)
    change = settled(fleet.b, before, "pool_loaded", 1)
    loaded = stored_blocks(len(history)) * ROW_BYTES
    assert change.get("pool_loaded_bytes") == loaded and not change.get("pool_rejected"), change
    assert fleet.wire.bytes_to_consumer - crossed >= loaded  # from A's segment, over the wire


def test_a_partition_mid_load_ends_it_by_its_deadline_and_the_prompt_is_computed(fleet, reference):
    history = first_turn(fleet, 9960, 900)
    second = history + prompt(9961, 60)
    fleet.wire.cut_after(1 << 20)  # the history is 3.5 MiB: the wire goes mid-load
    before = kv_stats(fleet.b)
    start = time.monotonic()
    try:
        assert turn(fleet.b, second, MAX_TOKENS)[0] == reference.complete(second, MAX_TOKENS)
        took = time.monotonic() - start
    finally:
        fleet.wire.heal()
    assert fleet.wire.is_cut is False
    change = settled(fleet.b, before, "pool_lookups", 1)
    assert took < LOAD_TIMEOUT + 10, took
    assert change.get("pool_loaded_bytes", 0) < stored_blocks(len(history)) * ROW_BYTES, change  # not all of it came
    # whole again: the next conversation loads across the wire
    history = first_turn(fleet, 9962, 500)
    before = kv_stats(fleet.b)
    second = history + prompt(9963, 50)
    assert turn(fleet.b, second, MAX_TOKENS)[0] == reference.complete(second, MAX_TOKENS)
    assert settled(fleet.b, before, "pool_loaded", 1).get("pool_loaded_bytes") == \
        stored_blocks(len(history)) * ROW_BYTES


def test_with_the_master_cut_off_every_request_is_answered_and_the_pool_resumes(fleet, reference):
    history = first_turn(fleet, 9970, 600)
    fleet.wire.cut()  # B reaches neither the master nor A's segment
    try:
        before = kv_stats(fleet.b)
        for seed in (9971, 9972):
            tokens = history + prompt(seed, 40)
            start = time.monotonic()
            assert turn(fleet.b, tokens, MAX_TOKENS)[0] == reference.complete(tokens, MAX_TOKENS)
            assert time.monotonic() - start < 15
        change = settled(fleet.b, before, "pool_lookups", 2)
        assert not change.get("pool_loaded") and not change.get("load_failures"), change
    finally:
        fleet.wire.heal()
    deadline = time.monotonic() + 60
    seed = 9980
    while True:  # the client finds its master again on its own
        history = first_turn(fleet, seed, 3 * BLOCK + 20)
        before = kv_stats(fleet.b)
        second = history + prompt(seed + 1, 30)
        assert turn(fleet.b, second, MAX_TOKENS)[0] == reference.complete(second, MAX_TOKENS)
        if settled(fleet.b, before, "pool_loaded", 1, timeout=3).get("pool_loaded"):
            break
        assert time.monotonic() < deadline, "the pool never served across the wire again"
        seed += 2
