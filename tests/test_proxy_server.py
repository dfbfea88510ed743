"""The disaggregation proxy over real HTTP: fake vLLM upstreams (aiohttp), the proxy served by Hypercorn, an aiohttp
client, all on 127.0.0.1 in one event loop per test (``asyncio.run``)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.config import ConfigError, ProxyConfig, normalize_upstream_url, parse_args
from tests.proxy_upstreams import Environment, FakeBootstrap, FakeUpstream, environment, unused_port

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "mooncake_push_to": []}  # what the proxy adds
# to every prefill (no push target: these decode instances do not say they take pushed KV)
COMPLETION = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0.0}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
        "max_completion_tokens": 16}


def run(test: Callable[..., Awaitable[None]], *args: Any, **options: Any) -> None:
    """Run ``test(env)`` in a fresh event loop with ``environment(*args, **options)``."""

    async def body() -> None:
        async with environment(*args, **options) as env:
            await asyncio.wait_for(test(env), 30)

    asyncio.run(body())


async def read_sse(response: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of an SSE body, read to the end."""
    text = (await response.read()).decode()
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def assert_idle(env: Environment) -> None:
    """No request outstanding in the proxy and no connection checked out of its pool."""
    assert env.proxy.proxy.outstanding() == {"prefill": 0, "decode": 0}
    connector = env.proxy.proxy.session.connector
    assert connector is not None and not getattr(connector, "_acquired", set())


# --- configuration ------------------------------------------------------------------------------------------------


def test_url_validation() -> None:
    assert normalize_upstream_url("http://10.0.0.1:8100/") == "http://10.0.0.1:8100"
    assert normalize_upstream_url("https://[::1]:443") == "https://[::1]:443"
    for bad in ("10.0.0.1:8100", "ftp://h:1", "http://h", "http://:80", "http://h:99999", "http://h:80/v1", "http://h:x"):
        with pytest.raises(ConfigError, match="invalid upstream URL"):
            normalize_upstream_url(bad)
    with pytest.raises(ConfigError, match="--decode"):
        ProxyConfig(prefill=("http://h:1",), decode=())
    with pytest.raises(ConfigError, match="timeout"):
        ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), timeout=0)
    with pytest.raises(ConfigError, match="protocol must be one of params, bootstrap"):
        ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), protocol="nixl")
    with pytest.raises(ConfigError, match="only with --protocol bootstrap"):
        ProxyConfig(prefill=("http://h:1",), decode=("http://h:2",), bootstrap=("http://h:8998",))
    with pytest.raises(ConfigError, match="one --bootstrap URL per --prefill URL"):
        ProxyConfig(prefill=("http://h:1", "http://g:1"), decode=("http://h:2",), protocol="bootstrap",
                    bootstrap=("http://h:8998",))
    config = ProxyConfig(prefill=("http://h:1", "http://[::1]:1"), decode=("http://h:2",), protocol="bootstrap")
    assert [config.bootstrap_url(u) for u in config.prefill] == ["http://h:8998", "http://[::1]:8998"]


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(["--prefill", "http://a:1", "--prefill", "http://b:2", "--decode", "http://c:3", "--port", "9"])
    assert config.prefill == ("http://a:1", "http://b:2") and config.decode == ("http://c:3",)
    assert (config.host, config.port, config.cooldown) == ("127.0.0.1", 9, 5.0)
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--prefill", "a:1", "--decode", "http://c:3"])
    assert exit_info.value.code == 2
    assert "invalid upstream URL 'a:1'" in capsys.readouterr().err


async def start_main(env: Environment, *args: str, **options: Any) -> tuple[asyncio.subprocess.Process, str]:
    """``proxy_server.main()`` in a subprocess in front of ``env``'s first instances, with ``args``; returns it and
    its URL once its /health answers."""
    port = unused_port()
    url = f"http://127.0.0.1:{port}"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import proxy_server; proxy_server.main()", "--prefill", env.prefill[0].url,
        "--decode", env.decode[0].url, "--port", str(port), *args, cwd=ROOT, **options)
    deadline = time.monotonic() + 20
    while True:
        assert process.returncode is None and time.monotonic() < deadline
        try:
            async with env.client.get(url + "/health") as response:
                assert response.status == 200
                return process, url
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)


def test_main_serves_in_a_subprocess() -> None:
    """The console script's entry point: serves on --host/--port, and exits cleanly on SIGTERM."""

    async def test(env: Environment) -> None:
        process, url = await start_main(env, "--log-level", "WARNING")
        try:
            async with env.client.post(url + "/v1/completions", json=COMPLETION) as response:
                assert response.status == 200 and (await response.json())["served_by"] == "D0"
        finally:
            if process.returncode is None:
                process.terminate()
        assert await asyncio.wait_for(process.wait(), 10) == 0

    run(test)


