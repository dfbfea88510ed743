"""The proxy and the KV pool (issue #49 item 6): each instance's pool learned from its /metrics, one prefix index per
pool fed by its members' answers, ``--pool-tail`` (a pool member computes a short uncached tail itself, reason
``pooled``), and the pool-only params on every decode a pool member gets without a remote prefill. Real HTTP through
the proxy to fake upstreams (what they received is asserted), and the router without HTTP for the estimate and the
indexes' bookkeeping."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kv_connector.param_keys import DO_REMOTE_PREFILL, POOL_ONLY
from kv_proxy.balancer import Balancer, Choice, Upstream
from kv_proxy.config import DECODE, PREFILL, ProxyConfig
from kv_proxy.discovery import Discovery, InstanceInfo, instance_info, kv_pool, push_target
from kv_proxy.estimate import LOCAL, MIN_SAMPLES, REMOTE, Costs, LinearFit
from kv_proxy.prefix_index import CHUNK_CHARS, CacheInfo, Fingerprint, fingerprint
from kv_proxy.protocols import NO_LOAD, POOL_ONLY_LOAD, loads_kv, pool_only
from kv_proxy.routed import Routed
from kv_proxy.routing import Router
from tests.kv_proxy.upstreams import (
    COMPLETION,
    Environment,
    assert_idle,
    endpoint_info,
    proxy_metric,
    run,
    settle,
    text_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

POOL = "10.0.0.9:50051"  # the pool's master, as the instances' endpoint info names it
OTHER_POOL = "10.0.0.10:50051"
MEMBER_METRICS = endpoint_info("pull", "10.0.0.5:17100", pool=POOL)
# a prompt of 24 whole chunks and 40 characters: before any calibration a character counts as a token, so a request
# extending it by a few characters has ~50 tokens uncached where its 24 chunks are held: below --pool-tail 128
FAMILY = text_of(70, 24 * CHUNK_CHARS + 40)


# ---------------------------------------------------------------- discovery
def test_the_pool_is_read_off_the_endpoint_info() -> None:
    assert kv_pool(MEMBER_METRICS) == POOL and instance_info(MEMBER_METRICS).pool == POOL
    assert push_target(endpoint_info("push", "10.0.0.5:17100", pool=POOL)) == (["10.0.0.5:17100"], "")
    for none in (endpoint_info("pull", "10.0.0.5:17100", pool=""), endpoint_info("pull", "10.0.0.5:17100"), "",
                 endpoint_info("pull", "x", pool="h:1" * 100)):  # empty, absent (before pools), no gauge, absurd
        assert instance_info(none).pool == ""


# ---------------------------------------------------------------- through the proxy
async def complete(env: Environment, prompt: str) -> dict[str, object]:
    status, _, body = await env.post("/v1/completions", {**COMPLETION, "prompt": prompt})
    assert status == 200, body
    return body


def prefills_of(env: Environment, prompt: str) -> int:
    return sum(r.body.get("prompt") == prompt for r in env.prefill[0].completions())


def params_of(env: Environment, decode: int, prompt: str) -> Any:
    """The kv_transfer_params decode instance ``decode`` last received with ``prompt``."""
    return [r.body.get("kv_transfer_params") for r in env.decode[decode].completions() if r.body["prompt"] == prompt][-1]


async def decisions(env: Environment, choice: str, reason: str) -> float:
    return await proxy_metric(env, "mooncake_proxy_route_decisions_total", choice=choice, reason=reason)


async def pool_history(env: Environment, d1_pool: str, p0_pool: str = POOL) -> None:
    """D0 shares the pool; P0 and D1 share it too unless ``p0_pool`` / ``d1_pool`` is "". Two short requests make
    the proxy read every instance's /metrics; FAMILY is prefilled on P0 and decoded on D0 (the pool holds it once
    either member answered it). While D0 is busy with a follow-up (--balance-slack 0), another follow-up goes to D1,
    which has never seen the family."""
    env.prefill[0].metrics_text = endpoint_info("pull", "10.0.0.4:17000", role="kv_producer", pool=p0_pool)
    env.decode[0].metrics_text = MEMBER_METRICS
    env.decode[1].metrics_text = endpoint_info("pull", "10.0.0.6:17100", pool=d1_pool)
    proxy = env.proxy.proxy
    await complete(env, text_of(71, 100))  # D0 (round robin), D1: not known as members yet, prefilled remotely
    await complete(env, text_of(72, 100))
    await settle(proxy)
    assert [u.pool for u in proxy.prefill_balancer.upstreams + proxy.decode_balancer.upstreams] == \
        [p0_pool, POOL, d1_pool]
    assert len(env.prefill[0].completions()) == 2 and all(len(d.completions()) == 1 for d in env.decode)
    assert (await complete(env, FAMILY))["served_by"] == "D0"  # nobody holds it: round robin, prefilled remotely
    assert prefills_of(env, FAMILY) == 1 and loads_kv(params_of(env, 0, FAMILY))
    env.decode[0].hold_last = hold = asyncio.Event()
    held = asyncio.ensure_future(env.post("/v1/completions", {**COMPLETION, "prompt": FAMILY + " held",
                                                               "stream": True}))
    await wait_until(lambda: len(env.decode[0].completions()) == 3)  # D0 holds the family: the prefix rule
    assert (await complete(env, FAMILY + " more"))["served_by"] == "D1"  # D0 is one request ahead: passed over
    hold.set()
    status, _, body = await held
    assert status == 200 and body.endswith("data: [DONE]\n\n")
    await assert_idle(env)


@pytest.mark.parametrize("p0_pool", [POOL, ""], ids=["prefill_member", "prefill_not_member"])
def test_a_pool_member_loads_what_its_pool_holds_instead_of_a_remote_prefill(p0_pool: str) -> None:
    """D0 answered the family itself; D1 never saw it, but its pool holds it (D0 stored it, and P0 if a member): both
    follow-ups skip the remote prefill (pooled), each decode instance gets the pool-only params, P0 sees neither."""

    async def test(env: Environment) -> None:
        await pool_history(env, POOL, p0_pool)
        assert prefills_of(env, FAMILY + " held") == prefills_of(env, FAMILY + " more") == 0
        assert params_of(env, 0, FAMILY + " held") == params_of(env, 1, FAMILY + " more") == \
            {DO_REMOTE_PREFILL: True, POOL_ONLY: True}
        assert await decisions(env, LOCAL, "pooled") == 2
        assert await proxy_metric(env, "mooncake_proxy_prefill_skipped_total") == 2
        # the streamed pooled decode on D0 taught what computing there costs (the non-streamed one has no first token)
        assert env.proxy.proxy.decode_balancer.upstreams[0].costs.prefill.samples == 1
        assert await decisions(env, REMOTE, "not_below_threshold") == 1  # the family (too long to compute on D0)
        assert await decisions(env, REMOTE, "never") == 2  # the first two: no pool known yet
        assert await proxy_metric(env, "mooncake_proxy_prefix_index_entries", role="pool") == 24

    run(test, 1, 2, balance_slack=0)


def test_a_non_member_with_the_same_history_gets_a_remote_prefill() -> None:
    async def test(env: Environment) -> None:
        await pool_history(env, "")
        assert params_of(env, 0, FAMILY + " held") == POOL_ONLY_LOAD  # D0 holds the family itself
        assert prefills_of(env, FAMILY + " more") == 1  # D1 is no member: the pool's index is not its own
        remote = params_of(env, 1, FAMILY + " more")
        assert loads_kv(remote) and not pool_only(remote)  # the producer's answer
        assert await decisions(env, LOCAL, "pooled") == 1
        assert await decisions(env, REMOTE, "never") == 3  # the first two (no pool known yet), and D1's

    run(test, 1, 2, balance_slack=0)


def test_pool_tail_0_turns_the_rule_off_but_a_skipped_prefill_still_loads_from_the_pool() -> None:
    """--pool-tail 0: both follow-ups are prefilled remotely (no skip rule at all: reason never). With
    --skip-prefill-below, a request skipped by that rule still reaches a member with the pool-only params, a
    non-member with NO_LOAD."""

    async def off(env: Environment) -> None:
        await pool_history(env, POOL)
        assert prefills_of(env, FAMILY + " held") == prefills_of(env, FAMILY + " more") == 1
        assert await decisions(env, LOCAL, "pooled") == 0
        assert await proxy_metric(env, "mooncake_proxy_prefill_skipped_total") == 0
        assert await decisions(env, REMOTE, "never") == 5

    run(off, 1, 2, balance_slack=0, pool_tail=0)

    async def below_threshold(env: Environment) -> None:
        env.decode[0].metrics_text = MEMBER_METRICS
        env.decode[1].metrics_text = endpoint_info("pull", "10.0.0.6:17100", pool="")
        long = [text_of(80 + i, 1000) for i in range(2)]  # not below 500: prefilled remotely, /metrics read
        for prompt in long:
            await complete(env, prompt)
        await settle(env.proxy.proxy)
        for i in range(2):
            await complete(env, text_of(90 + i, 300))  # below 500: skipped, D0 and D1 in turn
        assert len(env.prefill[0].completions()) == 2
        assert params_of(env, 0, text_of(90, 300)) == POOL_ONLY_LOAD
        assert params_of(env, 1, text_of(91, 300)) == NO_LOAD
        assert await decisions(env, LOCAL, "below_threshold") == 2
        await assert_idle(env)

    run(below_threshold, 1, 2, skip_prefill_below=500, pool_tail=0)


def test_a_pool_only_decode_that_fails_before_its_first_token_is_sent_again_whole() -> None:
    """A pool-only decode may load KV: when it fails as a broken load fails (a 500), it is sent again once with
    NO_LOAD, and the client gets its answer."""

    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = MEMBER_METRICS
        await complete(env, text_of(100, 100))
        await settle(env.proxy.proxy)
        env.decode[0].failed_loads = 1
        await complete(env, text_of(101, 100))  # ~100 tokens uncached on a member: pooled
        sent = [r.body["kv_transfer_params"] for r in env.decode[0].completions()[1:]]
        assert sent == [POOL_ONLY_LOAD, NO_LOAD] and len(env.prefill[0].completions()) == 1
        assert await proxy_metric(env, "mooncake_proxy_decode_retries_total", reason="status_500") == 1
        await assert_idle(env)

    run(test)


# ---------------------------------------------------------------- the router, without HTTP
def learned(base: float, per_token: float) -> LinearFit:
    fit = LinearFit()
    for n in (100, 400, 800, 1600):
        fit.observe(n, base + per_token * n)
    return fit


def fleet(prefill: int = 1, decode: int = 2, **options: Any) -> tuple[Router, Balancer, Balancer, CollectorRegistry]:
    """A router over instances whose costs are learned (prefill 20 ms + 1 ms a token, load 10 ms + 0.1 ms a token),
    none of them read over HTTP."""
    config = ProxyConfig(prefill=tuple(f"http://p{i}:1" for i in range(prefill)),
                         decode=tuple(f"http://d{i}:1" for i in range(decode)), **options)
    balancers = [Balancer.from_urls(role, urls, 5.0) for role, urls in ((PREFILL, config.prefill),
                                                                        (DECODE, config.decode))]
    registry = CollectorRegistry()
    router = Router(config, *balancers, Discovery(lambda: None, None), registry)  # type: ignore[arg-type]
    for upstream in balancers[0].upstreams + balancers[1].upstreams:
        upstream.costs = Costs(prefill=learned(0.02, 0.001), load=learned(0.01, 0.0001))
        for _ in range(MIN_SAMPLES):
            upstream.costs.observe_step(0.03)
        upstream.cache_asked = float("inf")  # no background read of its /metrics
    return router, *balancers, registry


def join(router: Router, upstream: Upstream, pool: str, cache: CacheInfo | None = None) -> None:
    """What the instance's /metrics say, as Discovery tells the router."""
    router.observe(upstream, InstanceInfo(None, cache or CacheInfo(), pool))


