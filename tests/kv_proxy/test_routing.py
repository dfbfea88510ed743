"""kv_proxy/routing.py, kv_proxy/prefix_index.py and Balancer.pick's prefix rule: the longest cached prefix wins unless its
instance is overloaded (--balance-slack); failed, restarted and flooded indexes; the prefill skipped when the
decode instance holds (nearly) the whole prompt (--skip-prefill-below). Real HTTP through the proxy."""

from __future__ import annotations

import asyncio

import pytest

from kv_proxy.balancer import BALANCE
from kv_proxy.prefix_index import (
    CHUNK_CHARS,
    MAX_CHUNKS,
    CharsPerToken,
    PrefixIndex,
    cache_info,
    fingerprint,
)
from kv_proxy.protocols import NO_LOAD
from tests.kv_proxy.upstreams import (
    CHAT,
    COMPLETION,
    Environment,
    FakeUpstream,
    assert_idle,
    proxy_metric,
    read_sse,
    run,
    settle,
    text_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def cache_metrics(blocks: int, block_size: int, started: float) -> str:
    """A vLLM /metrics text with its cache config and process start time."""
    return ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",enable_prefix_caching="True",'
            f'num_gpu_blocks="{blocks}",engine="0"}} 1.0\n'
            "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {started}\n")


async def complete(env: Environment, prompt: str, **extra: object) -> str:
    """POST a completion; the decode instance that served it."""
    status, _, body = await env.post("/v1/completions", {**COMPLETION, "prompt": prompt, **extra})
    assert status == 200, body
    return body["served_by"]


def prefilled_by(env: Environment, prompt: str) -> list[str]:
    return [u.name for u in env.prefill for r in u.completions() if r.body.get("prompt") == prompt]


def test_longest_prefix_wins_for_prefill_and_decode() -> None:
    """Two families of prompts, each sharing an 8-chunk prefix: every follow-up goes to the decode and the prefill
    instance that got its family first, where round robin would spread them."""
    shared, other = text_of(1, 8 * CHUNK_CHARS), text_of(2, 8 * CHUNK_CHARS)

    async def test(env: Environment) -> None:
        first = await complete(env, shared + " question 0")
        second = await complete(env, other + " question 0")
        assert first != second
        for i in range(1, 5):
            assert await complete(env, shared + f" question {i}") == first
            assert await complete(env, other + f" question {i}") == second
        for family in (shared, other):
            assert len({name for i in range(5) for name in prefilled_by(env, family + f" question {i}")}) == 1
        assert await proxy_metric(env, "mooncake_proxy_routed_total", role="decode", rule="prefix") == 8
        assert await proxy_metric(env, "mooncake_proxy_routed_total", role="decode", rule="balance") == 2
        assert await proxy_metric(env, "mooncake_proxy_routed_total", role="prefill", rule="prefix") == 8
        cached = await proxy_metric(env, "mooncake_proxy_cached_prefix_tokens_total", role="decode")
        assert cached == pytest.approx(8 * 8 * CHUNK_CHARS / 3.0)  # 8 chunks each, 3 characters per token (default)
        await assert_idle(env)

    run(test, 2, 3)


def test_a_chat_follow_up_goes_where_its_conversation_is() -> None:
    def conversation(seed: int, turns: int) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": text_of(seed, 6 * CHUNK_CHARS)}]
        for turn in range(turns):
            messages += [{"role": "user", "content": f"question {turn}"}, {"role": "assistant", "content": "ok"}]
        return messages + [{"role": "user", "content": "and now?"}]

    async def chat(env: Environment, messages: list[dict[str, str]]) -> str:
        status, _, body = await env.post("/v1/chat/completions", {**CHAT, "messages": messages})
        assert status == 200, body
        return body["served_by"]

    async def test(env: Environment) -> None:
        first, second = await chat(env, conversation(3, 0)), await chat(env, conversation(4, 0))
        assert first != second
        for turns in (1, 2, 3):
            assert await chat(env, conversation(3, turns)) == first
            assert await chat(env, conversation(4, turns)) == second

    run(test, 1, 2)


