"""Degrade, don't refuse: when no prefill instance can take a request (all unreachable, timed out, failed with a
server error, or all cooling down after failing), the proxy sends it whole to its decode instance (``do_remote_prefill:
false``: it computes the prompt as a colocated instance would), counts it by reason on /metrics and says so once per
outage; ``--no-fallback`` keeps the 502. Real HTTP: fake vLLM upstreams, the proxy, an aiohttp client."""

from __future__ import annotations

import logging
import time

import pytest

from kv_proxy.protocols import NO_LOAD
from tests.kv_proxy.upstreams import (
    CHAT,
    COMPLETION,
    Environment,
    assert_idle,
    endpoint_info,
    proxy_metric,
    run,
    settle,
    unused_port,
)

pytestmark = pytest.mark.timeout(60)
FALLBACKS = "mooncake_proxy_prefill_fallbacks_total"


def whole(env: Environment) -> list[dict]:
    """The kv_transfer_params of the decode requests that went out whole."""
    return [r.body.get("kv_transfer_params") for r in env.decode[0].received]


def test_no_prefill_instance_reachable_sends_requests_whole_and_says_so_once(caplog) -> None:
    dead = f"http://127.0.0.1:{unused_port()}"

    async def test(env: Environment) -> None:
        with caplog.at_level(logging.WARNING, logger="kv_proxy.app"):
            for _ in range(3):
                status, _, body = await env.post("/v1/completions", COMPLETION)
                assert status == 200 and body["served_by"] == "D0"
                status, _, body = await env.post("/v1/completions", {**COMPLETION, "stream": True})
                assert status == 200 and body.endswith("data: [DONE]\n\n")
        assert whole(env) == [NO_LOAD] * 6
        # a pull-mode decode instance: each prefill is tried first (refused in a moment), then the decode goes whole
        assert await proxy_metric(env, FALLBACKS, reason="unreachable") == 6.0
        outages = [r for r in caplog.records if "no prefill instance could take the request" in r.getMessage()]
        assert len(outages) == 1, [r.getMessage() for r in caplog.records]
        await assert_idle(env)

    run(test, 0, 1, prefill_urls=[dead])


@pytest.mark.parametrize("status", [500, 503])
def test_a_prefill_failing_with_a_server_error_falls_back_and_recovery_is_logged(status: int, caplog) -> None:
    async def test(env: Environment) -> None:
        env.prefill[0].status = status
        with caplog.at_level(logging.WARNING, logger="kv_proxy.app"):
            got, _, body = await env.post("/v1/completions", COMPLETION)
            assert got == 200 and body["served_by"] == "D0" and whole(env) == [NO_LOAD]
            env.prefill[0].status = 200  # it serves again: remote prefills resume
            got, _, _ = await env.post("/v1/completions", COMPLETION)
            assert got == 200 and whole(env)[1] != NO_LOAD
        assert await proxy_metric(env, FALLBACKS, reason="server_error") == 1.0
        messages = [r.getMessage() for r in caplog.records]
        assert any("remote prefills resume" in m for m in messages), messages
        await assert_idle(env)

    run(test)


def test_a_prefill_that_times_out_falls_back() -> None:
    async def test(env: Environment) -> None:
        env.prefill[0].delay = 10.0
        start = time.monotonic()
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0" and whole(env) == [NO_LOAD]
        assert time.monotonic() - start < 3.0
        assert await proxy_metric(env, FALLBACKS, reason="timeout") == 1.0
        await assert_idle(env)

    run(test, timeout=0.5)


def test_push_mode_with_every_prefill_instance_cooling_down_sends_the_decode_whole_at_once() -> None:
    """Concurrent dispatch would send the decode beside a prefill that cannot succeed, to wait push_wait for a push:
    once every prefill instance failed (cooling down), the decode goes out whole at once instead."""
    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17100")
        await env.prefill[0].stop()
        await env.post("/v1/completions", COMPLETION)  # the background prefill finds it gone: cooling down
        await settle(env.proxy.proxy)
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0" and whole(env)[-1] == NO_LOAD
        assert await proxy_metric(env, FALLBACKS, reason="cooldown") == 1.0

    run(test, cooldown=30.0)


