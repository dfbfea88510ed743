"""kv_proxy/app.py: the request flow (prefill, then decode), the headers passed on, /health and /v1/models, and how
upstream failures end a request (relayed, 502, 504, naming the stage, never an internal URL). Real HTTP: fake vLLM
upstreams (aiohttp), the proxy served by Hypercorn, an aiohttp client, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from kv_proxy.protocols import NO_LOAD
from tests.kv_proxy.upstreams import (
    CHAT,
    COMPLETION,
    PRODUCER_ANSWER,
    REMOTE_DECODE,
    Environment,
    assert_idle,
    outstanding,
    proxy_metric,
    run,
    unused_port,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def test_completion_prefill_then_decode() -> None:
    async def test(env: Environment) -> None:
        status, headers, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0"
        assert env.journal == [("P0", "start"), ("P0", "end"), ("D0", "start"), ("D0", "end")]
        (prefill,), (decode,) = env.prefill[0].received, env.decode[0].received
        assert prefill.path == decode.path == "/v1/completions"
        assert prefill.body == {**COMPLETION, "max_tokens": 1, "n": 1, "stream": False,
                                "kv_transfer_params": REMOTE_DECODE}
        assert decode.body == {**COMPLETION, "kv_transfer_params": {**PRODUCER_ANSWER, "remote_engine_id": "P0"}}
        await assert_idle(env)

    run(test)


def test_chat_completion() -> None:
    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200 and body.endswith("data: [DONE]\n\n")
        (prefill,), (decode,) = env.prefill[0].received, env.decode[0].received
        assert prefill.path == decode.path == "/v1/chat/completions"
        assert prefill.body == {**CHAT, "max_tokens": 1, "max_completion_tokens": 1, "n": 1, "stream": False,
                                "kv_transfer_params": REMOTE_DECODE}
        assert decode.body == {**CHAT, "stream": True,
                               "kv_transfer_params": {**PRODUCER_ANSWER, "remote_engine_id": "P0"}}

    run(test)


def test_request_id_and_authorization_forwarded() -> None:
    async def test(env: Environment) -> None:
        headers = {"Authorization": "Bearer secret", "X-Request-Id": "req-42"}
        status, response_headers, _ = await env.post("/v1/completions", COMPLETION, headers=headers)
        assert status == 200 and response_headers["X-Request-Id"] == "req-42"
        for upstream in env.prefill + env.decode:
            assert upstream.received[0].headers["Authorization"] == "Bearer secret"
            assert upstream.received[0].headers["X-Request-Id"] == "req-42"
        # Without them: no Authorization, and one generated id shared by both upstreams and the response.
        status, response_headers, _ = await env.post("/v1/completions", COMPLETION)
        generated = response_headers["X-Request-Id"]
        assert status == 200 and len(generated) >= 16
        for upstream in env.prefill + env.decode:
            assert upstream.received[1].headers["X-Request-Id"] == generated
            assert "Authorization" not in upstream.received[1].headers

    run(test)


def test_the_clients_kv_transfer_params_are_dropped_and_counted() -> None:
    """Finding 2: the proxy merged a client's kv_transfer_params into both requests (the prefill got the client's
    remote_pipe, mooncake_push_to and test switches; when the prefill answered without params the decode got the
    client's remote_pipe), so a client could make a consumer load KV from a host of its choosing. Only the
    protocol's own fields go upstream now; each drop is counted on the proxy's /metrics."""
    client = {"remote_pipe": ["6.6.6.6:1"], "mooncake_push_to": ["6.6.6.6:2"], "mooncake_test_corrupt": True,
              "do_remote_prefill": True, "custom": 7}
    params = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_pipe": ["127.0.0.1:9"]}

    async def test(env: Environment) -> None:
        env.prefill[0].kv_params = params
        assert (await env.post("/v1/completions", {**COMPLETION, "kv_transfer_params": client}))[0] == 200
        env.prefill[0].kv_params, env.prefill[0].answers_params = None, False  # a prefill that answers without params
        assert (await env.post("/v1/completions", {**COMPLETION, "kv_transfer_params": client}))[0] == 200
        assert [r.body["kv_transfer_params"] for r in env.prefill[0].received] == [REMOTE_DECODE] * 2
        assert env.decode[0].received[0].body["kv_transfer_params"] == params
        assert env.decode[0].received[1].body["kv_transfer_params"] == NO_LOAD  # a failed prefill: whole
        async with env.client.get(env.url + "/metrics") as response:
            text = await response.text()
        assert "mooncake_proxy_client_kv_params_dropped_total 2.0" in text, text

    run(test)


def test_health_and_models() -> None:
    async def test(env: Environment) -> None:
        async with env.client.get(env.url + "/v1/models", headers={"Authorization": "Bearer k"}) as response:
            assert response.status == 200 and (await response.json())["data"][0]["id"] == "fake-model"
        assert env.decode[0].received[0].headers["Authorization"] == "Bearer k"
        async with env.client.get(env.url + "/health") as response:
            report = await response.json()
            assert response.status == 200 and report["status"] == "ok"
        assert [r["healthy"] for r in report["prefill"] + report["decode"]] == [True, False, True]  # the dead decode
        assert report["decode"][0]["instance"] == 0 and "error" in report["decode"][0]
        assert dead not in json.dumps(report)  # finding 6: /health named internal upstream URLs
        env.decode[0].health_status = 503
        async with env.client.get(env.url + "/health") as response:
            report = await response.json()
            assert response.status == 503 and report["status"] == "unavailable"
            assert (report["decode"][1]["healthy"], report["decode"][1]["status"]) == (False, 503)

    dead = f"http://127.0.0.1:{unused_port()}"
    run(test, decode_urls=[dead])


@pytest.mark.parametrize("stage", ["prefill", "decode"])
@pytest.mark.parametrize("status", [400, 422, 500, 503])
def test_upstream_error_status_relayed(stage: str, status: int) -> None:
    """A prefill's 4xx is the request's fault: relayed (the decode instance would refuse it too). A prefill's 5xx is
    relayed with --no-fallback (test_fallback.py: by default its decode instance computes the request whole). A
    decode's 5xx is relayed once the decode sent again whole failed too (test_fallback.py)."""
    error = {"error": {"message": f"bad thing {status}", "type": "BadRequestError", "code": status}}

    async def test(env: Environment) -> None:
        upstream = (env.prefill if stage == "prefill" else env.decode)[0]
        upstream.status, upstream.error_body = status, error
        got_status, headers, body = await env.post("/v1/completions", COMPLETION)
        assert (got_status, body) == (status, error) and headers["Content-Type"].startswith("application/json")
        assert len(env.decode[0].received) == (0 if stage == "prefill" else 2 if status >= 500 else 1)
        await assert_idle(env)

    run(test, fallback=status < 500)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_unreachable_upstream_is_502_naming_the_stage(stage: str) -> None:
    dead = f"http://127.0.0.1:{unused_port()}"

    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 502 and body["error"]["stage"] == stage and body["error"]["upstream"] == f"{stage} instance 0"
        assert dead.split("//")[1] not in json.dumps(body)  # finding 6: the 502 named the internal URL
        if stage == "prefill":
            assert not env.decode[0].received
        await assert_idle(env)

    if stage == "prefill":
        run(test, 0, 1, prefill_urls=[dead], fallback=False)
    else:
        run(test, 1, 0, decode_urls=[dead])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_timeout_is_504_naming_the_stage(stage: str, stream: bool) -> None:
    async def test(env: Environment) -> None:
        slow = (env.prefill if stage == "prefill" else env.decode)[0]
        slow.delay = 10.0
        start = time.monotonic()
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "stream": stream})
        assert time.monotonic() - start < 3.0
        assert status == 504 and body["error"]["stage"] == stage and body["error"]["type"] == "upstream_timeout"
        await asyncio.wait_for(slow.cancelled.wait(), 5)  # the proxy gave up on the upstream request
        await assert_idle(env)

    run(test, timeout=0.5, fallback=False)