def test_an_overloaded_instance_loses_its_prefix_preference() -> None:
    """--balance-slack 1: the instance holding the prefix keeps getting it while it has at most one request more
    than the least loaded one; beyond that the request goes elsewhere (counted as passed over)."""
    shared = text_of(5, 8 * CHUNK_CHARS)

    async def test(env: Environment) -> None:
        holder = await complete(env, shared + " a")
        busy = next(d for d in env.decode if d.name == holder)
        busy.hold_last = hold = asyncio.Event()
        streams = []
        for suffix in (" b", " c"):  # 0 vs 0, then 1 vs 0: within the slack, the prefix wins
            stream = await env.client.post(env.url + "/v1/completions",
                                           json={**COMPLETION, "prompt": shared + suffix, "stream": True})
            await stream.content.readuntil(b"\n\n")
            streams.append(stream)
        assert len(busy.completions()) == 3
        elsewhere = await complete(env, shared + " d")  # 2 vs 0: overloaded
        assert elsewhere != holder
        assert await proxy_metric(env, "mooncake_proxy_prefix_passed_over_total", role="decode") == 1
        hold.set()
        for stream in streams:
            assert (await read_sse(stream))[-1] == "[DONE]"
            stream.release()
        await assert_idle(env)

    run(test, 1, 2, balance_slack=1)


def test_a_failed_instance_is_forgotten() -> None:
    """An instance that fails loses its index: once back, it is not preferred for what it held before."""
    shared = text_of(6, 8 * CHUNK_CHARS)

    async def test(env: Environment) -> None:
        decode0 = env.proxy.proxy.decode_balancer.upstreams[0]
        assert await complete(env, shared + " 1") == "D0"
        port = env.decode[0].port
        await env.decode[0].stop()
        assert await complete(env, shared + " 2") == "D1"  # D0 chosen for its prefix, refused: retried on D1
        assert decode0.failures == 1 and len(decode0.prefix) == 0
        revived = await FakeUpstream("D0-revived", env.journal).start(port)
        try:
            await wait_until(lambda: not decode0.cooling_down())
            for i in range(3):  # had D0 kept its index, the tie with D1 would alternate between them
                assert await complete(env, shared + f" {3 + i}") == "D1"
            assert not revived.completions()
        finally:
            await revived.stop()

    run(test, 1, 2, cooldown=0.3)


def test_a_restarted_instance_is_forgotten_and_its_cache_size_bounds_its_index() -> None:
    shared = text_of(7, 8 * CHUNK_CHARS)

    async def test(env: Environment) -> None:
        proxy = env.proxy.proxy
        decode0 = proxy.decode_balancer.upstreams[0]
        env.decode[0].metrics_text = cache_metrics(100, 16, 1000.0)
        await complete(env, shared)
        await settle(proxy)
        assert decode0.cache.tokens == 1600 and decode0.prefix.capacity == 1600 // 64
        hint = fingerprint({**COMPLETION, "prompt": shared}, False)
        assert hint is not None and decode0.prefix.match(hint.chunks) == 8
        env.decode[0].metrics_text = cache_metrics(100, 16, 2000.0)  # a new process
        decode0.ask_again()  # as after DISCOVERY_TTL
        await complete(env, text_of(8, 300))
        await settle(proxy)
        assert decode0.prefix.match(hint.chunks) == 0

    run(test)


def test_the_index_stays_bounded_under_a_flood_of_unique_prompts() -> None:
    """--prefix-index-entries 60 over three instances: 20 chunks each at most; the prefill instance's KV cache holds
    128 tokens (its /metrics, read by the router alone): 2 chunks. 120 unique prompts of 10 chunks each go through;
    the last one is still indexed."""

    async def test(env: Environment) -> None:
        proxy = env.proxy.proxy
        env.prefill[0].metrics_text = cache_metrics(8, 16, 1.0)
        await complete(env, "warm up")
        await settle(proxy)
        upstreams = proxy.prefill_balancer.upstreams + proxy.decode_balancer.upstreams
        assert [u.prefix.capacity for u in upstreams] == [2, 20, 20]
        prompts = [text_of(1000 + i, 10 * CHUNK_CHARS) for i in range(120)]
        for batch in range(0, len(prompts), 20):
            await asyncio.gather(*(complete(env, p) for p in prompts[batch:batch + 20]))
            assert all(len(u.prefix) <= u.prefix.capacity for u in upstreams)
        assert [len(u.prefix) for u in upstreams] == [2, 20, 20]
        assert await proxy_metric(env, "mooncake_proxy_prefix_index_entries", role="prefill") == 2
        assert await proxy_metric(env, "mooncake_proxy_prefix_index_entries", role="decode") == 40
        last = fingerprint({**COMPLETION, "prompt": prompts[-1]}, False)
        assert last is not None and max(u.prefix.match(last.chunks) for u in upstreams[1:]) == 10

    run(test, 1, 2, prefix_index_entries=60)