def test_slow_clients_under_a_low_open_file_limit_do_not_starve_the_others() -> None:
    """Finding 6: with no cap on client connections and slow bodies allowed --timeout (300 s), 300 slow clients
    under a 256-file limit made normal requests time out and logged 110,450 accept errors in 10 s. Now at most
    --max-clients connections are open, a new one takes the place of the oldest with no request under way, and a
    request head must arrive within --client-timeout."""

    async def test(env: Environment) -> None:
        process, url = await start_main(env, "--max-clients", "100", "--client-timeout", "3",
                                        stderr=asyncio.subprocess.PIPE,
                                        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
        port = int(url.rsplit(":", 1)[1])
        slow: list[socket.socket] = []
        try:
            for _ in range(300):  # a head that never ends
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                slow.append(sock)
            await asyncio.sleep(0.5)
            fds = len(os.listdir(f"/proc/{process.pid}/fd"))
            assert fds < 200, f"the proxy holds {fds} files"
            start = time.monotonic()
            for _ in range(5):
                async with env.client.post(url + "/v1/completions", json=COMPLETION) as response:
                    assert response.status == 200
            assert time.monotonic() - start < 5.0  # at once, not after the slow clients' deadline
            await asyncio.sleep(4.0)  # --client-timeout: every slow head is closed by now
            assert all(_closed(sock) for sock in slow)
        finally:
            for sock in slow:
                sock.close()
            if process.returncode is None:
                process.terminate()
        _, err = await process.communicate()
        assert err.count(b"Too many open files") == 0 and err.count(b"accept") < 10, err[-2000:]

    run(test)


def test_answers_longer_than_the_client_timeout_are_not_cut() -> None:
    """--client-timeout bounds what a client sends (a request's head and body) and idle connections, never how long
    the client waits for an answer or a stream while sending nothing."""
    async def test(env: Environment) -> None:
        env.decode[0].delay = 2.5
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        env.decode[0].delay, env.decode[0].chunk_delay = 0.0, 1.0
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and "[DONE]" in body

    run(test, client_timeout=1.0)


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@pytest.mark.parametrize("value", [1e30, 2**31, "99999999999999999999"])
def test_absurd_counts_are_refused_before_the_prefill(value: Any) -> None:
    """Finding 6: max_tokens of 1e30 passed the proxy's checks; vLLM refused it only after the prefill ran."""
    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "max_tokens": value})
        assert status == 400 and "max_tokens must be an integer from 1 to 2147483647" in body["error"]["message"]
        assert not env.prefill[0].received

    run(test)


# --- the flow -----------------------------------------------------------------------------------------------------


def test_completion_prefill_then_decode() -> None:
    async def test(env: Environment) -> None:
        status, headers, body = await env.post("/v1/completions", COMPLETION)
        assert status == 200 and body["served_by"] == "D0"
        assert env.journal == [("P0", "start"), ("P0", "end"), ("D0", "start"), ("D0", "end")]
        (prefill,), (decode,) = env.prefill[0].received, env.decode[0].received
        assert prefill.path == decode.path == "/v1/completions"
        assert prefill.body == {**COMPLETION, "max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        assert decode.body == COMPLETION
        assert_idle(env)

    run(test)


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
        assert env.prefill[0].received[0].body == {**COMPLETION, "max_tokens": 1, "stream": False,
                                                   "kv_transfer_params": REMOTE_DECODE}
        assert env.decode[0].received[0].body == request
        assert_idle(env)

    run(test)


def test_chat_completion() -> None:
    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200 and body.endswith("data: [DONE]\n\n")
        (prefill,), (decode,) = env.prefill[0].received, env.decode[0].received
        assert prefill.path == decode.path == "/v1/chat/completions"
        assert prefill.body == {**CHAT, "max_tokens": 1, "max_completion_tokens": 1, "stream": False,
                                "kv_transfer_params": REMOTE_DECODE}
        assert decode.body == {**CHAT, "stream": True}

    run(test)


def test_kv_transfer_params_forwarded_to_decode() -> None:
    params = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2, 3]}

    async def test(env: Environment) -> None:
        env.prefill[0].kv_params = params
        status, _, _ = await env.post("/v1/completions", COMPLETION)
        assert status == 200
        assert env.decode[0].received[0].body == {**COMPLETION, "kv_transfer_params": params}

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
        env.prefill[0].kv_params = None  # a prefill that answers without params
        assert (await env.post("/v1/completions", {**COMPLETION, "kv_transfer_params": client}))[0] == 200
        assert [r.body["kv_transfer_params"] for r in env.prefill[0].received] == [REMOTE_DECODE] * 2
        assert env.decode[0].received[0].body["kv_transfer_params"] == params
        assert "kv_transfer_params" not in env.decode[0].received[1].body
        async with env.client.get(env.url + "/metrics") as response:
            text = await response.text()
        assert "mooncake_proxy_client_kv_params_dropped_total 2.0" in text, text

    run(test)