def prompt(chars: int, char: str = "x") -> Fingerprint:
    hint = fingerprint({"prompt": char * chars}, chat=False)
    assert hint is not None
    return hint


def test_the_estimate_sees_what_the_pool_holds() -> None:
    """P0 and D0 share a pool, D1 does not. P0's prefill of a 4000-character prefix puts its 15 chunks in the pool's
    index: D0 lacks 360 tokens of a 4200-token prompt (computed there in ~0.4 s, against a remote prefill of those
    360 tokens and a load of all 4200 it lacks itself), D1 all of them. D0 wins the choice and computes the request
    itself (faster_locally); on D1 it is prefilled remotely (faster_remotely)."""
    router, prefill, decode, registry = fleet(routing="estimate")
    p0, (d0, d1) = prefill.upstreams[0], decode.upstreams
    hint, prefix = prompt(4200), prompt(4000)
    for upstream in (p0, d0):
        join(router, upstream, POOL)
    assert router.uncached(d0, hint) == router.uncached(d1, hint) == 4200  # (a character a token, cautiously)
    router.pool_answered(p0, prefix)
    assert router.uncached(d0, hint, confirmed=True) == router.uncached(p0, hint) == 4200 - 15 * CHUNK_CHARS
    assert router.uncached(d1, hint, confirmed=True) == router.uncached(d0, hint, pool=False) == 4200
    choice = decode.pick(hint=hint, score=router._decode_scores(hint))
    assert choice is not None and choice.upstream is d0
    assert router.route(choice, hint, "r1") == (LOCAL, None)
    assert router.route(Choice(d1), hint, "r2") == (REMOTE, None)
    for reason, choice_ in (("faster_locally", LOCAL), ("faster_remotely", REMOTE)):
        assert registry.get_sample_value("mooncake_proxy_route_decisions_total",
                                         {"choice": choice_, "reason": reason}) == 1
    assert router.route(Choice(d0), prompt(4100), "r3") == (LOCAL, None)
    join(router, d0, "")  # D0 leaves the pool (it restarted without one): the same request is better prefilled remotely
    assert router.route(Choice(d0), prompt(4100), "r4") == (REMOTE, None)