def test_fingerprints_indexes_and_calibration() -> None:
    turn = {"model": "m", "messages": [{"role": "user", "content": text_of(1, 3 * CHUNK_CHARS)}]}
    follow = {"model": "m", "messages": [*turn["messages"], {"role": "assistant", "content": text_of(2, 600)},
                                         {"role": "user", "content": "more"}]}
    one, two = fingerprint(turn, True), fingerprint(follow, True)
    assert one is not None and two is not None and two.chunks[:len(one.chunks)] == one.chunks
    assert len(two.chunks) > len(one.chunks) and not two.tokens and two.chat
    other_model = fingerprint({**turn, "model": "n"}, True)
    assert other_model is not None and not set(other_model.chunks) & set(one.chunks)
    tokens = fingerprint({"prompt": list(range(1000))}, False)
    assert tokens is not None and tokens.tokens and tokens.size == 1000 and len(tokens.chunks) == 1000 // 64
    huge = fingerprint({"prompt": "x" * (MAX_CHUNKS + 100) * CHUNK_CHARS}, False)
    assert huge is not None and len(huge.chunks) == MAX_CHUNKS
    assert fingerprint({"prompt_embeds": "abc"}, False) is None

    index = PrefixIndex(3)
    index.add((b"a", b"b", b"c", b"d"))
    assert len(index) == 3 and index.match((b"a", b"b", b"c", b"d")) == 3
    index.add((b"x", b"y"))  # evicts the least recent: the first request's tail
    assert len(index) == 3 and index.match((b"a", b"b")) == 1 and index.match((b"x", b"y")) == 2
    index.resize(1)
    assert index.match((b"x",)) == 1 and len(index) == 1
    pending = PrefixIndex(8)
    pending.add((b"a", b"b", b"c"))
    assert pending.match((b"a", b"b", b"c")) == 3 and pending.match((b"a", b"b", b"c"), confirmed=True) == 0
    pending.confirm((b"a", b"b", b"z"))  # what was not routed there is not made up
    pending.add((b"a", b"b", b"c", b"d"))  # routed again: what was answered stays answered
    assert pending.match((b"a", b"b", b"c", b"d"), confirmed=True) == 2 and len(pending) == 4

    ratio = CharsPerToken()
    for garbage in (True, "12", 0, -5, None):
        ratio.observe(100, garbage)
    assert ratio.value == 3.0 and ratio.samples == 0
    ratio.observe(4000, 1000)
    assert ratio.value == 4.0
    ratio.observe(10**9, 1)  # clamped
    assert 4.0 < ratio.value <= 8.0

    info = cache_info(cache_metrics(10, 16, 5.0) + "garbage{ 1\n")
    assert (info.tokens, info.started) == (160, 5.0)
    assert cache_info(cache_metrics(10, 16, 5.0).replace('num_gpu_blocks="10"', 'num_gpu_blocks="None"')).tokens is None


def test_the_prefill_is_skipped_when_little_of_the_prompt_is_uncached() -> None:
    """--skip-prefill-below 500: a short prompt, and a long one the decode instance already holds, go straight to
    the decode instance with params that ask it to load nothing; the prefill instance never sees them."""
    long = text_of(9, 6000)

    async def test(env: Environment) -> None:
        await complete(env, COMPLETION["prompt"])
        assert not env.prefill[0].completions()
        assert env.decode[0].received[-1].body["kv_transfer_params"] == NO_LOAD
        await complete(env, long)  # ~2000 tokens, none cached
        assert len(env.prefill[0].completions()) == 1
        assert env.decode[0].received[-1].body.get("kv_transfer_params") != NO_LOAD
        await complete(env, long + " and a little more")  # all but its last partial chunk cached
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and body.endswith("data: [DONE]\n\n")
        assert len(env.prefill[0].completions()) == 1
        assert [r.body.get("kv_transfer_params") == NO_LOAD for r in env.decode[0].completions()] == \
            [True, False, True, True]
        assert env.decode[0].received[-1].body["stream"] is True
        assert await proxy_metric(env, "mooncake_proxy_prefill_skipped_total") == 3
        assert await proxy_metric(env, "mooncake_proxy_routed_total", role="prefill", rule=BALANCE) == 1
        await assert_idle(env)

    run(test, skip_prefill_below=500)


def test_token_estimates_are_calibrated_from_the_prefill_usage() -> None:
    """3000 characters are ~1000 tokens by default (not skipped below 500); once the prefill answers say 8 characters
    per token, an unrelated prompt of 3000 characters is ~375 tokens: skipped."""

    async def test(env: Environment) -> None:
        env.prefill[0].chars_per_token = 8.0
        await complete(env, text_of(10, 3000))
        assert len(env.prefill[0].completions()) == 1
        await complete(env, text_of(11, 3000))
        assert len(env.prefill[0].completions()) == 1
        assert env.decode[0].received[-1].body["kv_transfer_params"] == NO_LOAD

    run(test, skip_prefill_below=500)


