"""The KV pool on real vLLM and a real ``mooncake_master``: two ``kv_both`` instances (a colocated fleet, no pipe)
share what they compute. A conversation's next turn sent to the other instance loads its history - the first turn's
prompt and answer - from the pool, with the text the colocated reference gives; the bytes it loaded are asserted.
The same holds, with the prompt computed where the pool cannot serve it, under a stranger's planted objects (the
fleet has a secret), a master restart, a killed instance holding objects, and a pool too small for what is stored.
"""

from __future__ import annotations

import concurrent.futures
import re
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.ports import free_port
from harness.store import MooncakeMaster
from harness.vllm import VllmServer, connector_config, mooncake_json, serving
from kv_lookup_buffer import block_keys
from tests.kv_connector.instance_stats import kv_stats, wait_idle
from tests.kv_connector.instances import BLOCK, ROW_BYTES, SERVE_ARGS
from tests.kv_connector.pool_traffic import settled, stored_blocks, turn
from tests.kv_connector.prompts import MAX_TOKENS, prompt

pytestmark = pytest.mark.vllm

SECRET = "pool-test-secret-" + "5" * 32
SEGMENT = 32 << 20  # each instance's share of the pool: 64 blocks of the tiny model (128 in all)


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    with MooncakeMaster(tmp_path_factory.mktemp("master")) as m:
        yield m


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory,
          master: MooncakeMaster) -> Iterator[tuple[VllmServer, VllmServer]]:
    """Two kv_both instances (cores 0 and 1) sharing the pool, with a secret: A stores in its own segment
    (``pool_placement`` local: what a dead A takes with it is known), B where the master places (the default)."""
    work = tmp_path_factory.mktemp("pool")
    config = mooncake_json(work / "mooncake.json", master_server_address=master.address,
                           global_segment_size=SEGMENT, local_buffer_size=16 << 20)
    env = {"MOONCAKE_KV_SECRET": SECRET}
    a, b = (VllmServer(name, tiny_model, free_port(), core, work, connector_config("kv_both", pool_placement=placement),
                       config, SERVE_ARGS, env, worker_process=False)
            for name, core, placement in (("pool-a", 0, "local"), ("pool-b", 1, "spread")))
    with serving(a, b):
        yield a, b


def conversation(a: VllmServer, seed: int, first: int, then: int) -> tuple[list[int], list[int]]:
    """A first turn on ``a`` (its blocks stored once it ended); the second turn's tokens: the whole history and a new
    question. Returns (second turn, first turn's prompt + answer)."""
    before = kv_stats(a)
    tokens = prompt(seed, first)
    _, answer = turn(a, tokens)
    history = tokens + answer
    assert settled(a, before, "pool_saved_blocks", stored_blocks(len(history))).get("pool_saved_blocks", 0) >= \
        stored_blocks(len(history))
    return history + prompt(seed + 1, then), history


def test_the_next_turn_on_the_other_instance_loads_its_history_from_the_pool(fleet, reference):
    a, b = fleet
    second, history = conversation(a, 9000, 600, 150)
    before = kv_stats(b)
    text, _ = turn(b, second, MAX_TOKENS)
    change = settled(b, before, "pool_loaded", 1)
    history_blocks = stored_blocks(len(history))
    assert change.get("pool_hit_tokens") == history_blocks * BLOCK, change
    assert change.get("pool_loaded") == 1 and change.get("pool_loaded_bytes") == history_blocks * ROW_BYTES, change
    assert not change.get("load_failures") and not change.get("pool_rejected"), change
    assert text == reference.complete(second, MAX_TOKENS)  # the history's KV, loaded, gives the colocated text
    # and B stored only what the pool lacked: its own new blocks
    change = settled(b, before, "pool_saved_blocks", 1)
    assert change.get("pool_saved_blocks") == stored_blocks(len(second) + MAX_TOKENS) - history_blocks, change