def test_the_prefix_rule_counts_the_pool_and_its_answers_only() -> None:
    """--routing prefix: a member with the pool holding all but ~100 tokens computes the request itself (pooled);
    chunks only routed to a member (not answered yet) count for nothing; --protocol bootstrap knows no pools."""
    router, prefill, decode, registry = fleet()
    p0, d0 = prefill.upstreams[0], decode.upstreams[0]
    for upstream in (p0, d0):
        join(router, upstream, POOL)
    hint = prompt(8 * CHUNK_CHARS + 100)
    d0.prefix.add(hint.chunks)  # routed to D0, no answer yet
    assert router.route(Choice(d0), hint, "r1") == (REMOTE, None)
    router.pool_answered(p0, hint)
    assert router.route(Choice(d0), hint, "r2") == (LOCAL, None)
    assert registry.get_sample_value("mooncake_proxy_route_decisions_total",
                                     {"choice": LOCAL, "reason": "pooled"}) == 1
    router, prefill, decode, _ = fleet(protocol="bootstrap")
    join(router, prefill.upstreams[0], POOL)
    join(router, decode.upstreams[0], POOL)
    router.pool_answered(prefill.upstreams[0], hint)
    assert router.pool(decode.upstreams[0]) == "" and router.uncached(decode.upstreams[0], hint) == hint.size
    assert router.route(Choice(decode.upstreams[0]), hint, "r3") == (REMOTE, None)


