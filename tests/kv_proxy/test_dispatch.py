"""kv_proxy/app.py's dispatch (``--dispatch``): a decode instance that takes pushed KV gets its request together with the
prefill, with params that make it wait for the push; any other gets it after the prefill answered, with that
answer's params. Real HTTP through the proxy."""

from __future__ import annotations

from kv_connector.param_keys import AWAIT_PUSH, DO_REMOTE_DECODE, DO_REMOTE_PREFILL, PUSH_TO
from tests.kv_proxy.upstreams import (
    COMPLETION,
    Environment,
    assert_idle,
    endpoint_info,
    proxy_metric,
    read_sse,
    run,
    settle,
    wait_until,
)

AWAITED = {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, AWAIT_PUSH: True}
PRODUCER_ANSWER = {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, "remote_pipe": ["10.0.0.9:17000"]}


def test_a_push_mode_decode_goes_out_with_its_prefill() -> None:
    """The prefill takes a while; the decode starts before it ends (the journal's order, not a clock), carries the
    await-push params, and the client has its answer while the prefill still runs. The prefill still gets the push
    target, and is counted as concurrent."""

    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17100")
        env.prefill[0].kv_params = PRODUCER_ANSWER
        env.prefill[0].delay = 1.0
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0"
        assert env.decode[0].received[0].body["kv_transfer_params"] == AWAITED
        assert ("P0", "end") not in env.journal  # answered before the prefill ended
        await settle(env.proxy.proxy)
        assert ("P0", "end") in env.journal
        assert env.prefill[0].received[0].body["kv_transfer_params"][PUSH_TO] == ["10.0.0.5:17100"]
        assert await proxy_metric(env, "mooncake_proxy_dispatched_total", mode="concurrent") == 1.0
        await assert_idle(env)

    run(test)


def test_a_failing_prefill_beside_its_decode_is_not_the_clients_failure() -> None:
    """The prefill fails (500, or its instance is gone): the client still gets the decode's answer, streamed too
    (the consumer computes the prompt itself after its push wait); each failure is logged and counted."""

    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17100")
        env.prefill[0].status = 500
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0"
        async with env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": True}) as response:
            assert response.status == 200
            assert len(await read_sse(response)) == 4  # three chunks and [DONE]
        await settle(env.proxy.proxy)
        assert await proxy_metric(env, "mooncake_proxy_background_prefill_failed_total") == 2.0
        await env.prefill[0].stop()  # gone: the prefill cannot even connect
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0"
        await wait_until(lambda: not env.proxy.proxy.background)
        assert await proxy_metric(env, "mooncake_proxy_background_prefill_failed_total") == 3.0
        await assert_idle(env)

    run(test)


def test_sequential_dispatch_and_pull_mode_decodes_wait_for_the_prefills_answer() -> None:
    """``--dispatch sequential``, and any decode instance that takes no push: the decode starts after the prefill
    ended and carries the producer's answer."""

    for mode, info in (("sequential", endpoint_info("push", "10.0.0.5:17100")),
                       ("concurrent", endpoint_info("pull", "10.0.0.6:17100")), ("concurrent", None)):
        async def test(env: Environment, info: str | None = info, mode: str = mode) -> None:
            env.decode[0].metrics_text = info
            env.prefill[0].kv_params = PRODUCER_ANSWER
            env.prefill[0].delay = 0.3
            assert (await env.post("/v1/completions", COMPLETION))[0] == 200
            assert env.journal == [("P0", "start"), ("P0", "end"), ("D0", "start"), ("D0", "end")], (mode, info)
            assert env.decode[0].received[0].body["kv_transfer_params"] == PRODUCER_ANSWER
            assert await proxy_metric(env, "mooncake_proxy_dispatched_total", mode="sequential") == 1.0
            await assert_idle(env)

        run(test, dispatch=mode)