def test_a_prefix_counts_for_skipping_only_once_the_decode_instance_answered_it() -> None:
    """A follow-up sent while the first request of its prefix is still being decoded goes through a remote prefill
    (the decode instance may still be loading that prefix: skipping would make it compute the whole prompt); the
    same follow-up after the answer came through is skipped. Streamed answers count once complete."""
    long = text_of(12, 6000)

    async def test(env: Environment) -> None:
        env.decode[0].hold_last = asyncio.Event()
        first = asyncio.ensure_future(env.post("/v1/completions", {**COMPLETION, "prompt": long, "stream": True}))
        await wait_until(lambda: len(env.decode[0].completions()) == 1)
        await complete(env, long + " more")
        assert len(env.prefill[0].completions()) == 2  # not skipped: the first answer is still streaming
        env.decode[0].hold_last.set()
        status, _, body = await first
        assert status == 200 and body.endswith("data: [DONE]\n\n")
        await complete(env, long + " again")
        assert len(env.prefill[0].completions()) == 2
        assert env.decode[0].received[-1].body["kv_transfer_params"] == NO_LOAD
        assert await proxy_metric(env, "mooncake_proxy_prefill_skipped_total") == 1
        await assert_idle(env)

    run(test, skip_prefill_below=500)


def test_before_calibration_a_character_counts_as_a_token() -> None:
    """Until a prefill answer says how many tokens a prompt had, the proxy cannot know: a prompt of 900 characters
    could be 900 tokens (text of rare tokens), so it is not skipped below 500, though 3 characters per token (the
    default estimate) would make it 300 tokens. One of 400 characters is skipped."""

    async def test(env: Environment) -> None:
        await complete(env, text_of(13, 900))
        assert len(env.prefill[0].completions()) == 1
        await complete(env, text_of(14, 400))
        assert len(env.prefill[0].completions()) == 1
        assert env.decode[0].received[-1].body["kv_transfer_params"] == NO_LOAD

    run(test, skip_prefill_below=500)


def test_a_prompt_is_sized_with_the_fewest_characters_per_token_seen_lately() -> None:
    """Prefill answers said 8 characters per token, then 2 (text of rare tokens varies that much from prompt to
    prompt): their mean (5) would make 1500 characters ~300 tokens, skipped below 500; the lowest ratio seen makes
    them ~750 tokens: prefilled remotely."""

    async def test(env: Environment) -> None:
        env.prefill[0].chars_per_token = 8.0
        await complete(env, text_of(15, 3000))
        env.prefill[0].chars_per_token = 2.0
        await complete(env, text_of(16, 6000))  # ~750 tokens at 8 characters per token: prefilled
        await complete(env, text_of(17, 1500))
        assert len(env.prefill[0].completions()) == 3
        assert await proxy_metric(env, "mooncake_proxy_prefill_skipped_total") == 0

    run(test, skip_prefill_below=500)


def test_the_estimate_learns_what_work_costs_and_skips_by_load() -> None:
    """--routing estimate, both instances computing a prompt in 0.1 ms a character, one at a time, and taking 20 ms
    for anything else (a load, for D). The first three streamed requests are prefilled remotely (reason
    not_learned) and teach the proxy what a prefill on P and a load into D cost (on its /metrics: a prefill's time
    per token, a load's flat 20 ms). Then, D idle, a new prompt is computed on D whole (faster_locally: one prefill
    instead of a prefill and a load); while six requests are decoding on D, the same kind of prompt is prefilled
    remotely (faster_remotely: a local prefill would stall them). Nothing is left queued at the end."""

    async def stream(env: Environment, prompt: str) -> None:
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "prompt": prompt, "stream": True})
        assert status == 200 and body.endswith("data: [DONE]\n\n")

    async def decisions(env: Environment, choice: str, reason: str) -> float:
        return await proxy_metric(env, "mooncake_proxy_route_decisions_total", choice=choice, reason=reason)

    async def test(env: Environment) -> None:
        for upstream in (env.prefill[0], env.decode[0]):
            upstream.compute_per_char, upstream.delay = 1e-4, 0.02
        env.prefill[0].kv_params = {"do_remote_prefill": True, "do_remote_decode": False}
        for seed, chars in ((20, 600), (21, 1200), (22, 2400)):
            await stream(env, text_of(seed, chars))
        assert await decisions(env, "remote", "not_learned") == 3
        async def learned(role: str, cost: str) -> float:
            return await proxy_metric(env, "mooncake_proxy_estimated_cost_seconds", role=role, instance="0", cost=cost)

        prefill_per_token = await learned("prefill", "prefill_per_token")
        assert prefill_per_token > 0  # a prefill's time grows with its prompt here
        # a load's does not (20 ms, plus HTTP): its line is flat but for noise, which on a loaded machine can tilt a
        # line fitted to three samples (even through the origin), so the load of a 1200-token prompt is checked
        base, per_token = await learned("decode", "load_base"), await learned("decode", "load_per_token")
        assert 0.015 < base + per_token * 1200 < 0.5 and per_token < prefill_per_token / 2, (base, per_token)
        await stream(env, text_of(23, 1200))
        assert env.decode[0].received[-1].body["kv_transfer_params"] == NO_LOAD
        assert len(env.prefill[0].completions()) == 3
        assert await decisions(env, "local", "faster_locally") == 1
        env.decode[0].hold_last = asyncio.Event()
        held = [asyncio.ensure_future(stream(env, text_of(30 + i, 1200))) for i in range(6)]
        decode = env.proxy.proxy.decode_balancer.upstreams[0]
        await wait_until(lambda: decode.work.running == 6)
        await complete(env, text_of(40, 1200))
        assert env.decode[0].received[-1].body["kv_transfer_params"] != NO_LOAD
        assert env.prefill[0].completions()[-1].body["prompt"] == text_of(40, 1200)
        assert await decisions(env, "remote", "faster_remotely") >= 1
        env.decode[0].hold_last.set()
        await asyncio.gather(*held)
        await assert_idle(env)

    run(test, routing="estimate")