def test_client_disconnect_during_prefill_cancels_it() -> None:
    async def test(env: Environment) -> None:
        env.prefill[0].delay = 10.0
        request = asyncio.create_task(env.post("/v1/completions", COMPLETION))
        await asyncio.wait_for(env.prefill[0].started.wait(), 5)
        request.cancel()  # closes the client connection
        await asyncio.wait_for(env.prefill[0].cancelled.wait(), 5)
        assert env.prefill[0].received[0].cancelled and not env.decode[0].received
        await wait_until(lambda: outstanding(env.proxy.proxy) == {"prefill": 0, "decode": 0})
        await assert_idle(env)

    run(test)


# ---------------------------------------------------------------- the front door holds (#46)
BAD_ANSWERS = "mooncake_proxy_prefill_bad_answers_total"


@pytest.mark.parametrize("answer, reason", [
    (b"<html>oops</html>", "no_JSON_object"), (b'["a list"]', "no_JSON_object"),
    (json.dumps({"choices": [{"text": "x"}]}).encode(), "no_kv_transfer_params"),
    (b'{"pad": "' + b"x" * (1 << 20) + b'"}', "more_than_1048576_bytes"),
], ids=["html", "list", "no-params", "1-MiB"])
def test_a_prefill_answer_the_decode_cannot_use_is_a_failed_prefill(answer: bytes, reason: str) -> None:
    """A 200 that is not JSON, carries no kv_transfer_params, or is larger than any prefill answer: counted and the
    request goes whole to its decode instance (it was taken for a success, and the decode went without params)."""
    async def test(env: Environment) -> None:
        env.prefill[0].raw_answer = answer
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0"
        assert env.decode[0].received[0].body["kv_transfer_params"] == NO_LOAD
        assert await proxy_metric(env, BAD_ANSWERS, reason=reason) == 1.0
        await assert_idle(env)

    run(test)