def test_a_pools_index_is_bounded_and_forgotten_with_its_members() -> None:
    """A pool's index is bounded as its largest member's (pools counted in the --prefix-index-entries shares); a
    member's restart empties it (its share of the pool went with it), as does its removal; an instance naming
    another pool counts for that one (forgetting its own index); a pool without members has no index."""
    router, prefill, decode, _ = fleet(prefix_index_entries=1000)
    p0, (d0, d1) = prefill.upstreams[0], decode.upstreams
    join(router, p0, POOL, CacheInfo(50 * 64, 1.0))
    join(router, d0, POOL, CacheInfo(100 * 64, 1.0))
    assert set(router.pools) == {POOL}
    assert [u.prefix.capacity for u in (p0, d0, d1)] == [50, 100, 250] and router.pools[POOL].capacity == 100
    hint = prompt(8 * CHUNK_CHARS)
    router.pool_answered(d0, hint)
    router.pool_answered(d1, prompt(9 * CHUNK_CHARS))  # no member: nothing
    assert router.pool_held(p0, hint) == router.pool_held(d0, hint) == 8 and router.pool_held(d1, hint) == 0
    join(router, p0, POOL, CacheInfo(50 * 64, 1.0))  # read again, unchanged
    assert router.pool_held(d0, hint) == 8
    join(router, p0, POOL, CacheInfo(50 * 64, 2.0))  # restarted
    assert router.pool_held(d0, hint) == 0
    router.pool_answered(d0, hint)
    d0.prefix.add(hint.chunks)
    join(router, d0, OTHER_POOL, CacheInfo(100 * 64, 1.0))  # another pool: its own index forgotten
    assert len(d0.prefix) == 0 and router.pool_held(d0, hint) == 0 and router.pool_held(p0, hint) == 8
    assert set(router.pools) == {POOL, OTHER_POOL} and router.pools[POOL].capacity == 50
    router.pool_lost(p0, "removed")
    assert router.pool_held(p0, hint) == 0
    join(router, p0, "", CacheInfo(50 * 64, 2.0))
    assert set(router.pools) == {OTHER_POOL}


