"""kv_proxy/protocols.py: what the prefill and the decode requests carry (``--protocol params``, with push targets read
from a decode instance's /metrics, and ``--protocol bootstrap``). Real HTTP through the proxy."""

from __future__ import annotations

import asyncio
import json

import pytest

from kv_connector.param_keys import PUSH_PROOF, PUSH_TO
from tests.kv_proxy.upstreams import COMPLETION, Environment, FakeBootstrap, assert_idle, endpoint_info, run, settle, unused_port

pytestmark = pytest.mark.timeout(60)


def test_kv_transfer_params_forwarded_to_decode() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2, 3]}

    async def test(env: Environment) -> None:
        env.prefill[0].kv_params = params
        status, _, _ = await env.post("/v1/completions", COMPLETION)
        assert status == 200
        assert env.decode[0].received[0].body == {**COMPLETION, "kv_transfer_params": params}

    run(test)


def test_push_mode_consumer_address_goes_on_the_prefill() -> None:
    """The decode instance is chosen first; one in push mode (its /metrics say so) gets its pipe addresses on the
    prefill as mooncake_push_to; for a pull-mode one and an instance without the info the list is empty (a push-mode
    producer keeps the KV for pull then). /metrics is read once."""

    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17100,10.0.0.5:17101")
        env.decode[1].metrics_text = endpoint_info("pull", "10.0.0.6:17100")
        env.decode[2].metrics_text = None
        for _ in range(6):
            assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        await settle(env.proxy.proxy)  # the push-mode decode went out with its prefill: wait for that prefill
        assert all(r.body["kv_transfer_params"]["do_remote_decode"] is True for r in env.prefill[0].received)
        sent = [r.body["kv_transfer_params"].get(PUSH_TO) for r in env.prefill[0].received]
        assert sent == [["10.0.0.5:17100", "10.0.0.5:17101"], [], []] * 2
        assert [len(d.received) for d in env.decode] == [2, 2, 2]
        assert [d.metrics_requests for d in env.decode] == [1, 1, 1]
        # the same at once: requests in flight while /metrics is read share one read
        env.proxy.proxy.decode_balancer.upstreams[0].ask_again()
        statuses = await asyncio.gather(*(env.post("/v1/completions", COMPLETION) for _ in range(9)))
        assert [s[0] for s in statuses] == [200] * 9 and env.decode[0].metrics_requests == 2

    run(test, 1, 3)


def test_a_push_address_goes_with_its_proof() -> None:
    """With a secret, a consumer publishes a proof of its push address; the proxy passes it on to the producer."""
    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17100").replace(
            'transfer_mode="push"', 'push_proof="ab12",transfer_mode="push"')
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        await settle(env.proxy.proxy)
        params = env.prefill[0].received[0].body["kv_transfer_params"]
        assert params[PUSH_TO] == ["10.0.0.5:17100"] and params[PUSH_PROOF] == "ab12"

    run(test)


def test_push_address_answered_by_a_producer_or_garbage_is_ignored() -> None:
    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17000", role="kv_producer") + "garbage{ 1\n"
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        assert env.prefill[0].received[0].body["kv_transfer_params"][PUSH_TO] == []

    run(test)


def test_bootstrap_protocol_for_vllms_builtin_mooncake_connector() -> None:
    """--protocol bootstrap: one transfer id on both requests; the decode names the prefill instance's bootstrap
    server and its engine id (read once from /query); the prefill answer's params are not used."""

    async def test(env: Environment) -> None:
        bootstrap = await FakeBootstrap({"0": {"engine_id": "prefill-engine", "worker_addr": {"0": {"0": "x"}}}}).start()
        try:
            env.proxy.proxy.prefill_balancer.upstreams[0].bootstrap = bootstrap.url  # its --bootstrap
            env.prefill[0].kv_params = {"ignored": True}
            for _ in range(2):
                assert (await env.post("/v1/completions", COMPLETION))[0] == 200
            for prefill, decode in zip(env.prefill[0].received, env.decode[0].received, strict=True):
                transfer = prefill.body["kv_transfer_params"]["transfer_id"]
                assert prefill.body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                                              "transfer_id": transfer}
                assert decode.body["kv_transfer_params"] == {
                    "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer,
                    "remote_engine_id": "prefill-engine", "remote_bootstrap_addr": bootstrap.url}
            first, second = (r.body["kv_transfer_params"]["transfer_id"] for r in env.prefill[0].received)
            assert first != second and bootstrap.queries == 1
        finally:
            await bootstrap.stop()
        # a bootstrap server that is gone (the cached engine id expired): with --no-fallback, 502 naming it (by
        # default the decode instance computes the request whole, test_fallback.py), and nothing sent upstream:
        # the engine id is asked before the prefill, so no prefilled KV waits for a decode that never comes
        env.proxy.proxy.prefill_balancer.upstreams[0].ask_again()
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 502 and "bootstrap server of prefill instance 0" in body["error"]["message"]
        assert body["error"]["stage"] == "prefill" and bootstrap.url not in json.dumps(body)  # internal addresses
        assert len(env.prefill[0].received) == 2 and len(env.decode[0].received) == 2
        await assert_idle(env)

    run(test, protocol="bootstrap", bootstrap=(f"http://127.0.0.1:{unused_port()}",), fallback=False)
