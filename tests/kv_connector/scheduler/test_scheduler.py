"""The schedulers, on vLLM's own Request / KVCacheBlocks / SchedulerOutput: what a consumer claims and loads into
which blocks, what a producer saves and pushes in which step, and the params it answers with."""

from __future__ import annotations

import dataclasses

import pytest

from kv_connector import params as kv_params
from kv_connector import source
from kv_connector.metadata import LookupAnswer, MooncakeWorkerMetadata
from kv_connector.scheduler import consumer as scheduler_consumer
from kv_connector.scheduler.consumer import ConsumerScheduler
from kv_connector.scheduler.producer import ProducerScheduler
from tests.kv_connector.units import DECODE, PREFILL, SECRET, config, kv_blocks, request, step

BLOCK = 16


@pytest.fixture(autouse=True)
def _no_secret_from_the_environment(monkeypatch):
    monkeypatch.delenv("MOONCAKE_KV_SECRET", raising=False)


def answer(sched: ConsumerScheduler, held: int | None = None, ranks: range | None = None, error: str = "") -> int:
    """What the workers do with the lookups of the last step (``lookups.py``): each TP rank (``ranks``, default all)
    answers that the producer holds ``held`` tokens (default: the whole prompt); how many lookups were answered."""
    sent, sched.to_look = sched.to_look, []  # what the next step's metadata would carry (its loads stay queued)
    answers = [LookupAnswer(look.req_id, look.lease, rank, len(look.token_ids) if held is None else held, error)
               for look in sent for rank in (ranks if ranks is not None else range(sched.tp))]
    sched.answered(MooncakeWorkerMetadata(answers))
    return len(sent)


def claim(sched: ConsumerScheduler, req, local: int, blocks: list[int], held: int | None = None):
    """vLLM's calls for one request: the match (asked again once the lookup it sent is answered: the producer holds
    ``held`` tokens, default all), then the allocation of every block of the prompt."""
    tokens, is_async = sched.num_new_matched_tokens(req, local)
    if tokens is None:
        assert answer(sched, held) == 1
        tokens, is_async = sched.num_new_matched_tokens(req, local)
    sched.after_alloc(req, kv_blocks(blocks), tokens)
    return tokens, is_async