def test_a_shared_prefix_is_stored_once_and_served_to_every_question(fleet, reference):
    """A document behind several questions: the first question's instance stores it, the other instance loads it for
    each of its questions (its own prefix cache serves the repeats after the first)."""
    a, b = fleet
    document = prompt(9100, 4 * BLOCK)
    before = kv_stats(a)
    turn(a, document + prompt(9101, 40), 8)
    assert settled(a, before, "pool_saved_blocks", 4).get("pool_saved_blocks") == 4
    before = kv_stats(b)
    for seed in (9102, 9103, 9104):
        question = document + prompt(seed, 60)
        assert turn(b, question, MAX_TOKENS)[0] == reference.complete(question, MAX_TOKENS)
    change = settled(b, before, "pool_loaded", 1)
    assert change.get("pool_loaded") == 1 and change.get("pool_loaded_bytes") == 4 * ROW_BYTES, change
    assert change.get("local_hits", 0) >= 2 * 4 * BLOCK, change  # the later questions: its own prefix cache


def test_next_turns_sent_at_once_and_abandoned_ones_load_right(fleet, reference):
    """Eight conversations' next turns reach the other instance at once, two of them given up by their client 50 ms
    in (most likely during their load): every answer kept is right, every load that ended moved exactly its history,
    nothing failed, and the instance serves the abandoned turns right afterwards."""
    a, b = fleet
    turns = [conversation(a, 9800 + 2 * i, 300, 60) for i in range(8)]
    history_blocks = {stored_blocks(len(history)) for _, history in turns}
    assert len(history_blocks) == 1, history_blocks  # one size, so that the bytes add up per load
    per_load = history_blocks.pop() * ROW_BYTES
    before = kv_stats(b)

    def send(i: int) -> str | None:
        second = turns[i][0]
        if i % 4:
            return turn(b, second, MAX_TOKENS)[0]
        try:
            answer = b.complete(second, 200, timeout=0.05)
        except (TimeoutError, urllib.error.URLError):
            return None
        # the instance was quicker than the client's patience: still the right text
        assert answer == reference.complete(second, 200)
        return None

    with concurrent.futures.ThreadPoolExecutor(8) as threads:
        answers = list(threads.map(send, range(8)))
    for i, answer in enumerate(answers):
        if i % 4:
            assert answer == reference.complete(turns[i][0], MAX_TOKENS), i
    wait_idle(b)  # the abandoned requests are aborted, and their loads end, in later steps
    change = settled(b, before, "pool_loaded", 6)
    assert 6 <= change.get("pool_loaded", 0) <= 8, change
    assert change.get("pool_loaded_bytes") == change["pool_loaded"] * per_load, change
    assert not change.get("load_failures") and not change.get("pool_rejected"), change
    for second, _ in turns[::4]:
        assert turn(b, second, MAX_TOKENS)[0] == reference.complete(second, MAX_TOKENS)


def pool_namespace(server: VllmServer) -> str:
    match = re.search(r"KV pool at master \S+ \(TP rank 0\): .* namespace (\w+)", server.log_text())
    assert match, "the instance did not log its pool namespace"
    return match.group(1)