def endpoint_info(mode: str, pipes: str, role: str = "kv_consumer") -> str:
    """A vLLM /metrics text with our connector's endpoint info (as kv_connector/stats.py exports it)."""
    return ("# HELP vllm:num_requests_running Number of requests.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
            "# HELP vllm:mooncake_kv_endpoint_info This instance's MooncakeConnector endpoint.\n"
            "# TYPE vllm:mooncake_kv_endpoint_info gauge\n"
            f'vllm:mooncake_kv_endpoint_info{{engine="0",kv_engine_id="e",kv_role="{role}",model_name="m",'
            f'pipes="{pipes}",transfer_mode="{mode}"}} 1.0\n')


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
        assert all(r.body["kv_transfer_params"]["do_remote_decode"] is True for r in env.prefill[0].received)
        sent = [r.body["kv_transfer_params"].get("mooncake_push_to") for r in env.prefill[0].received]
        assert sent == [["10.0.0.5:17100", "10.0.0.5:17101"], [], []] * 2
        assert [len(d.received) for d in env.decode] == [2, 2, 2]
        assert [d.metrics_requests for d in env.decode] == [1, 1, 1]
        # the same at once: requests in flight while /metrics is read share one read
        env.proxy.proxy.decode_balancer.upstreams[0].learned_at = None
        statuses = await asyncio.gather(*(env.post("/v1/completions", COMPLETION) for _ in range(9)))
        assert [s[0] for s in statuses] == [200] * 9 and env.decode[0].metrics_requests == 2

    run(test, 1, 3)


def test_a_push_address_goes_with_its_proof() -> None:
    """With a secret, a consumer publishes a proof of its push address; the proxy passes it on to the producer."""
    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17100").replace(
            'transfer_mode="push"', 'push_proof="ab12",transfer_mode="push"')
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        params = env.prefill[0].received[0].body["kv_transfer_params"]
        assert params["mooncake_push_to"] == ["10.0.0.5:17100"] and params["mooncake_push_proof"] == "ab12"

    run(test)


def test_push_address_answered_by_a_producer_or_garbage_is_ignored() -> None:
    async def test(env: Environment) -> None:
        env.decode[0].metrics_text = endpoint_info("push", "10.0.0.5:17000", role="kv_producer") + "garbage{ 1\n"
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        assert env.prefill[0].received[0].body["kv_transfer_params"]["mooncake_push_to"] == []

    run(test)


def test_bootstrap_protocol_for_vllms_builtin_mooncake_connector() -> None:
    """--protocol bootstrap: one transfer id on both requests; the decode names the prefill instance's bootstrap
    server and its engine id (read once from /query); the prefill answer's params are not used."""

    async def test(env: Environment) -> None:
        bootstrap = await FakeBootstrap({"0": {"engine_id": "prefill-engine", "worker_addr": {"0": {"0": "x"}}}}).start()
        try:
            env.proxy.proxy.config.__dict__["bootstrap"] = (bootstrap.url,)
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
        # a bootstrap server that is gone (the cached engine id expired): 502 naming it, and nothing sent upstream:
        # the engine id is asked before the prefill, so no prefilled KV waits for a decode that never comes
        env.proxy.proxy.prefill_balancer.upstreams[0].learned_at = None
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 502 and "bootstrap server of prefill instance 0" in body["error"]["message"]
        assert body["error"]["stage"] == "prefill" and bootstrap.url not in json.dumps(body)  # internal addresses
        assert len(env.prefill[0].received) == 2 and len(env.decode[0].received) == 2
        assert_idle(env)

    run(test, protocol="bootstrap", bootstrap=(f"http://127.0.0.1:{unused_port()}",))


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
        assert_idle(env)

    run(test, 2, 2)


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