# ---------------------------------------------------------------- consumer
@pytest.mark.parametrize("prompt_len, local, recompute, tokens, first, end", [
    (100, 0, 1, 99, 0, 7),  # 7 blocks, the last one partial; the last token is computed here
    (96, 0, 1, 95, 0, 6),  # block aligned: the last block still holds loaded tokens
    (100, 32, 1, 67, 2, 7),  # two blocks in the own prefix cache: loaded from the third on
    (100, 0, 2, 98, 0, 7),  # MLA on the CPU: the last two tokens computed here
    (17, 0, 1, 16, 0, 1),  # the recompute tail alone in the last block: that block is not loaded
    (33, 16, 2, 15, 1, 2),
])
def test_a_consumer_claims_the_blocks_it_lacks_but_the_recompute_tail(prompt_len, local, recompute, tokens, first,
                                                                      end):
    sched = ConsumerScheduler(config(), BLOCK, recompute)
    ids = [100 + i for i in range(-(-prompt_len // BLOCK))]
    assert claim(sched, request("r", prompt_len), local, ids) == (tokens, True)
    (load,) = sched.build_meta(step(new={"r": (local + tokens, 0)})).loads
    assert (load.first_block, load.block_ids, load.num_tokens) == (first, ids[first:end], tokens)
    assert load.token_ids == list(range(prompt_len))


@pytest.mark.parametrize("prompt_len, local, recompute", [(1, 0, 1), (0, 0, 1), (2, 0, 2), (48, 32, 16), (32, 32, 1)])
def test_nothing_to_claim_when_the_prefix_cache_and_the_tail_cover_the_prompt(prompt_len, local, recompute):
    sched = ConsumerScheduler(config(), BLOCK, recompute)
    assert sched.num_new_matched_tokens(request("r", prompt_len), local) == (0, False)
    assert sched.build_meta(step()).loads == []


def test_without_params_a_load_reads_from_the_producer_in_mooncake_json():
    sched = ConsumerScheduler(config(tp=2), BLOCK)
    claim(sched, request("r", 40), 0, [1, 2, 3])
    (load,) = sched.build_meta(step()).loads
    assert load.source.pipes == [PREFILL, "10.0.0.1:13004"] and not load.source.from_params
    assert load.source.peer(1) == "10.0.0.1:13004"


def test_a_load_reads_from_the_producer_the_verified_params_name():
    params = kv_params.producer_params(["10.9.9.9:7000"], "p", "r", SECRET.encode())
    sched = ConsumerScheduler(config(tp=2, secret=SECRET), BLOCK)
    claim(sched, request("r", 40, params), 0, [1, 2, 3])
    (load,) = sched.build_meta(step()).loads
    assert load.source.pipes == ["10.9.9.9:7000"] and load.source.from_params
    assert load.source.peer(0) is None  # another TP size: no rank-to-rank push link to take it from


def test_a_request_is_looked_up_before_it_claims_and_claims_only_what_was_found():
    """vLLM's contract: claim only KV that is available. The first ask sends a lookup and answers None (ask again);
    the claim is what the producer holds beyond the prefix cache: a prefix of the prompt claims whole blocks only."""
    sched = ConsumerScheduler(config(), BLOCK)
    req = request("r", 100)
    assert sched.num_new_matched_tokens(req, 16) == (None, False)
    assert sched.num_new_matched_tokens(req, 16) == (None, False)  # asked again: still waiting, no second lookup
    (look,) = sched.build_meta(step()).lookups
    assert look.token_ids == list(range(100)) and look.lease and look.source.pipes == [PREFILL]
    assert look.lease_seconds == sched.claim_window + sched.config.options.load_timeout + 5
    sched.answered(MooncakeWorkerMetadata([LookupAnswer("r", look.lease, 0, 70)]))
    assert sched.num_new_matched_tokens(req, 16) == (48, True)  # blocks 1-3 of the 70 tokens held: up to token 64
    sched.after_alloc(req, kv_blocks(list(range(7))), 48)
    (load,) = sched.build_meta(step()).loads
    assert (load.first_block, load.block_ids, load.num_tokens, load.lease) == (1, [1, 2, 3], 48, look.lease)


@pytest.mark.parametrize("held, error", [(0, ""), (0, "TimeoutError: no answer"), (15, "")])
def test_a_request_whose_producer_holds_nothing_it_lacks_claims_nothing(held, error):
    """Found nothing, could not tell, or less than a block beyond the prefix cache: computed here, never a load
    (under the fail policy a claimed load that misses would end the request with an error)."""
    sched = ConsumerScheduler(dataclasses.replace(config(), fail_loads=True), BLOCK)
    req = request("r", 100)
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    answer(sched, held, error=error)
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.num_new_matched_tokens(req, 0) == (0, False) and sched.build_meta(step()).lookups == []
    assert sched.build_meta(step()).loads == []


def test_every_tp_rank_must_answer_and_the_least_found_is_claimed():
    sched = ConsumerScheduler(config(tp=2), BLOCK)
    req = request("r", 100)
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    (look,) = sched.build_meta(step()).lookups
    sched.answered(MooncakeWorkerMetadata([LookupAnswer("r", look.lease, 1, 100)]))
    assert sched.num_new_matched_tokens(req, 0) == (None, False)  # rank 0 has not answered yet
    sched.answered(MooncakeWorkerMetadata([LookupAnswer("r", look.lease + 1, 0, 100)]))  # another lookup's: ignored
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    sched.answered(MooncakeWorkerMetadata([LookupAnswer("r", look.lease, 0, 40)]))
    assert sched.num_new_matched_tokens(req, 0) == (32, True)


def test_a_lookup_nobody_answers_in_time_is_computed_here(monkeypatch):
    """The engine loop never waits on the network: past lookup_timeout (plus a margin) without every answer, the
    request claims nothing; a late answer changes nothing."""
    sched = ConsumerScheduler(config(), BLOCK)
    clock = [1000.0]
    monkeypatch.setattr(scheduler_consumer.time, "monotonic", lambda: clock[0])
    req = request("r", 100)
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    (look,) = sched.build_meta(step()).lookups
    clock[0] += sched.answer_wait - 0.1
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    clock[0] += 0.2
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert [r.lease for r in sched.build_meta(step()).releases] == [look.lease]  # the producer may have held it late
    sched.answered(MooncakeWorkerMetadata([LookupAnswer("r", look.lease, 0, 100)]))
    assert sched.num_new_matched_tokens(req, 0) == (0, False)


def test_an_answer_too_old_to_claim_on_is_asked_again_under_the_same_lease(monkeypatch):
    """vLLM could not schedule the request for a while after its answer came: the lease may end before a load
    started now, so the lookup is sent again, under the same lease (the producer renews its hold on the entry it
    found: a new lease would find that entry held)."""
    sched = ConsumerScheduler(config(), BLOCK)
    clock = [1000.0]
    monkeypatch.setattr(scheduler_consumer.time, "monotonic", lambda: clock[0])
    req = request("r", 100)
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    lease = sched.to_look[0].lease
    assert answer(sched) == 1
    clock[0] += sched.claim_window + 0.1
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    (again,) = sched.build_meta(step()).lookups
    assert again.lease == lease
    sched.answered(MooncakeWorkerMetadata([LookupAnswer("r", lease, 0, 100)]))
    assert sched.num_new_matched_tokens(req, 0) == (99, True)


def test_asked_again_after_vllm_could_not_allocate_the_claim_stands_without_a_new_lookup():
    sched = ConsumerScheduler(config(), BLOCK)
    req = request("r", 100)
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    answer(sched)
    assert sched.num_new_matched_tokens(req, 0) == (99, True)
    assert sched.num_new_matched_tokens(req, 32) == (67, True)  # asked again (no room last step), more cached now
    meta = sched.build_meta(step())
    assert meta.lookups == [] and meta.releases == []


def test_a_lease_no_load_will_use_is_released():
    """Found, but the prefix cache holds it all by now; the request ended before it was scheduled; its lookup gave
    up: the producers are told (the entry is free for others at once), once per lookup."""
    sched = ConsumerScheduler(config(), BLOCK)
    covered, aborted = request("covered", 100), request("aborted", 100)
    for req in (covered, aborted):
        assert sched.num_new_matched_tokens(req, 0) == (None, False)
    leases = {look.req_id: look.lease for look in sched.to_look}
    answer(sched, held=60)
    assert sched.num_new_matched_tokens(covered, 64) == (0, False)  # 60 found, 64 cached: nothing to claim
    sched.finished(aborted)
    sched.finished(covered)  # already released: not again
    releases = sched.build_meta(step()).releases
    assert sorted(r.lease for r in releases) == sorted(leases.values())
    assert all(r.source.pipes == [PREFILL] for r in releases)
    loaded = request("loaded", 100)
    claim(sched, loaded, 0, list(range(7)))
    sched.finished(loaded)  # its load took the lease: nothing to release
    assert sched.build_meta(step()).releases == []


def test_lookups_sent_in_one_step_are_bounded():
    sched = ConsumerScheduler(config(), BLOCK)
    reqs = [request(f"r{i}", 100) for i in range(scheduler_consumer.LOOKUPS_PER_STEP + 5)]
    assert all(sched.num_new_matched_tokens(req, 0) == (None, False) for req in reqs)
    assert len(sched.build_meta(step()).lookups) == scheduler_consumer.LOOKUPS_PER_STEP
    assert all(sched.num_new_matched_tokens(req, 0) == (None, False) for req in reqs)
    assert [look.req_id for look in sched.build_meta(step()).lookups] == [req.request_id for req in reqs[-5:]]


def test_under_the_fail_policy_requests_without_params_load_what_was_found():
    """The seed's flow (no params: mooncake.json's producer) claims what its lookup found, under either policy; a
    pushed or awaited prompt is claimed at once, as before (its producer's push is on its way)."""
    sched = ConsumerScheduler(dataclasses.replace(config(mode="push", secret=SECRET), fail_loads=True), BLOCK)
    assert claim(sched, request("plain", 40), 0, [1, 2, 3]) == (39, True)
    named = kv_params.producer_params(["10.9.9.9:7000"], "p", "named", SECRET.encode())
    assert claim(sched, request("named", 40, named), 0, [4, 5, 6]) == (39, True)
    awaited = {"do_remote_prefill": True, source.AWAIT_PUSH: True}
    assert sched.num_new_matched_tokens(request("awaited", 40, awaited), 0) == (39, True)
    sched.after_alloc(request("awaited", 40, awaited), kv_blocks([7, 8, 9]), 39)
    pushed = kv_params.producer_params(["10.9.9.9:7000"], "p", "pushed", SECRET.encode(), pushed=True)
    assert sched.num_new_matched_tokens(request("pushed", 40, pushed), 0) == (39, True)
    loads = sched.build_meta(step()).loads
    assert [(load.req_id, bool(load.lease)) for load in loads] == [("plain", True), ("named", True),
                                                                  ("awaited", False)]
    assert loads[0].source.pipes == [PREFILL] and loads[1].source.pipes == ["10.9.9.9:7000"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_do_remote_prefill_false_claims_nothing(mode):
    """The proxy skipped the remote prefill (this instance holds most of the prompt): computed here, no load."""
    sched = ConsumerScheduler(config(mode=mode), BLOCK)
    req = request("r", 40, {"do_remote_prefill": False, "remote_pipe": ["10.0.0.9:1"]})
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.num_new_matched_tokens(req, 16) == (0, False)
    sched.after_alloc(req, kv_blocks([1, 2, 3]), 0)
    assert sched.build_meta(step()).loads == []
    sched.finished(req)
    assert not sched.claims and not sched.claimed


def test_an_awaited_push_is_claimed_like_any_load_in_push_mode():
    sched = ConsumerScheduler(config(mode="push", secret=SECRET), BLOCK)  # nothing to prove: no producer named
    req = request("r", 40, {"do_remote_prefill": True, "mooncake_await_push": True})
    assert claim(sched, req, 16, [1, 2, 3]) == (23, True)
    (load,) = sched.build_meta(step()).loads
    assert load.source.await_push and (load.first_block, load.block_ids, load.num_tokens) == (1, [2, 3], 23)


def test_an_awaited_push_in_pull_mode_is_computed_here_and_said_once(monkeypatch):
    said: list[str] = []
    monkeypatch.setattr(source, "_told_await_push_in_pull_mode", False)
    monkeypatch.setattr(source.logger, "info", lambda message, *args: said.append(message % args))
    sched = ConsumerScheduler(config(mode="pull"), BLOCK)
    for req_id in ("r", "s"):
        req = request(req_id, 40, {"do_remote_prefill": True, "mooncake_await_push": True})
        assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_meta(step()).loads == []
    assert len(said) == 1 and "pull mode" in said[0]


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True, "mooncake_await_push": "yes"},
    {"do_remote_prefill": True, "mooncake_await_push": True, "remote_pipe": ["10.0.0.9:1"]},
    {"do_remote_prefill": "true", "remote_pipe": ["10.0.0.9:1"]},
    {"do_remote_prefill": True, "remote_pipe": "10.0.0.9:1"},
    {"do_remote_prefill": True, "remote_pipe": ["10.0.0.9:1"] * 5000},
    {"do_remote_prefill": True, "remote_pipe": [7]},
    {"do_remote_prefill": True, "remote_pipe": ["10.0.0.9:-1"]},
    {"do_remote_prefill": True, "remote_pipe": ["10.0.0.9:1"], "remote_tp_size": -1},
    {"do_remote_prefill": True, "remote_pipe": ["10.0.0.9:1"], "remote_request_id": ["x"]},
])
def test_hostile_params_are_recomputed_once_never_loaded(params):
    sched = ConsumerScheduler(config(), BLOCK)
    req = request("r", 40, params)
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    assert sched.num_new_matched_tokens(req, 0) == (0, False)  # not asked again: no second error log
    sched.after_alloc(req, kv_blocks([1, 2, 3]), 0)
    assert sched.build_meta(step()).loads == []


def test_with_a_secret_forged_params_are_recomputed():
    params = kv_params.producer_params(["10.9.9.9:7000"], "p", "r", SECRET.encode())
    sched = ConsumerScheduler(config(secret=SECRET), BLOCK)
    forged = request("r", 40, {**params, "remote_pipe": ["6.6.6.6:1"]})
    assert sched.num_new_matched_tokens(forged, 0) == (0, False)
    unsigned = request("s", 40, {k: v for k, v in params.items() if k != kv_params.PROOF})
    assert sched.num_new_matched_tokens(unsigned, 0) == (0, False)


def test_one_load_attempt_per_request():
    sched = ConsumerScheduler(config(), BLOCK)
    req = request("r", 40)
    claim(sched, req, 0, [1, 2, 3])
    assert len(sched.build_meta(step()).loads) == 1
    assert sched.num_new_matched_tokens(req, 0) == (0, False)  # e.g. preempted after a failed load: recomputed
    sched.finished(req)
    assert claim(sched, req, 0, [1, 2, 3]) == (39, True)  # a new request reusing the id may claim again


def test_an_allocation_without_external_tokens_starts_no_load():
    sched = ConsumerScheduler(config(), BLOCK)
    req = request("r", 40)
    assert sched.num_new_matched_tokens(req, 0) == (None, False)
    answer(sched)
    assert sched.num_new_matched_tokens(req, 0) == (39, True)
    sched.after_alloc(req, kv_blocks([1, 2, 3]), 0)  # vLLM allocated without the claim (e.g. no room)
    assert sched.build_meta(step()).loads == []
    assert claim(sched, req, 0, [1, 2, 3]) == (39, True)  # and may claim at the next try (looked up afresh)


def test_loads_go_out_once_and_an_empty_step_is_idle():
    sched = ConsumerScheduler(config(), BLOCK)
    claim(sched, request("r", 40, {}), 0, [1, 2, 3])
    meta = sched.build_meta(step())
    assert meta.idle and len(meta.loads) == 1
    assert sched.build_meta(step(cached={"x": (5, 1)})).loads == []
    assert not sched.build_meta(step(cached={"x": (5, 1)})).idle


def test_a_consumer_answers_no_params():
    sched = ConsumerScheduler(config(), BLOCK)
    req = request("r", 40, {"do_remote_decode": True})
    claim(sched, req, 0, [1, 2, 3])
    assert sched.finished(req) is None and not sched.claims and not sched.claimed and not sched.lookups


# ---------------------------------------------------------------- producer
def test_a_producer_claims_nothing_and_saves_the_prompt_in_the_step_that_completes_it():
    sched = ProducerScheduler(config("kv_producer"), BLOCK)
    req = request("r", 40, {"do_remote_decode": True})
    assert sched.num_new_matched_tokens(req, 0) == (0, False)
    sched.after_alloc(req, kv_blocks([]), 0)
    ids = {"r": [7, 8, 9, 10]}  # one block more than the prompt's three (room for the decode)
    first = sched.build_meta(step(new={"r": (0, 32)}, block_ids=ids))  # chunked prefill: 32 of 40 tokens
    assert first.saves == [] and first.pushes == []
    second = sched.build_meta(step(cached={"r": (32, 8)}, block_ids=ids))
    (save,) = second.saves
    assert (save.req_id, save.token_ids, save.block_ids) == ("r", list(range(40)), [7, 8, 9])
    assert sched.build_meta(step(cached={"r": (40, 1)}, block_ids=ids)).saves == []  # decoding: nothing more


def test_a_prefix_cache_hit_on_the_producer_still_saves_the_whole_prompt():
    sched = ProducerScheduler(config("kv_producer"), BLOCK)
    sched.after_alloc(request("r", 40), kv_blocks([]), 0)
    (save,) = sched.build_meta(step(new={"r": (32, 8)}, block_ids={"r": [1, 2, 3]})).saves
    assert save.block_ids == [1, 2, 3]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_request_served_whole_on_the_producer_is_neither_saved_nor_pushed(mode):
    sched = ProducerScheduler(config("kv_producer", mode=mode), BLOCK)
    whole = request("w", 40, {"do_remote_prefill": False, "do_remote_decode": False})
    kept = request("k", 40, {"do_remote_decode": True})
    for req in (whole, kept):
        sched.after_alloc(req, kv_blocks([]), 0)
    meta = sched.build_meta(step(new={"w": (0, 40), "k": (0, 40)}, block_ids={"w": [1, 2, 3], "k": [4, 5, 6]}))
    assert [s.req_id for s in meta.saves] == ["k"]
    assert [p.req_id for p in meta.pushes] == (["k"] if mode == "push" else [])
    assert sched.finished(whole) == (False, None) and sched.finished(kept)[1] is not None


def test_requests_the_producer_never_allocated_are_not_saved():
    sched = ProducerScheduler(config("kv_producer"), BLOCK)
    assert sched.build_meta(step(new={"x": (0, 40)}, block_ids={"x": [1, 2, 3]})).saves == []


def test_a_finished_request_that_asked_for_remote_decode_says_where_its_kv_waits():
    sched = ProducerScheduler(config("kv_producer", tp=2, secret=SECRET), BLOCK)
    wants, plain = request("r", 40, {"do_remote_decode": True}), request("s", 40)
    for req in (wants, plain):
        sched.after_alloc(req, kv_blocks([]), 0)
    sched.build_meta(step(new={"r": (0, 40), "s": (0, 40)}, block_ids={"r": [1, 2, 3], "s": [4, 5, 6]}))
    held, answer = sched.finished(wants)
    assert not held  # a host cache: its save's copy ended within the step
    assert answer == kv_params.producer_params([PREFILL, "10.0.0.1:13004"], "engine-1", "r", SECRET.encode())
    assert kv_params.decode_params(answer, SECRET.encode()).pipes == [PREFILL, "10.0.0.1:13004"]
    assert sched.finished(plain) == (False, None)
    assert sched.finished(wants) == (False, None)  # forgotten


def test_a_request_aborted_before_its_prompt_completed_gets_no_params():
    sched = ProducerScheduler(config("kv_producer"), BLOCK)
    req = request("r", 40, {"do_remote_decode": True})
    sched.after_alloc(req, kv_blocks([]), 0)
    sched.build_meta(step(new={"r": (0, 16)}, block_ids={"r": [1, 2, 3]}))
    assert sched.finished(req) == (False, None) and not sched.prompts


def test_push_mode_announces_every_prefill_step_and_the_target_once():
    sched = ProducerScheduler(config("kv_producer", mode="push"), BLOCK)
    sched.after_alloc(request("r", 40, {"mooncake_push_to": [DECODE]}), kv_blocks([]), 0)
    ids = {"r": [1, 2, 3, 4]}
    (first,) = sched.build_meta(step(new={"r": (0, 20)}, block_ids=ids)).pushes
    assert (first.block_ids, first.end, first.prompt_len, first.push_to) == ([1, 2, 3], 20, 40, [DECODE])
    assert first.token_ids == list(range(40))
    meta = sched.build_meta(step(cached={"r": (20, 30)}, block_ids=ids))  # scheduled past the prompt: capped
    (last,) = meta.pushes
    assert (last.end, last.token_ids, last.push_to) == (40, None, None) and len(meta.saves) == 1
    assert sched.build_meta(step(cached={"r": (50, 1)}, block_ids=ids)).pushes == []


def test_a_request_that_ends_mid_prefill_is_abandoned_once_in_the_next_step():
    """Aborted after its first pushed chunk: the next step tells the worker (its push ends there); a request whose
    prompt completed, or that never pushed, is not abandoned."""
    sched = ProducerScheduler(config("kv_producer", mode="push"), BLOCK)
    for name in ("cut", "done", "idle"):
        sched.after_alloc(request(name, 40, None), kv_blocks([]), 0)
    sched.build_meta(step(new={"cut": (0, 20), "done": (0, 40)}, block_ids={"cut": [1, 2, 3], "done": [4, 5, 6]}))
    for name in ("cut", "done", "idle"):
        sched.finished(request(name, 40, None))
    assert sched.build_meta(step()).abandoned == ["cut"]
    assert sched.build_meta(step()).abandoned == []


@pytest.mark.parametrize("params, push_to", [
    (None, None),  # mooncake.json's consumer
    ({"mooncake_push_to": []}, []),  # the proxy asks for pull
    ({"mooncake_push_to": [DECODE, DECODE]}, []),  # another TP size: kept for pull
    ({"mooncake_push_to": "10.0.0.2:1"}, []),
    ({"mooncake_push_to": [None]}, []),
    ({"mooncake_push_to": ["10.0.0.2:1"] * 2000}, []),
])
def test_push_targets_from_params_and_hostile_ones_fall_back_to_pull(params, push_to):
    sched = ProducerScheduler(config("kv_producer", mode="push"), BLOCK)
    sched.after_alloc(request("r", 40, params), kv_blocks([]), 0)
    (first,) = sched.build_meta(step(new={"r": (0, 40)}, block_ids={"r": [1, 2, 3]})).pushes
    assert first.push_to == push_to


def test_with_a_secret_an_unproven_push_target_is_not_pushed_to():
    sched = ProducerScheduler(config("kv_producer", mode="push", secret=SECRET), BLOCK)
    proof = kv_params.push_proof(SECRET.encode(), [DECODE])
    sched.after_alloc(request("ok", 40, {"mooncake_push_to": [DECODE], "mooncake_push_proof": proof}), kv_blocks([]), 0)
    sched.after_alloc(request("bad", 40, {"mooncake_push_to": ["6.6.6.6:1"], "mooncake_push_proof": proof}),
                      kv_blocks([]), 0)
    meta = sched.build_meta(step(new={"ok": (0, 40), "bad": (0, 40)}, block_ids={"ok": [1, 2, 3], "bad": [4, 5, 6]}))
    assert {p.req_id: p.push_to for p in meta.pushes} == {"ok": [DECODE], "bad": []}


def test_pull_mode_announces_no_pushes():
    sched = ProducerScheduler(config("kv_producer"), BLOCK)
    sched.after_alloc(request("r", 40, {"mooncake_push_to": [DECODE]}), kv_blocks([]), 0)
    meta = sched.build_meta(step(new={"r": (0, 40)}, block_ids={"r": [1, 2, 3]}))
    assert meta.pushes == [] and len(meta.saves) == 1


@pytest.mark.parametrize("mode, params, pushed", [
    ("pull", {"do_remote_decode": True}, False),
    ("push", {"do_remote_decode": True}, True),  # mooncake.json's consumer
    ("push", {"do_remote_decode": True, "mooncake_push_to": [DECODE]}, True),
    ("push", {"do_remote_decode": True, "mooncake_push_to": []}, False),  # kept for pull: nothing comes
])
def test_a_pushed_prompts_answer_tells_the_consumer_to_wait_for_the_push(mode, params, pushed):
    """A push-mode producer says so in its answer (``mooncake_pushed``): the consumer waits for the push (or the
    notice to pull) from it instead of pulling while the BEGIN is still on its way."""
    sched = ProducerScheduler(config("kv_producer", mode=mode), BLOCK)
    req = request("r", 40, params)
    sched.after_alloc(req, kv_blocks([]), 0)
    sched.build_meta(step(new={"r": (0, 40)}, block_ids={"r": [1, 2, 3]}))
    _, answer = sched.finished(req)
    assert answer.get("mooncake_pushed", False) is pushed
    assert kv_params.decode_params(answer).pushed is pushed


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_held_requests_are_the_ones_whose_blocks_were_copied_from_told_once_in_the_next_step(mode):
    """``hold`` (a GPU cache): a finished request whose prompt was saved, or whose push began, keeps its blocks until
    the workers report it (they learn of it in the next step's ``held``); one that never reached a save or a push,
    or that is served here whole, is freed at once. Preempted requests are told as they happen."""
    sched = ProducerScheduler(config("kv_producer", mode=mode), BLOCK, hold=True)
    names = ("saved", "cut", "queued")
    for name in names:
        sched.after_alloc(request(name, 40, {"do_remote_decode": True}), kv_blocks([]), 0)
    whole = request("whole", 40, {"do_remote_decode": False})
    sched.after_alloc(whole, kv_blocks([]), 0)
    sched.build_meta(step(new={"saved": (0, 40), "cut": (0, 20), "whole": (0, 40)},
                          block_ids={"saved": [1, 2, 3], "cut": [4, 5, 6], "whole": [7, 8, 9]}))
    answers = {name: sched.finished(request(name, 40, {"do_remote_decode": True})) for name in names}
    assert answers["saved"][0] is True and answers["saved"][1] is not None  # held, and its params
    assert answers["cut"][0] is (mode == "push")  # its push began (pull: nothing was copied yet)
    assert answers["queued"] == (False, None)
    assert sched.finished(whole) == (False, None)
    out = step()
    out.preempted_req_ids = {"other"}
    meta = sched.build_meta(out)
    assert meta.held == ["saved", "cut"][:1 + (mode == "push")] and meta.preempted == ["other"]
    assert sched.build_meta(step()).held == []