def test_with_decode_on_prefill_a_saturated_decode_instance_hands_whole_requests_to_the_prefill_instance() -> None:
    """--routing estimate --decode-on-prefill. The proxy has learned that a prefill on P and a load into D are cheap
    and that D decodes at 90 ms a step (its core saturated) while P decoded at 30 ms: the next request is served
    whole on P - the client's own request (max_tokens, stream) with params that keep nothing for a consumer - and
    its answer is relayed; D gets nothing. When P fails to connect, the request falls back to D whole. Both end
    with nothing queued. Without --decode-on-prefill the same state never sends a request to P whole."""
    from kv_proxy.estimate import MIN_SAMPLES, LinearFit

    def teach(env: Environment) -> None:
        p, d = env.proxy.proxy.prefill_balancer.upstreams[0], env.proxy.proxy.decode_balancer.upstreams[0]
        for upstream, step in ((p, 0.03), (d, 0.09)):
            upstream.costs.prefill, upstream.costs.load = LinearFit(), LinearFit()
            for n in (100, 400, 800, 1600):
                upstream.costs.prefill.observe(n, 0.02 + 0.001 * n)
                upstream.costs.load.observe(n, 0.01 + 0.0001 * n)
            upstream.costs.steps, upstream.costs.step = MIN_SAMPLES, step
        d.work.running = 6  # as if six requests were decoding there (a local prefill would stall them)

    async def served_whole_on_p(env: Environment) -> None:
        teach(env)
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "prompt": text_of(50, 1200),
                                                             "stream": True})
        assert status == 200 and body.endswith("data: [DONE]\n\n") and '"served_by": "P0"' in body
        sent = env.prefill[0].completions()[-1].body
        assert sent["kv_transfer_params"] == NO_LOAD and sent["max_tokens"] == COMPLETION["max_tokens"]
        assert sent["stream"] is True and env.decode[0].completions() == []
        assert await proxy_metric(env, "mooncake_proxy_route_decisions_total", choice="on_prefill",
                                  reason="faster_on_prefill") == 1
        env.proxy.proxy.decode_balancer.upstreams[0].work.running = 0
        await assert_idle(env)
        # P refuses connections now: the request is computed whole on D instead
        teach(env)
        await env.prefill[0].stop()
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "prompt": text_of(51, 1200)})
        assert status == 200 and body["served_by"] == "D0", body
        assert env.decode[0].completions()[-1].body["kv_transfer_params"] == NO_LOAD
        env.proxy.proxy.decode_balancer.upstreams[0].work.running = 0
        await assert_idle(env)

    run(served_whole_on_p, routing="estimate", decode_on_prefill=True)

    async def never_whole_on_p(env: Environment) -> None:
        teach(env)
        status, _, _ = await env.post("/v1/completions", {**COMPLETION, "prompt": text_of(50, 1200), "stream": True})
        assert status == 200 and len(env.decode[0].completions()) == 1
        assert all(c.body["max_tokens"] == 1 for c in env.prefill[0].completions())

    run(never_whole_on_p, routing="estimate")
