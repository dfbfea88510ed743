"""kv_proxy/balancer.py: which instance serves a request (fewest outstanding, round robin on ties) and a failed instance
set aside for the cooldown. Real HTTP through the proxy."""

from __future__ import annotations

import asyncio

import pytest

from tests.kv_proxy.upstreams import COMPLETION, Environment, FakeUpstream, assert_idle, read_sse, run, unused_port

pytestmark = pytest.mark.timeout(60)


def test_balancing_2p2d_round_robin_and_least_outstanding() -> None:
    async def test(env: Environment) -> None:
        for _ in range(4):
            assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        assert [len(u.received) for u in env.prefill + env.decode] == [2, 2, 2, 2]  # round robin when all idle
        # Keep one stream open on the next decode instance (D0): the following requests all go to D1.
        hold = asyncio.Event()
        env.decode[0].hold_last = hold
        async with env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": True}) as held:
            await held.content.readuntil(b"\n\n")
            assert env.proxy.proxy.decode_balancer.upstreams[0].outstanding == 1
            for _ in range(3):
                assert (await env.post("/v1/completions", COMPLETION))[1]
            assert [len(u.received) for u in env.decode] == [3, 5]
            assert [len(u.received) for u in env.prefill] == [4, 4]  # prefill is idle between requests
            hold.set()
            await read_sse(held)
        await assert_idle(env)

    run(test, 2, 2)


def test_failed_instance_skipped_then_retried_after_cooldown() -> None:
    port = unused_port()
    dead = f"http://127.0.0.1:{port}"

    async def test(env: Environment) -> None:
        balancer = env.proxy.proxy.prefill_balancer
        # The first pick is the dead instance: the request fails over to P0, and the dead one cools down.
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        assert balancer.upstreams[0].cooling_down() and balancer.upstreams[0].failures == 1
        for _ in range(3):
            assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        assert len(env.prefill[0].received) == 4
        revived = await FakeUpstream("P-revived", env.journal).start(port)
        try:
            await asyncio.sleep(2.2)  # > cooldown
            for _ in range(2):
                assert (await env.post("/v1/completions", COMPLETION))[0] == 200
            assert len(revived.received) == 1 and len(env.prefill[0].received) == 5
            assert balancer.upstreams[0].failures == 1
        finally:
            await revived.stop()

    run(test, 1, 1, prefill_urls=[dead], cooldown=2.0)  # longer than the three requests take on a busy machine