def test_a_strangers_planted_objects_are_refused_and_the_prompt_computed(fleet, reference, master):
    """Anyone who reaches the master can put objects. Without the fleet's secret their tags fail: the load that met
    one fails (recomputed: the right text), the object is removed, and the next instance to compute the prompt stores
    the real one."""
    from tests.kv_lookup_buffer.programs import open_raw_client

    a, b = fleet
    tokens = prompt(9200, 3 * BLOCK + 20)
    keys = block_keys(pool_namespace(a), tokens, BLOCK)
    stranger = open_raw_client(master.address)
    try:
        import torch

        junk = torch.zeros(ROW_BYTES + 32, dtype=torch.uint8)
        assert stranger.register_buffer(junk.data_ptr(), junk.numel()) == 0
        assert stranger.batch_put_from(keys, [junk.data_ptr()] * len(keys), [junk.numel()] * len(keys)) == \
            [0] * len(keys)
        before = kv_stats(b)
        assert turn(b, tokens, MAX_TOKENS)[0] == reference.complete(tokens, MAX_TOKENS)
        change = settled(b, before, "pool_rejected", len(keys))
        assert change.get("pool_rejected") == len(keys) and not change.get("pool_loaded"), change
        assert change.get("load_misses", 0) + change.get("load_failures", 0) == 1, change
        assert not change.get("pool_saved_blocks"), change  # nothing of a failed load is stored
        # the refused objects are gone: the next instance to compute the prompt stores the real ones
        before = kv_stats(a)
        assert turn(a, tokens, MAX_TOKENS)[0] == reference.complete(tokens, MAX_TOKENS)
        change = settled(a, before, "pool_saved_blocks", len(keys))
        assert change.get("pool_saved_blocks") == len(keys) and not change.get("pool_loaded"), change
    finally:
        stranger.close()


def test_a_master_restart_costs_hits_not_answers(fleet, reference, master):
    a, b = fleet
    master.restart()  # every object is forgotten; the clients rejoin on their own
    deadline = time.monotonic() + 60
    seed = 9300
    while True:
        tokens = prompt(seed, 2 * BLOCK + 30)
        assert turn(a, tokens, MAX_TOKENS)[0] == reference.complete(tokens, MAX_TOKENS)  # always answered right
        time.sleep(0.5)
        before = kv_stats(b)
        assert turn(b, tokens, MAX_TOKENS)[0] == reference.complete(tokens, MAX_TOKENS)
        change = settled(b, before, "pool_loaded", 1, timeout=3)
        if change.get("pool_loaded"):
            break
        assert time.monotonic() < deadline, "the pool never served again after the master restarted"
        seed += 1


def test_a_dead_holders_objects_cost_a_load_not_an_answer(fleet, reference):
    """A stores a prompt's blocks in its own segment, then dies: B's load of them fails (or its lookup misses) and B
    computes the prompt, in bounded time. A comes back and the fleet serves again."""
    a, b = fleet
    tokens = prompt(9400, 3 * BLOCK + 10)
    before = kv_stats(a)
    turn(a, tokens, 4)
    settled(a, before, "pool_saved_blocks", 3)
    a.stop()
    try:
        before = kv_stats(b)
        start = time.monotonic()
        assert turn(b, tokens, MAX_TOKENS)[0] == reference.complete(tokens, MAX_TOKENS)
        assert time.monotonic() - start < 30
        change = settled(b, before, "pool_lookups", 1)
        assert change.get("pool_loaded_bytes", 0) < 3 * ROW_BYTES, change  # the dead holder's blocks never came
    finally:
        a.restart()


def test_a_full_pool_evicts_and_every_answer_stays_right(fleet, reference):
    """Four times what the pool holds goes through A: the master evicts the oldest objects; B's questions about the
    first conversations find less or nothing and compute the rest, always with the right text."""
    a, b = fleet
    firsts = [prompt(seed, 7 * BLOCK + 10) for seed in range(9500, 9524)]
    before = kv_stats(a)
    for tokens in firsts:  # 24 x 7 blocks of 512 KiB: 84 MiB through a 64 MiB pool
        turn(a, tokens, 1)
    stored = settled(a, before, "pool_saved_blocks", 24 * 7).get("pool_saved_blocks", 0)
    assert stored > 128, stored  # more than the pool holds was stored: the master evicted
    before = kv_stats(b)
    for tokens in firsts:
        question = tokens + prompt(9700, 30)
        assert turn(b, question, 4)[0] == reference.complete(question, 4)
    change = settled(b, before, "pool_lookups", len(firsts))
    assert change.get("pool_hit_tokens", 0) < 24 * 7 * BLOCK, change  # some conversations were evicted
    assert not change.get("pool_rejected") and not change.get("load_failures"), change
