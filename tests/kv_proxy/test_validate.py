"""kv_proxy/validate.py: a request vLLM would refuse is refused before anything goes upstream (400 naming the field);
what vLLM accepts passes. Real HTTP through the proxy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.kv_proxy.upstreams import CHAT, COMPLETION, Environment, assert_idle, read_sse, run

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("value", [1e30, 2**31, "99999999999999999999"])
def test_absurd_counts_are_refused_before_the_prefill(value: Any) -> None:
    """Finding 6: max_tokens of 1e30 passed the proxy's checks; vLLM refused it only after the prefill ran."""
    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "max_tokens": value})
        assert status == 400 and "max_tokens must be an integer from 1 to 2147483647" in body["error"]["message"]
        assert not env.prefill[0].received

    run(test)


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_invalid_json_is_400(body: bytes) -> None:
    async def test(env: Environment) -> None:
        status, _, answer = await env.post("/v1/chat/completions", body)
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
        assert not env.prefill[0].received and not env.decode[0].received

    run(test)


@pytest.mark.parametrize(("path", "change", "field"), [
    ("/v1/completions", {"max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"stream": "maybe"}, "stream"),
    ("/v1/completions", {"model": 7}, "model"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
])
def test_proxy_edges_a_request_vllm_would_refuse_is_refused_before_the_prefill(path: str, change: dict, field: str):
    """Hardening finding 5: a bad max_tokens used to be prefilled, then refused by the decode side (an orphan entry on
    the producer each time). Now: 400 naming the field, nothing sent upstream, and a valid request is still served."""
    base = CHAT if path.endswith("chat/completions") else COMPLETION

    async def test(env: Environment) -> None:
        status, _, answer = await env.post(path, {**base, **change})
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
        assert field in answer["error"]["message"]
        assert not env.prefill[0].received and not env.decode[0].received
        assert (await env.post(path, base))[0] == 200
        await assert_idle(env)

    run(test)


def test_proxy_edges_what_vllm_accepts_passes() -> None:
    """Lax numbers as vLLM's request model reads them, a null stream, and prompt_embeds instead of a prompt."""

    async def test(env: Environment) -> None:
        for change in ({"max_tokens": "16"}, {"max_tokens": 16.0, "n": "1"}, {"stream": None},
                       {"prompt": None, "prompt_embeds": "base64..."}):
            assert (await env.post("/v1/completions", {**COMPLETION, **change}))[0] == 200, change
        assert len(env.prefill[0].received) == 4

    run(test)


@pytest.mark.parametrize("stream", ["true", "True", "1", 1, "yes", "on", 1.0])
def test_proxy_edges_stream_is_read_as_vllm_reads_it(stream: Any) -> None:
    """Hardening finding 5: ``"stream": "true"`` (vLLM takes it as true) was treated as non-streaming and cut by the
    total timeout. Now it is relayed as a stream: 8 chunks 0.5 s apart pass a 3 s timeout between chunks (the
    whole stream takes longer than that; the margin per gap is wide: under the suite's load a gap took over 2 s)."""

    async def test(env: Environment) -> None:
        env.decode[0].chunk_delay = 0.5
        env.decode[0].chunks = ["a", "b", "c", "d", "e", "f", "g", "h"]
        async with env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": stream}) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            events = await read_sse(response)
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a", "b", "c", "d", "e", "f", "g", "h"]
        assert env.prefill[0].received[0].body["stream"] is False

    run(test, timeout=3.0)


def test_proxy_edges_deeply_nested_json_is_a_400_json_error() -> None:
    """Hardening finding 5: 100,000-deep JSON answered 500 with an HTML page."""

    async def test(env: Environment) -> None:
        status, headers, answer = await env.post("/v1/completions", b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and headers["Content-Type"].startswith("application/json")
        assert "nested too deeply" in answer["error"]["message"]
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200

    run(test)
