"""kv_proxy/admin.py: instances added and removed while the proxy serves, behind a token. Real HTTP through the proxy."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from tests.kv_proxy.upstreams import (
    COMPLETION,
    Environment,
    FakeUpstream,
    assert_idle,
    proxy_metric,
    read_sse,
    run,
    text_of,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

TOKEN = "test-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PATH = "/admin/instances"


async def admin(env: Environment, method: str, body: Any = None, headers: dict[str, str] | None = None,
                ) -> tuple[int, Any]:
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    async with env.client.request(method, env.url + PATH, data=data,
                                  headers=AUTH if headers is None else headers) as response:
        text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:
            return response.status, text


def test_without_a_token_there_is_no_admin_endpoint() -> None:
    async def test(env: Environment) -> None:
        for method in ("GET", "POST", "DELETE"):
            status, _ = await admin(env, method, {"role": "decode", "url": env.decode[0].url})
            assert status == 404
        assert len(env.proxy.proxy.decode_balancer.upstreams) == 1
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200

    run(test)


def test_a_missing_or_wrong_token_is_refused_and_the_proxy_keeps_serving(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def test(env: Environment) -> None:
        body = {"role": "decode", "url": "http://127.0.0.1:1"}
        async with env.client.get(env.url + PATH) as response:
            assert response.status == 401 and response.headers["WWW-Authenticate"].startswith("Bearer")
        for headers in ({"Authorization": "Bearer wrong-token-0123456789abcdef"}, {"Authorization": f"Basic {TOKEN}"},
                        {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": "Bearer"}):
            for method in ("GET", "POST", "DELETE"):
                status, answer = await admin(env, method, body, headers)
                assert status == 403 and answer["error"]["type"] == "forbidden", (headers, method, answer)
        assert [u.url for u in env.proxy.proxy.decode_balancer.upstreams] == [env.decode[0].url]
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        status, listing = await admin(env, "GET")
        assert status == 200 and [d["url"] for d in listing["decode"]] == [env.decode[0].url]
        assert listing["prefill"][0]["instance"] == 0 and listing["draining"] == []

    run(test, admin_token=TOKEN)
    assert TOKEN not in caplog.text and "admin: refused" in caplog.text


@pytest.mark.parametrize("body, message", [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({}, "role must be"),
    ({"role": "decode"}, "url must be a URL string"),
    ({"role": "router", "url": "http://h:1"}, "role must be"),
    ({"role": "decode", "url": 5}, "url must be a URL string"),
    ({"role": "decode", "url": "ftp://h:1"}, "scheme must be http or https"),
    ({"role": "decode", "url": "http://h"}, "missing port"),
    ({"role": "decode", "url": "http://h:1/v1"}, "no path"),
    ({"role": "decode", "url": "http://h:" + "1" * 3000}, "at most 2048"),
    ({"role": "decode", "url": "http://h:1", "weight": 2}, "unknown field"),
    ({"role": "prefill", "url": "http://h:1", "bootstrap": "http://h:8998"}, "unknown field"),  # --protocol params
])
def test_malformed_admin_bodies_are_400(body: Any, message: str) -> None:
    async def test(env: Environment) -> None:
        for method in ("POST", "DELETE"):
            status, answer = await admin(env, method, body)
            assert status == 400 and message in answer["error"]["message"], answer
        status, listing = await admin(env, "GET")
        assert [len(listing["prefill"]), len(listing["decode"])] == [1, 1]

    run(test, admin_token=TOKEN)


def test_instances_added_and_removed_under_concurrent_traffic() -> None:
    """Eight clients send requests all along. P1 and D2 are added: they get requests. P0 and D0 are removed: no
    request that started after the removal answered reaches them, and no request fails."""

    async def test(env: Environment) -> None:
        extra = [await FakeUpstream(name, env.journal).start() for name in ("P1", "D2")]
        for upstream in env.decode + extra:
            upstream.delay = 0.005
        after_removal: set[str] = set()
        removed = asyncio.Event()
        stop = asyncio.Event()
        statuses: list[int] = []

        async def client(worker: int) -> None:
            n = 0
            while not stop.is_set():
                request_id = f"w{worker}-{n}"
                n += 1
                if removed.is_set():
                    after_removal.add(request_id)
                prompt = text_of(1000 * worker + n, 700)  # nothing shared: the balance rule spreads them
                status, _, _ = await env.post("/v1/completions", {**COMPLETION, "prompt": prompt},
                                              headers={"X-Request-Id": request_id})
                statuses.append(status)

        try:
            clients = [asyncio.create_task(client(w)) for w in range(8)]
            await wait_until(lambda: len(statuses) >= 20)
            for role, upstream in (("prefill", extra[0]), ("decode", extra[1])):
                status, answer = await admin(env, "POST", {"role": role, "url": upstream.url + "/"})
                assert status == 201 and answer["url"] == upstream.url and answer["outstanding"] == 0
            await wait_until(lambda: len(extra[0].completions()) >= 5 and len(extra[1].completions()) >= 5)
            for role, upstream in (("prefill", env.prefill[0]), ("decode", env.decode[0])):
                status, answer = await admin(env, "DELETE", {"role": role, "url": upstream.url})
                assert status == 200 and answer["instance"] == 0
            removed.set()
            await wait_until(lambda: len(after_removal) >= 40)
            stop.set()
            await asyncio.gather(*clients)
            assert statuses and all(s == 200 for s in statuses)
            for gone in (env.prefill[0], env.decode[0]):
                seen = {r.headers["X-Request-Id"] for r in gone.completions()}
                assert seen and not seen & after_removal
            served = {r.headers["X-Request-Id"] for u in (extra[1], env.decode[1]) for r in u.completions()}
            assert after_removal <= served
            status, listing = await admin(env, "GET")
            assert [[d["url"] for d in listing[role]] for role in ("prefill", "decode")] == \
                [[extra[0].url], [env.decode[1].url, extra[1].url]]
            assert [d["instance"] for d in listing["decode"]] == [1, 2]
            await assert_idle(env)
        finally:
            stop.set()
            for upstream in extra:
                await upstream.stop()

    run(test, 1, 2, admin_token=TOKEN)


def test_removal_lets_requests_in_flight_finish_and_is_refused_for_the_last_instance() -> None:
    shared = text_of(3, 2048)

    async def test(env: Environment) -> None:
        d0, d1 = env.decode
        d0.hold_last = hold = asyncio.Event()
        async with env.client.post(env.url + "/v1/completions",
                                   json={**COMPLETION, "prompt": shared, "stream": True}) as stream:
            await stream.content.readuntil(b"\n\n")
            status, answer = await admin(env, "DELETE", {"role": "decode", "url": d0.url})
            assert status == 200 and answer["outstanding"] == 1
            status, listing = await admin(env, "GET")
            assert [d["url"] for d in listing["draining"]] == [d0.url]
            assert (await env.post("/v1/completions", {**COMPLETION, "prompt": shared}))[2]["served_by"] == "D1"
            hold.set()
            events = await read_sse(stream)
            assert events[-1] == "[DONE]" and len(events) == 3  # the first one was read above
        status, listing = await admin(env, "GET")
        assert listing["draining"] == [] and [d["url"] for d in listing["decode"]] == [d1.url]
        status, answer = await admin(env, "DELETE", {"role": "decode", "url": d1.url})
        assert status == 409 and "last decode instance" in answer["error"]["message"]
        status, answer = await admin(env, "DELETE", {"role": "decode", "url": d0.url})
        assert status == 404
        status, answer = await admin(env, "POST", {"role": "decode", "url": d1.url})
        assert status == 409 and "already" in answer["error"]["message"]
        # D0 back: a new instance (a new number, nothing indexed), not preferred for what it held before
        status, answer = await admin(env, "POST", {"role": "decode", "url": d0.url})
        assert status == 201 and answer["instance"] == 2 and answer["prefix_chunks"] == 0
        before = await proxy_metric(env, "mooncake_proxy_routed_total", role="decode", rule="prefix")
        for _ in range(2):
            status, _, body = await env.post("/v1/completions", {**COMPLETION, "prompt": shared + " again"})
            assert status == 200 and body["served_by"] == "D1"  # D1 holds it since the request above
        assert await proxy_metric(env, "mooncake_proxy_routed_total", role="decode", rule="prefix") == before + 2
        await assert_idle(env)

    run(test, 1, 2, admin_token=TOKEN)


def test_a_prefill_instance_added_with_its_bootstrap_server() -> None:
    async def test(env: Environment) -> None:
        status, answer = await admin(env, "POST", {"role": "prefill", "url": "http://10.0.0.7:8100",
                                                   "bootstrap": "http://10.0.0.7:9000"})
        assert status == 201 and answer["bootstrap"] == "http://10.0.0.7:9000"
        status, answer = await admin(env, "POST", {"role": "prefill", "url": "http://10.0.0.8:8100"})
        assert status == 201 and answer["bootstrap"] == "http://10.0.0.8:8998"
        status, answer = await admin(env, "POST", {"role": "decode", "url": "http://10.0.0.9:8200",
                                                   "bootstrap": "http://10.0.0.9:9000"})
        assert status == 400 and "prefill instances only" in answer["error"]["message"]

    run(test, admin_token=TOKEN, protocol="bootstrap")
