"""Real HTTP pieces for the proxy tests: fake vLLM upstreams (aiohttp web servers), the proxy served in-process (or
by ``proxy_server.main()`` in a subprocess), and what the tests share (``run``, requests, checks).

Everything binds 127.0.0.1 on a port chosen by the kernel (the proxy gets an already bound socket, so no race).
An upstream records each request it receives (path, headers, JSON body), whether its handler was cancelled (the
peer closed the connection), and appends ``(name, "start"|"end")`` to a journal shared by all upstreams.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from kv_connector.param_keys import DO_REMOTE_DECODE, DO_REMOTE_PREFILL, ENDPOINT_INFO, POOL_LABEL, PUSH_TO
from kv_proxy.app import Proxy, create_app
from kv_proxy.config import ProxyConfig
from kv_proxy.gate import ClientGate

HOST = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent.parent

PRODUCER_ANSWER = {DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, "remote_pipe": ["127.0.0.1:13003"],
                   "remote_tp_size": 1}  # what a MooncakeConnector producer answers a prefill with (its pipe)
REMOTE_DECODE = {DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False, PUSH_TO: []}  # what the proxy adds to every
# prefill (no push target: these decode instances do not say they take pushed KV)
COMPLETION = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 32, "temperature": 0.0}
# what vLLM answers (or streams as an event) for a request that failed inside the engine, e.g. its KV load under the
# "fail" policy (vllm/entrypoints/generate/base/serving.py, GenerationError)
VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
ROLE_DELTA = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "fake-model",
              "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
        "max_completion_tokens": 16}


@dataclass
class Received:
    path: str
    headers: CIMultiDict[str]
    body: Any
    cancelled: bool = False


@dataclass(eq=False)
class FakeUpstream:
    """A vLLM-like OpenAI server. Knobs: ``status``/``error_body`` (answer with an error), ``delay`` (seconds before
    answering), ``compute_per_char`` (a prefill's cost), ``kv_params`` (added to non-streaming answers), ``chunks``
    (SSE data of a streaming answer) and ``hold_last`` (an event awaited before the last chunk)."""

    name: str
    journal: list[tuple[str, str]] = field(default_factory=list)
    status: int = 200
    error_body: dict[str, Any] | None = None
    delay: float = 0.0
    kv_params: Any = None
    chunks: list[str] = field(default_factory=lambda: ["Hello", " world", "!"])
    hold_last: asyncio.Event | None = None
    chunk_delay: float = 0.0  # seconds before each streamed chunk
    health_status: int = 200
    metrics_text: str | None = None  # the body of GET /metrics (404 if None)
    metrics_requests: int = 0
    chars_per_token: float | None = None  # non-streaming answers say usage.prompt_tokens (a string prompt's length / it)
    compute_per_char: float = 0.0  # seconds per character of a prompt it computes, one prompt at a time (as an
    # engine's prefills are); a decode whose kv_transfer_params load the prompt's KV computes nothing
    answers_params: bool = True  # a prefill (do_remote_decode) is answered with a producer's params, as MooncakeConnector
    # answers, unless ``kv_params`` says what to answer
    failed_loads: int = 0  # the next this many decodes that load KV fail as vLLM fails a broken load under its "fail"
    # policy: a 500 answer, or a stream whose first event is the error
    error_after: int | None = None  # a stream sends this many chunks, then vLLM's error event (a failure mid-stream)
    break_mid_event: bool = False  # a stream sends its chunks, then half an event, then drops the connection
    raw_answer: bytes | None = None  # a non-streaming answer's body as is (status 200; e.g. not JSON, or huge)
    _computing: asyncio.Lock = field(default_factory=asyncio.Lock)
    received: list[Received] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def completions(self) -> list[Received]:
        return [r for r in self.received if r.path.endswith("completions")]

    async def start(self, port: int = 0) -> FakeUpstream:
        app = web.Application(client_max_size=64 << 20)  # vLLM takes large bodies: the proxy bounds them
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, port, backlog=1024)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        record = Received(request.path, request.headers.copy(), body)
        self.received.append(record)
        self.journal.append((self.name, "start"))
        self.started.set()
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            params = body.get("kv_transfer_params")
            loads = isinstance(params, dict) and params.get("do_remote_prefill")
            if self.compute_per_char and isinstance(body.get("prompt"), str) and not loads:
                async with self._computing:
                    await asyncio.sleep(self.compute_per_char * len(body["prompt"]))
            if self.status >= 400:
                return web.json_response(self.error_body or {"error": {"message": self.name}}, status=self.status)
            if loads and self.failed_loads > 0:
                self.failed_loads -= 1
                if not body.get("stream"):
                    return web.json_response(VLLM_ERROR, status=500)
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                if request.path.endswith("/chat/completions"):  # vLLM opens a chat stream with the role first
                    await response.write(f"data: {json.dumps(ROLE_DELTA)}\n\n".encode())
                await response.write(f"data: {json.dumps(VLLM_ERROR)}\n\ndata: [DONE]\n\n".encode())
                await response.write_eof()
                return response
            if body.get("stream"):
                return await self._stream(request)
            if self.raw_answer is not None and self.hold_last is None:
                return web.Response(body=self.raw_answer, content_type="application/json")
            if self.raw_answer is not None:  # its first half, then (once ``hold_last`` is set) the rest
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(request)
                half = len(self.raw_answer) // 2
                await response.write(self.raw_answer[:half])
                await self.hold_last.wait()
                await response.write(self.raw_answer[half:])
                await response.write_eof()
                return response
            answer: dict[str, Any] = {"id": f"{self.name}-1", "object": "text_completion", "served_by": self.name,
                                      "choices": [{"index": 0, "text": "".join(self.chunks)}]}
            if self.kv_params is not None:
                answer["kv_transfer_params"] = self.kv_params
            elif isinstance(params, dict) and params.get(DO_REMOTE_DECODE) and self.answers_params:
                answer["kv_transfer_params"] = {**PRODUCER_ANSWER, "remote_engine_id": self.name}
            if self.chars_per_token and isinstance(body.get("prompt"), str):
                answer["usage"] = {"prompt_tokens": round(len(body["prompt"]) / self.chars_per_token)}
            return web.json_response(answer)
        except asyncio.CancelledError:
            record.cancelled = True
            self.cancelled.set()
            raise
        finally:
            self.journal.append((self.name, "end"))

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index, text in enumerate(self.chunks):
            if index == self.error_after:
                await response.write(f"data: {json.dumps(VLLM_ERROR)}\n\n".encode())
                break
            if index == len(self.chunks) - 1 and self.hold_last is not None:
                await self.hold_last.wait()
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            event = {"served_by": self.name, "choices": [{"index": 0, "text": text}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        if self.break_mid_event:
            await response.write(b'data: {"choices": [{"index": 0, "text": "par')
            assert request.transport is not None
            request.transport.close()  # the decode instance died mid-event
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _models(self, request: web.Request) -> web.Response:
        self.received.append(Received(request.path, request.headers.copy(), None))
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "owned_by": self.name}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_requests += 1
        if self.metrics_text is None:
            return web.Response(status=404)
        return web.Response(text=self.metrics_text, content_type="text/plain")


@dataclass(eq=False)
class FakeBootstrap:
    """vLLM's MooncakeConnector bootstrap server as the proxy sees it: ``GET /query`` answers ``answer``."""

    answer: Any
    queries: int = 0
    port: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def start(self) -> FakeBootstrap:
        app = web.Application()
        app.router.add_get("/query", self._query)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _query(self, request: web.Request) -> web.Response:
        self.queries += 1
        return web.json_response(self.answer)


def unused_port() -> int:
    """A port nothing listens on (bound then released; connecting to it is refused)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class RunningProxy:
    url: str
    proxy: Proxy
    gate: ClientGate


@contextlib.asynccontextmanager
async def serve_proxy(config: ProxyConfig) -> AsyncIterator[RunningProxy]:
    """Serve ``create_app(config)`` as ``main`` does (behind its ``ClientGate``) on 127.0.0.1, a free port unless
    ``config.port`` names one, in this event loop."""
    app = create_app(config)
    gate = ClientGate(dataclasses.replace(config, host=HOST))
    port = gate.port
    stop = asyncio.Event()
    task = asyncio.create_task(gate.serve(app, shutdown_trigger=stop.wait))
    try:
        for _ in range(500):
            if task.done():
                task.result()
            with contextlib.suppress(OSError):  # a whole request: a connection that sends nothing would keep a place
                reader, writer = await asyncio.open_connection(HOST, port)
                writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                answered = await reader.read()
                writer.close()
                if answered:
                    break
            await asyncio.sleep(0.01)
        yield RunningProxy(f"http://{HOST}:{port}", app.extensions["proxy"], gate)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


@dataclass
class Environment:
    """Prefill and decode upstreams, the proxy in front of them and a client session."""

    prefill: list[FakeUpstream]
    decode: list[FakeUpstream]
    journal: list[tuple[str, str]]
    proxy: RunningProxy
    client: aiohttp.ClientSession

    @property
    def url(self) -> str:
        return self.proxy.url

    async def post(self, path: str, body: Any, **kwargs: Any) -> tuple[int, CIMultiDict[str], Any]:
        """POST JSON (or raw bytes) to the proxy; status, headers and the decoded JSON body (text if not JSON)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
        async with self.client.post(self.url + path, data=data, headers=headers, **kwargs) as response:
            text = await response.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return response.status, response.headers.copy(), parsed


@contextlib.asynccontextmanager
async def environment(n_prefill: int = 1, n_decode: int = 1, *, prefill_urls: list[str] | None = None,
                      decode_urls: list[str] | None = None, **options: Any) -> AsyncIterator[Environment]:
    """Start ``n_prefill`` + ``n_decode`` fake upstreams and the proxy; extra URLs (e.g. dead ones) come first.
    Every prefill is remote (the proxy's default) unless ``options`` say otherwise."""
    journal: list[tuple[str, str]] = []
    prefill = [FakeUpstream(f"P{i}", journal) for i in range(n_prefill)]
    decode = [FakeUpstream(f"D{i}", journal) for i in range(n_decode)]
    started: list[FakeUpstream] = []
    try:
        for upstream in prefill + decode:
            started.append(await upstream.start())
        config = ProxyConfig(prefill=tuple((prefill_urls or []) + [u.url for u in prefill]),
                             decode=tuple((decode_urls or []) + [u.url for u in decode]), port=0, **options)
        async with serve_proxy(config) as running:
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as client:
                yield Environment(prefill, decode, journal, running, client)
    finally:
        for upstream in started:
            await upstream.stop()


def run(test: Callable[..., Awaitable[None]], *args: Any, limit: float = 30.0, **options: Any) -> None:
    """Run ``test(env)`` in a fresh event loop with ``environment(*args, **options)``; it fails after ``limit`` s."""

    async def body() -> None:
        async with environment(*args, **options) as env:
            await asyncio.wait_for(test(env), limit)

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


def outstanding(proxy: Proxy) -> dict[str, int]:
    """The requests each role's instances have under way, all together."""
    return {b.role: sum(u.outstanding for u in b.upstreams) for b in (proxy.prefill_balancer, proxy.decode_balancer)}


async def settle(proxy: Proxy) -> None:
    """Wait for the proxy's background work: its reads of the instances' /metrics, and the prefills running beside
    their decode."""
    await asyncio.gather(*proxy.router.refreshing.values(), return_exceptions=True)
    while proxy.background:
        await asyncio.gather(*proxy.background, return_exceptions=True)


async def assert_idle(env: Environment) -> None:
    """No request outstanding in the proxy, nothing queued on any instance, no connection checked out of its pool
    (once the proxy's background work ended)."""
    await settle(env.proxy.proxy)
    assert outstanding(env.proxy.proxy) == {"prefill": 0, "decode": 0}
    for balancer in (env.proxy.proxy.prefill_balancer, env.proxy.proxy.decode_balancer):
        for upstream in balancer.upstreams:  # the queues the estimate reads: nothing left on them
            assert (upstream.work.queued, upstream.work.tokens, upstream.work.running) == (0, 0.0, 0), upstream.name
    connector = env.proxy.proxy.session.connector
    assert connector is not None and not getattr(connector, "_acquired", set())


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


async def proxy_metric(env: Environment, name: str, **labels: str) -> float:
    """A sample of the proxy's own /metrics (0.0 if it has none such)."""
    async with env.client.get(env.url + "/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def text_of(seed: int, chars: int) -> str:
    """A prompt of ``chars`` characters whose every chunk differs from another seed's."""
    words = f"seed {seed} says lorem ipsum dolor sit amet, consectetur adipiscing elit. "
    return (words * (chars // len(words) + 1))[:chars]


def endpoint_info(mode: str, pipes: str, role: str = "kv_consumer", pool: str | None = None) -> str:
    """A vLLM /metrics text with our connector's endpoint info (as kv_connector/vllm_stats.py exports it); ``pool``:
    its ``kv_pool`` label (the KV pool's master address, "" for none; None: no such label, as before pools)."""
    pool_label = "" if pool is None else f',{POOL_LABEL}="{pool}"'
    return ("# HELP vllm:num_requests_running Number of requests.\n# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
            f"# HELP {ENDPOINT_INFO} This instance's MooncakeConnector endpoint.\n"
            f"# TYPE {ENDPOINT_INFO} gauge\n"
            f'{ENDPOINT_INFO}{{engine="0",kv_engine_id="e"{pool_label},kv_role="{role}",model_name="m",'
            f'pipes="{pipes}",transfer_mode="{mode}"}} 1.0\n')