@pytest.mark.parametrize("body, what", [
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', "non-finite"),
    (b'{"model": "m", "prompt": "x", "temperature": Infinity}', "non-finite"),
    (b'{"model": "m", "prompt": "x", "temperature": 1e999}', "non-finite"),
    (b'{"model": "m", "prompt": "x", "n": 129}', "n must be"),
    (b'{"model": "m", "prompt": "x", "best_of": 100000}', "best_of must be"),
])
def test_requests_vllm_would_refuse_are_refused_before_anything_is_sent(body: bytes, what: str) -> None:
    async def test(env: Environment) -> None:
        status, _, answer = await env.post("/v1/completions", body)
        assert status == 400 and what in answer["error"]["message"], answer
        assert not env.prefill[0].received and not env.decode[0].received

    run(test)


def test_the_prefill_copy_asks_for_one_sequence() -> None:
    async def test(env: Environment) -> None:
        status, _, _ = await env.post("/v1/completions", {**COMPLETION, "n": 4, "best_of": 8})
        assert status == 200
        prefill = env.prefill[0].received[0].body
        assert prefill["n"] == 1 and "best_of" not in prefill
        assert env.decode[0].received[0].body["n"] == 4 and env.decode[0].received[0].body["best_of"] == 8

    run(test)


@pytest.mark.parametrize("given, kept", [("req-42.a:b/c", True), ("x" * 129, False), ("x" * 12000, False),
                                         ("bad id", False), ("é", False)])
def test_a_client_request_id_is_passed_on_only_when_short_and_plain(given: str, kept: bool) -> None:
    async def test(env: Environment) -> None:
        status, headers, _ = await env.post("/v1/completions", COMPLETION, headers={"X-Request-Id": given})
        assert status == 200
        sent = env.decode[0].received[0].headers["X-Request-Id"]
        assert (sent == given) is kept and headers["X-Request-Id"] == sent and len(sent) <= 128

    run(test)


def test_a_path_with_a_double_slash_is_a_404_not_a_redirect() -> None:
    async def test(env: Environment) -> None:
        for method, path in (("GET", "/admin//instances"), ("POST", "/v1//completions"), ("GET", "/v1//models")):
            async with env.client.request(method, env.url + path, headers={"Host": "evil.example"},
                                          allow_redirects=False) as response:
                assert response.status == 404 and "Location" not in response.headers, (path, response.status)

    run(test)
