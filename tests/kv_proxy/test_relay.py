"""kv_proxy/relay.py: streamed answers relayed chunk by chunk, a stalled stream ended with an error event, a client that
leaves mid-stream cancelling the decode, many streams at once. Real HTTP through the proxy."""

from __future__ import annotations

import asyncio
import json

import pytest

from kv_proxy.relay import error_event
from tests.kv_proxy.upstreams import (
    COMPLETION,
    PRODUCER_ANSWER,
    REMOTE_DECODE,
    Environment,
    assert_idle,
    outstanding,
    read_sse,
    run,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)


def test_streaming_chunks_pass_through_before_the_upstream_finishes() -> None:
    async def test(env: Environment) -> None:
        release = asyncio.Event()
        env.decode[0].hold_last = release
        request = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        async with env.client.post(env.url + "/v1/completions", json=request) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)  # the upstream still holds "!"
            assert json.loads(first.decode()[len("data: "):])["choices"][0]["text"] == "Hello"
            assert not release.is_set() and ("D0", "end") not in env.journal
            release.set()
            rest = await read_sse(response)
        assert [json.loads(d)["choices"][0]["text"] for d in rest[:-1]] == [" world", "!"] and rest[-1] == "[DONE]"
        assert env.prefill[0].received[0].body == {**COMPLETION, "max_tokens": 1, "n": 1, "stream": False,
                                                   "kv_transfer_params": REMOTE_DECODE}
        assert env.decode[0].received[0].body == {**request, "kv_transfer_params": {**PRODUCER_ANSWER,
                                                                                      "remote_engine_id": "P0"}}
        await assert_idle(env)

    run(test)


def test_stream_stalling_mid_way_ends_with_an_error_event() -> None:
    async def test(env: Environment) -> None:
        env.decode[0].hold_last = asyncio.Event()  # never set: the upstream stalls before its last chunk
        async with env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": True}) as response:
            assert response.status == 200
            data = await read_sse(response)
        assert [json.loads(d)["choices"][0]["text"] for d in data[:2]] == ["Hello", " world"]
        error = json.loads(data[2])["error"]
        assert (error["stage"], error["code"], len(data)) == ("decode", 504, 3)
        await asyncio.wait_for(env.decode[0].cancelled.wait(), 5)
        await assert_idle(env)

    run(test, timeout=0.5)


def test_client_disconnect_during_stream_cancels_decode() -> None:
    async def test(env: Environment) -> None:
        env.decode[0].hold_last = asyncio.Event()  # never set: the upstream waits forever
        response = await env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": True})
        await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
        response.close()
        await asyncio.wait_for(env.decode[0].cancelled.wait(), 5)
        assert env.decode[0].received[0].cancelled
        await wait_until(lambda: outstanding(env.proxy.proxy) == {"prefill": 0, "decode": 0})
        await assert_idle(env)

    run(test)


def test_200_concurrent_streams() -> None:
    async def one(env: Environment, index: int) -> None:
        request = {**COMPLETION, "prompt": f"request {index}", "stream": True}
        async with env.client.post(env.url + "/v1/completions", json=request) as response:
            assert response.status == 200
            data = await read_sse(response)
        assert data[-1] == "[DONE]" and len(data) == 4

    async def test(env: Environment) -> None:
        await asyncio.gather(*(one(env, i) for i in range(200)))
        prompts = {r.body["prompt"] for u in env.decode for r in u.received}
        assert prompts == {f"request {i}" for i in range(200)}
        assert sum(len(u.received) for u in env.prefill) == 200
        assert all(len(u.received) > 50 for u in env.prefill + env.decode)  # spread over both instances
        await assert_idle(env)

    run(test, 2, 2)


@pytest.mark.parametrize("stream, reason", [
    (b'data: {"error": {"message": "Internal server error", "code": 500}}\n\n', "stream_error_500"),
    (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n'
     b'data: {"error": {"message": "Internal server error", "code": 500}}\n\n', "stream_error_500"),  # chat's role first
    (b': keep-alive\r\n\r\ndata: {"error": {"message": "x"}}\r\n\r\n', "stream_error"),
    (b'data: {"error": {"message": "bad request", "code": 400}}\n\n', None),  # the retry would meet it again
    (b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n\ndata: {"error": {"code": 500}}\n\n', None),  # a token first
    (b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\n\n', None),
    (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}\n\n',
     None),  # nothing yet: no error either
])
def test_an_error_before_the_first_token_is_told_from_the_stream_start(stream: bytes, reason: str | None) -> None:
    assert error_event(stream) == reason


def test_a_decode_that_dies_mid_event_gives_the_client_whole_events_and_a_whole_error() -> None:
    """#46: the decode closed its connection in the middle of an event: the client got half the event glued to the
    proxy's error event (invalid JSON: an OpenAI client raised a decode error and never saw the 502). Now the half
    event is dropped and every event the client gets parses."""
    async def test(env: Environment) -> None:
        env.decode[0].break_mid_event = True
        async with env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": True}) as response:
            assert response.status == 200
            events = await read_sse(response)
        parsed = [json.loads(e) for e in events]  # every event parses
        assert [p["choices"][0]["text"] for p in parsed[:-1]] == ["Hello", " world", "!"]
        assert parsed[-1]["error"]["code"] == 502, parsed[-1]

    run(test)


def test_a_whole_answer_is_relayed_as_it_comes_not_read_first() -> None:
    """#46 finding 3: a non-streamed decode's answer was read whole before any of it went out (a 1 GiB answer: 3.7 GB
    in the proxy, the loop blocked 6 s). Now it is relayed as it comes: the client reads the first half of a 16 MiB
    answer while the instance still holds the rest back, and the whole arrives exactly."""
    answer = json.dumps({"choices": [{"index": 0, "text": "x" * (16 << 20)}]}).encode()

    async def test(env: Environment) -> None:
        release = asyncio.Event()
        env.decode[0].raw_answer, env.decode[0].hold_last = answer, release
        async with env.client.post(env.url + "/v1/completions", json=COMPLETION) as response:
            assert response.status == 200
            first = await asyncio.wait_for(response.content.readexactly(len(answer) // 2), 10)
            assert not release.is_set()  # the instance has not sent the rest yet
            release.set()
            rest = await response.content.read()
        assert first + rest == answer
        await assert_idle(env)

    run(test)