# --- errors -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", ["prefill", "decode"])
@pytest.mark.parametrize("status", [400, 422, 500, 503])
def test_upstream_error_status_relayed(stage: str, status: int) -> None:
    error = {"error": {"message": f"bad thing {status}", "type": "BadRequestError", "code": status}}

    async def test(env: Environment) -> None:
        upstream = (env.prefill if stage == "prefill" else env.decode)[0]
        upstream.status, upstream.error_body = status, error
        got_status, headers, body = await env.post("/v1/completions", COMPLETION)
        assert (got_status, body) == (status, error) and headers["Content-Type"].startswith("application/json")
        assert len(env.decode[0].received) == (0 if stage == "prefill" else 1)
        assert_idle(env)

    run(test)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_unreachable_upstream_is_502_naming_the_stage(stage: str) -> None:
    dead = f"http://127.0.0.1:{unused_port()}"

    async def test(env: Environment) -> None:
        status, _, body = await env.post("/v1/completions", COMPLETION)
        assert status == 502 and body["error"]["stage"] == stage and body["error"]["upstream"] == f"{stage} instance 0"
        assert dead.split("//")[1] not in json.dumps(body)  # finding 6: the 502 named the internal URL
        if stage == "prefill":
            assert not env.decode[0].received
        assert_idle(env)

    if stage == "prefill":
        run(test, 0, 1, prefill_urls=[dead])
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
        assert_idle(env)

    run(test, timeout=0.5)


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
        assert_idle(env)

    run(test, timeout=0.5)


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
        assert_idle(env)

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
    total timeout. Now it is relayed as a stream: 4 chunks 0.3 s apart pass a 0.5 s timeout between chunks."""

    async def test(env: Environment) -> None:
        env.decode[0].chunk_delay = 0.3
        env.decode[0].chunks = ["a", "b", "c", "d"]
        async with env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": stream}) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            events = await read_sse(response)
        assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a", "b", "c", "d"]
        assert env.prefill[0].received[0].body["stream"] is False

    run(test, timeout=0.5)


def test_proxy_edges_deeply_nested_json_is_a_400_json_error() -> None:
    """Hardening finding 5: 100,000-deep JSON answered 500 with an HTML page."""

    async def test(env: Environment) -> None:
        status, headers, answer = await env.post("/v1/completions", b"[" * 100_000 + b"]" * 100_000)
        assert status == 400 and headers["Content-Type"].startswith("application/json")
        assert "nested too deeply" in answer["error"]["message"]
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200

    run(test)


def test_proxy_edges_timeouts_are_documented_options(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_args(["--prefill", "http://a:1", "--decode", "http://c:3", "--connect-timeout", "2.5"])
    assert (config.connect_timeout, config.timeout) == (2.5, 300.0)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "http://a:1", "--decode", "http://c:3", "--timeout", "nan"])
    assert "timeout must be seconds > 0" in capsys.readouterr().err


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
            await asyncio.sleep(0.7)  # > cooldown
            for _ in range(2):
                assert (await env.post("/v1/completions", COMPLETION))[0] == 200
            assert len(revived.received) == 1 and len(env.prefill[0].received) == 5
            assert balancer.upstreams[0].failures == 1
        finally:
            await revived.stop()

    run(test, 1, 1, prefill_urls=[dead], cooldown=0.5)


def test_client_disconnect_during_prefill_cancels_it() -> None:
    async def test(env: Environment) -> None:
        env.prefill[0].delay = 10.0
        request = asyncio.create_task(env.post("/v1/completions", COMPLETION))
        await asyncio.wait_for(env.prefill[0].started.wait(), 5)
        request.cancel()  # closes the client connection
        await asyncio.wait_for(env.prefill[0].cancelled.wait(), 5)
        assert env.prefill[0].received[0].cancelled and not env.decode[0].received
        await wait_until(lambda: env.proxy.proxy.outstanding() == {"prefill": 0, "decode": 0})
        assert_idle(env)

    run(test)


def test_client_disconnect_during_stream_cancels_decode() -> None:
    async def test(env: Environment) -> None:
        env.decode[0].hold_last = asyncio.Event()  # never set: the upstream waits forever
        response = await env.client.post(env.url + "/v1/completions", json={**COMPLETION, "stream": True})
        await asyncio.wait_for(response.content.readuntil(b"\n\n"), 5)
        response.close()
        await asyncio.wait_for(env.decode[0].cancelled.wait(), 5)
        assert env.decode[0].received[0].cancelled
        await wait_until(lambda: env.proxy.proxy.outstanding() == {"prefill": 0, "decode": 0})
        assert_idle(env)

    run(test)


# --- load ---------------------------------------------------------------------------------------------------------


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
        assert_idle(env)

    run(test, 2, 2)