def test_routed_feeds_the_pool_and_queues_only_what_the_pool_lacks() -> None:
    """Routed's bookkeeping: a member's prefill answer puts the prompt in its pool's index (a failed prefill does
    not); a pooled decode counts, on the decode instance's queue, only the tokens neither it nor its pool holds; a
    decode sent whole (NO_LOAD) all it lacks itself."""
    router, prefill, decode, _ = fleet(1, 1)
    p0, d0 = prefill.upstreams[0], decode.upstreams[0]
    join(router, p0, POOL)
    join(router, d0, POOL)
    for answer, held in ((None, 0), ({"kv_transfer_params": {}}, 16)):
        routed = Routed.open(router, prompt(16 * CHUNK_CHARS, "y"), "p")
        assert routed.where == REMOTE
        routed.prefill_sent(routed.reserve_prefill())
        routed.prefill_ended(answer)
        assert router.pool_held(d0, prompt(16 * CHUNK_CHARS, "y")) == held
        routed.release()
        prefill.release(p0)
    hint = prompt(8 * CHUNK_CHARS + 100)
    router.pool_answered(d0, prompt(8 * CHUNK_CHARS))
    for pooled, queued in ((False, hint.size), (True, 100.0)):
        d0.prefix.clear()  # (a choice records the prompt there as routed: each case starts without it)
        routed = Routed.open(router, hint, "r")
        assert routed.where == LOCAL
        routed.decode_sent(d0, True, pooled)
        assert (d0.work.queued, d0.work.tokens) == (1, queued)
        routed.decode_ended()
        assert (d0.work.queued, d0.work.tokens) == (0, 0.0)
        decode.release(d0)