@pytest.mark.parametrize("status", [400, 422])
def test_a_prefill_refusing_the_request_is_relayed_not_retried_whole(status: int) -> None:
    async def test(env: Environment) -> None:
        env.prefill[0].status = status
        got, _, _ = await env.post("/v1/completions", COMPLETION)
        assert got == status and not env.decode[0].received
        assert await proxy_metric(env, FALLBACKS, reason="server_error") == 0.0

    run(test)


def test_no_fallback_keeps_the_502() -> None:
    dead = f"http://127.0.0.1:{unused_port()}"

    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 502 and body["error"]["stage"] == "prefill" and not env.decode[0].received
        assert await proxy_metric(env, FALLBACKS, reason="unreachable") == 0.0

    run(test, 0, 1, prefill_urls=[dead], fallback=False)


# ---------------------------------------------------------------- a decode whose KV load broke (#45 item 6)
RETRIES = "mooncake_proxy_decode_retries_total"


@pytest.mark.parametrize("path, stream", [("/v1/completions", False), ("/v1/completions", True),
                                          ("/v1/chat/completions", True)], ids=["whole", "streamed", "chat-streamed"])
def test_a_decode_whose_load_failed_before_its_first_token_is_sent_again_whole(path: str, stream: bool,
                                                                               caplog) -> None:
    """vLLM's default kv_load_failure_policy ("fail") ends a request whose KV load broke with a 500 answer, or a
    stream whose first event is the error (a chat stream: after its opening role delta): the proxy sends it again,
    once, whole to a decode instance; the client gets the text, never the error. Counted and logged."""
    async def test(env: Environment) -> None:
        env.prefill[0].kv_params = {"do_remote_prefill": True, "remote_pipe": ["127.0.0.1:9"]}  # a producer's answer
        env.decode[0].failed_loads = 1
        payload = CHAT if path.endswith("/chat/completions") else COMPLETION
        with caplog.at_level(logging.WARNING, logger="kv_proxy.app"):
            status, _, body = await env.post(path, {**payload, "stream": stream})
        assert status == 200
        if stream:
            assert '"Hello"' in body and "error" not in body and body.endswith("data: [DONE]\n\n"), body
            assert body.count('"role"') == 0, body  # the failed attempt's opening delta never reached the client
        else:
            assert body["choices"][0]["text"] == "Hello world!"
        sent = whole(env)
        assert len(sent) == 2 and sent[0].get("do_remote_prefill") and sent[1] == NO_LOAD, sent
        reason = "stream_error_500" if stream else "status_500"
        assert await proxy_metric(env, RETRIES, reason=reason) == 1.0
        assert any("failed before its first token" in r.getMessage() for r in caplog.records)
        await assert_idle(env)

    run(test, 1, 1)


def test_a_decode_computed_whole_or_failing_after_a_token_reaches_the_client_as_is() -> None:
    """A decode computed whole (no KV to load: nothing a retry could change) that fails is relayed, not retried; so
    is a stream that sent a token before its error: the client has text it cannot take back."""
    async def test(env: Environment) -> None:
        env.prefill[0].status = 500  # the prefill falls back: the decode goes whole
        env.decode[0].status = 500
        status, _, _ = await env.post("/v1/completions", COMPLETION)
        assert status == 500 and whole(env) == [NO_LOAD]
        env.prefill[0].status = env.decode[0].status = 200
        env.decode[0].error_after = 1
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and '"Hello"' in body and "Internal server error" in body, body
        assert len(whole(env)) == 2 and await proxy_metric(env, RETRIES) == 0.0
        await assert_idle(env)

    run(test, 1, 1)
