"""Layer 4: the prefill/decode disaggregation proxy, an OpenAI-compatible HTTP front door.

Run::

    python proxy_server.py --prefill http://P1:8100 [--prefill http://P2:8100 ...] \\
                           --decode http://D1:8200 [--decode http://D2:8200 ...] --host 127.0.0.1 --port 8000

Flow of ``POST /v1/completions`` and ``POST /v1/chat/completions``:

1. The body is parsed (invalid JSON or not an object -> 400). A request id is taken from ``X-Request-Id`` or
   generated; it and ``Authorization`` are forwarded to both upstreams, and the id is returned in the response.
2. The decode instance is chosen first (fewest outstanding requests, round robin on ties) and counted as busy
   from then on: in push mode the producer must know where the KV goes before it prefills.
3. Prefill: a copy of the request with ``max_tokens=1`` (and ``max_completion_tokens=1`` for chat), ``stream``
   false, no ``stream_options`` and the protocol's ``kv_transfer_params`` goes to the prefill instance chosen the
   same way and is awaited. An error status (4xx/5xx) is relayed to the client as is and ends the request.
4. Decode: the original request, with the protocol's ``kv_transfer_params`` in place of any of its own, goes to the chosen
   decode instance. A streaming answer (SSE) is relayed chunk by chunk as it arrives; any other answer as is.

Protocols (``--protocol``):

- ``params`` (default; this project's MooncakeConnector, and any connector that answers vLLM's disaggregation
  protocol the same way, e.g. NixlConnector): the prefill asks ``{"do_remote_decode": true}``; its answer's
  ``kv_transfer_params`` (where the KV waits: any producer can serve any consumer) go on the decode request. A decode
  instance running our connector in push mode says so on its ``/metrics`` (``vllm:mooncake_kv_endpoint_info``, read
  once per ``DISCOVERY_TTL``): its pipe addresses then go on the prefill as ``mooncake_push_to``.
- ``bootstrap`` (vLLM's built-in MooncakeConnector): both requests carry one ``transfer_id``; the decode request
  also names the prefill instance's bootstrap server (``--bootstrap``, one per ``--prefill`` in the same order;
  default ``http://<prefill host>:8998``) and its engine id, read from that server's ``/query``.

Before anything goes upstream the request is checked as vLLM would check it (``prompt`` or ``messages``,
``max_tokens``, ``max_completion_tokens``, ``n``, ``model``, ``stream`` read as vLLM reads a boolean, e.g. "true"):
a request vLLM would refuse gets a 400 here, not after a prefill whose KV would then wait for nobody.

Timeouts: ``--connect-timeout`` (10 s) to reach an instance; ``--timeout`` (300 s) for a whole prefill or
non-streaming decode, and for the gap between two chunks of a stream (a stream may last as long as it produces).

An instance that cannot be reached or times out is skipped for ``--cooldown`` seconds (unless every instance of
its role is cooling down); a request that could not even connect is retried on another instance of the same
role. Unreachable -> 502, timed out (``--timeout``) -> 504, both with a JSON error naming the stage (``prefill``
or ``decode``). A client that disconnects cancels its upstream requests (their connections are closed).

``GET /health`` probes every upstream's ``/health`` (200 if at least one prefill and one decode instance are
healthy, else 503, with a per-instance report); ``GET /v1/models`` is passed through from a decode instance;
``GET /metrics`` is the proxy's own Prometheus text.

A client's own ``kv_transfer_params`` are dropped (and counted on /metrics): only the proxy says where KV comes from
and goes to.

One ``aiohttp.ClientSession`` (with a bounded connection pool) is created when serving starts and closed at
shutdown. ``create_app(config)`` builds the Quart app (used by ``main()`` and the tests); it is served by
Hypercorn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from hypercorn.asyncio import serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from quart import Quart, Response, g, request

log = logging.getLogger("proxy_server")

REQUEST_ID_HEADER = "X-Request-Id"
FORWARDED_HEADERS = ("Authorization", REQUEST_ID_HEADER)
PREFILL = "prefill"
DECODE = "decode"
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
SSE_CONTENT_TYPE = "text/event-stream"
PROTOCOLS = ("params", "bootstrap")
ENDPOINT_INFO = "vllm:mooncake_kv_endpoint_info"  # our connector's instance info on /metrics
BACKLOG = 2048  # the listening socket's queue of connections not yet accepted
MAX_COUNT = 2**31 - 1  # max_tokens, n: vLLM fails on larger ones only after the prefill ran
PUSH_TO = "mooncake_push_to"  # prefill params, push mode: the consumer's pipe address per TP rank
PUSH_PROOF = "mooncake_push_proof"  # prefill params: the consumer's proof of that address (fleets with a secret)
DEFAULT_BOOTSTRAP_PORT = 8998  # vLLM's VLLM_MOONCAKE_BOOTSTRAP_PORT default
DISCOVERY_TTL = 30.0  # seconds what an instance said about itself (push address, engine id) is reused


class ConfigError(ValueError):
    """An invalid proxy option (bad upstream URL, non-positive timeout, ...)."""


def normalize_upstream_url(url: str) -> str:
    """Check that ``url`` is ``http(s)://host:port`` (an optional trailing ``/``) and return it without the slash."""
    expected = f"invalid upstream URL {url!r}: expected http://host:port or https://host:port"
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as error:
        raise ConfigError(f"{expected} ({error})") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{expected} (scheme must be http or https)")
    if not parts.hostname:
        raise ConfigError(f"{expected} (missing host)")
    if port is None:
        raise ConfigError(f"{expected} (missing port)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ConfigError(f"{expected} (no path, query, fragment or credentials allowed)")
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class ProxyConfig:
    """Options of the proxy; URLs are validated and normalized on construction."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout: float = 300.0  # seconds: a whole prefill / non-streaming decode; between two chunks of a stream
    connect_timeout: float = 10.0  # seconds to connect to an upstream (then the next instance is tried)
    cooldown: float = 5.0  # seconds an instance that failed is skipped
    health_timeout: float = 2.0  # seconds for each upstream's /health probe
    max_connections: int = 1024  # the shared client pool, all upstreams together
    max_clients: int = 1024  # client connections at once (see ClientGate)
    client_timeout: float = 30.0  # seconds a client may take for a request's head, and for its body
    max_body_bytes: int = 64 * 1024 * 1024
    protocol: str = "params"  # see the module docstring
    bootstrap: tuple[str, ...] = ()  # protocol "bootstrap": each prefill instance's bootstrap server, in order

    def __post_init__(self) -> None:
        for role in (PREFILL, DECODE):
            urls = tuple(normalize_upstream_url(url) for url in getattr(self, role))
            if not urls:
                raise ConfigError(f"at least one --{role} URL is required")
            if len(set(urls)) != len(urls):
                raise ConfigError(f"duplicate --{role} URL in {list(urls)}")
            object.__setattr__(self, role, urls)
        for name in ("timeout", "health_timeout", "connect_timeout", "client_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value <= 86400):
                raise ConfigError(f"{name} must be seconds > 0 (and at most a day), got {value!r}")
        if not self.cooldown >= 0:
            raise ConfigError(f"cooldown must be >= 0, got {self.cooldown!r}")
        if self.max_connections < 1 or self.max_body_bytes < 1 or self.max_clients < 1:
            raise ConfigError("max_connections, max_clients and max_body_bytes must be positive")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.bootstrap and self.protocol != "bootstrap":
            raise ConfigError("--bootstrap is used only with --protocol bootstrap (vLLM's built-in MooncakeConnector)")
        if self.bootstrap and len(self.bootstrap) != len(self.prefill):
            raise ConfigError(f"give one --bootstrap URL per --prefill URL, in the same order (got {len(self.bootstrap)} "
                              f"for {len(self.prefill)})")
        object.__setattr__(self, "bootstrap", tuple(normalize_upstream_url(url) for url in self.bootstrap))

    def bootstrap_url(self, prefill_url: str) -> str:
        """The bootstrap server of a prefill instance: given in order, else port 8998 on its host."""
        if self.bootstrap:
            return self.bootstrap[self.prefill.index(prefill_url)]
        parts = urlsplit(prefill_url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        return f"http://{host}:{DEFAULT_BOOTSTRAP_PORT}"


@dataclass(eq=False)
class Upstream:
    """One vLLM instance and its bookkeeping."""

    url: str
    role: str
    index: int = 0  # its place among the instances of its role (--prefill/--decode order): what clients are told
    outstanding: int = 0  # requests sent and not finished (a stream counts until its last byte)
    down_until: float = 0.0  # time.monotonic() before which the instance is skipped
    failures: int = 0
    last_error: str | None = None
    learned: Any = None  # what the instance said about itself (push address, engine id), see Proxy.learn
    learned_at: float | None = None
    learning: asyncio.Future[Any] | None = None

    @property
    def name(self) -> str:
        """How clients hear of it: role and index, never its URL (an internal address)."""
        return f"{self.role} instance {self.index}"

    def cooling_down(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.down_until


@dataclass
class Balancer:
    """Picks the instance of one role with the fewest outstanding requests, round robin on ties."""

    role: str
    upstreams: list[Upstream]
    cooldown: float
    _next: int = field(default=0, repr=False)

    @classmethod
    def from_urls(cls, role: str, urls: Iterable[str], cooldown: float) -> Balancer:
        return cls(role, [Upstream(url, role, i) for i, url in enumerate(urls)], cooldown)

    def pick(self, exclude: Iterable[Upstream] = ()) -> Upstream | None:
        """The best instance not in ``exclude``; cooling-down ones only if nothing else is left. None if none."""
        excluded = {id(u) for u in exclude}
        now = time.monotonic()
        candidates = [u for u in self.upstreams if id(u) not in excluded]
        pool = [u for u in candidates if not u.cooling_down(now)] or candidates
        if not pool:
            return None
        fewest = min(u.outstanding for u in pool)
        count = len(self.upstreams)
        for step in range(count):
            index = (self._next + step) % count
            upstream = self.upstreams[index]
            if upstream in pool and upstream.outstanding == fewest:
                self._next = (index + 1) % count
                return upstream
        raise AssertionError("unreachable: the pool is a subset of the upstreams")

    def reserve(self) -> Upstream:
        """Pick an instance and count it as busy now (the caller releases it)."""
        upstream = self.pick()
        assert upstream is not None, "a balancer has at least one instance"
        self.acquire(upstream)
        return upstream

    def acquire(self, upstream: Upstream) -> None:
        upstream.outstanding += 1

    def release(self, upstream: Upstream) -> None:
        upstream.outstanding -= 1

    def mark_failed(self, upstream: Upstream, error: str) -> None:
        upstream.failures += 1
        upstream.last_error = error
        upstream.down_until = time.monotonic() + self.cooldown
        upstream.learned_at = None  # it may come back as another engine (a restart): ask again
        log.warning("%s %s failed (%s); skipped for %.1f s", self.role, upstream.url, error, self.cooldown)

    def outstanding(self) -> int:
        return sum(u.outstanding for u in self.upstreams)


class ProxyError(Exception):
    """Ends a request with ``status`` and a JSON error body (OpenAI style, plus the stage and the upstream)."""

    def __init__(self, status: int, kind: str, message: str, stage: str | None = None, upstream: str | None = None,
                 detail: str = ""):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.stage = stage
        self.upstream = upstream  # the instance's name (Upstream.name), never its URL
        self.detail = detail  # for the proxy's log only: URLs and the underlying error

    def payload(self) -> dict[str, Any]:
        error: dict[str, Any] = {"message": str(self), "type": self.kind, "code": self.status}
        if self.stage is not None:
            error["stage"] = self.stage
        if self.upstream is not None:
            error["upstream"] = self.upstream
        return {"error": error}

    def response(self) -> Response:
        return Response(json.dumps(self.payload()), status=self.status, content_type="application/json")


class RelayedError(Exception):
    """An upstream answered with an error status: relayed to the client as is."""

    def __init__(self, status: int, body: bytes, content_type: str | None):
        super().__init__(f"upstream status {status}")
        self.status = status
        self.body = body
        self.content_type = content_type or "application/json"

    def response(self) -> Response:
        return Response(self.body, status=self.status, content_type=self.content_type)


def prefill_payload(payload: dict[str, Any], chat: bool, kv_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill copy: one token, not streamed, with the protocol's kv_transfer_params; everything else
    unchanged."""
    copy = dict(payload)
    copy["max_tokens"] = 1
    if chat:
        copy["max_completion_tokens"] = 1
    copy["stream"] = False
    copy.pop("stream_options", None)
    copy["kv_transfer_params"] = dict(kv_params)
    return copy


def decode_payload(payload: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The original request plus the protocol's kv_transfer_params (where the KV waits)."""
    return {**payload, "kv_transfer_params": dict(kv_params)}


def kv_transfer_params(body: bytes) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a prefill answer, None if absent, not an object, or the body is not JSON."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    return params if isinstance(params, dict) else None


def push_target(metrics: str) -> tuple[list[str], str] | None:
    """A decode instance's pipe addresses and their proof ("" without a secret) if its /metrics text says it runs
    our connector as a push-mode consumer."""
    lines = [line for line in metrics.splitlines() if line.startswith(ENDPOINT_INFO + "{")]
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            labels = sample.labels
            if labels.get("kv_role") == "kv_consumer" and labels.get("transfer_mode") == "push" and labels.get("pipes"):
                return labels["pipes"].split(","), labels.get("push_proof", "")
    return None


def push_address(metrics: str) -> list[str] | None:
    """The pipe addresses of ``push_target``."""
    target = push_target(metrics)
    return None if target is None else target[0]


def bootstrap_engine_id(answer: Any) -> str:
    """The engine id in a bootstrap server's ``/query`` answer ({dp_rank: {"engine_id", "worker_addr"}})."""
    entries = list(answer.values()) if isinstance(answer, dict) else []
    ids = {e.get("engine_id") for e in entries if isinstance(e, dict)}
    if len(ids) != 1 or not isinstance(engine_id := ids.pop(), str) or not engine_id:
        raise ValueError(f"expected one engine id in the bootstrap server's /query answer, got {answer!r:.200}")
    return engine_id


def parse_json_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProxyError(400, "invalid_request_error", f"request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ProxyError(400, "invalid_request_error", "request body is nested too deeply") from None
    if not isinstance(payload, dict):
        raise ProxyError(400, "invalid_request_error", "request body must be a JSON object")
    return payload


TRUE_WORDS = {"true", "t", "yes", "y", "on", "1"}  # what vLLM's request model (pydantic, lax mode) takes as a bool
FALSE_WORDS = {"false", "f", "no", "n", "off", "0"}


def as_bool(value: Any, field: str) -> bool:
    """``value`` read as vLLM reads a boolean field (true, "true", 1, "on", ...); 400 if it is none of them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ProxyError(400, "invalid_request_error", f"{field} must be a boolean, got {value!r:.100}")


def _positive_int(payload: dict[str, Any], field: str) -> None:
    """An integer >= 1 as vLLM's request model reads one (lax: 16, "16" and 16.0 are all 16), or absent."""
    value = payload.get(field)
    if value is None:
        return
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        number = int(value.strip())
    if number is None or not 1 <= number <= MAX_COUNT:
        raise ProxyError(400, "invalid_request_error", f"{field} must be an integer from 1 to {MAX_COUNT}, got "
                         f"{value!r:.100}")


def validate(payload: dict[str, Any], chat: bool) -> bool:
    """Refuse, before anything is sent upstream, a request vLLM would refuse (a refused decode after a prefill
    leaves the prefill's KV waiting for nobody). Returns whether the answer is streamed."""
    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ProxyError(400, "invalid_request_error", "messages must be a non-empty list of message objects")
    elif payload.get("prompt_embeds") is None:
        prompt = payload.get("prompt")
        valid = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            or all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                   for p in prompt)))
        if not valid:
            raise ProxyError(400, "invalid_request_error", "prompt must be a string, a list of strings, a list of "
                             "token ids or a list of lists of token ids")
    for name in ("max_tokens", "max_completion_tokens", "n"):
        _positive_int(payload, name)
    if payload.get("model") is not None and not isinstance(payload["model"], str):
        raise ProxyError(400, "invalid_request_error", "model must be a string")
    stream = as_bool(payload["stream"], "stream") if payload.get("stream") is not None else False
    if payload.get("stream_options") is not None and not stream:
        raise ProxyError(400, "invalid_request_error", "stream_options can only be given with stream=true")
    return stream


class StreamRelay:
    """Async iterator over an upstream SSE body, relayed chunk by chunk; frees the upstream when closed.

    Closing before the end (client disconnect, error) closes the upstream connection, which makes vLLM abort the
    request. ``close()`` is idempotent and also runs on garbage collection, so the counter is always released.
    """

    def __init__(self, response: aiohttp.ClientResponse, release: Callable[[], None], request_id: str):
        self._response = response
        self._release: Callable[[], None] | None = release
        self._request_id = request_id
        self._done = False

    def __aiter__(self) -> StreamRelay:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            self.close()
            raise StopAsyncIteration
        try:
            chunk = await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as error:
            kind = "upstream_timeout" if isinstance(error, TimeoutError) else "upstream_error"
            log.warning("[%s] decode stream from %s broken: %r", self._request_id, self._response.url, error)
            self._done = True
            self.close(reuse=False)
            failure = ProxyError(504 if kind == "upstream_timeout" else 502, kind, "decode stream interrupted", DECODE)
            return f"data: {json.dumps(failure.payload())}\n\n".encode()
        if not chunk:
            self.close(reuse=True)
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self.close()

    def close(self, reuse: bool = False) -> None:
        if self._release is None:
            return
        release, self._release = self._release, None
        if reuse:
            self._response.release()
        else:
            self._response.close()
        release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # e.g. the event loop is already closed
            self.close()


class ParamsProtocol:
    """vLLM's disaggregation protocol as our MooncakeConnector answers it (see the module docstring)."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    def new_transfer(self) -> None:
        return None

    async def prepare(self, prefill: Upstream) -> None:
        """Nothing to learn about the prefill instance: its answer says where the KV waits."""

    async def prefill_params(self, transfer: None, decode: Upstream) -> dict[str, Any]:
        params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
        try:
            target = await self.proxy.learn(decode, self._push_target)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            log.debug("no push address from %s: %r", decode.url, error)  # it fails the decode too if it is down
            target = None
        # a decode instance that takes no push (or did not say) loads by pull: an empty list tells a push-mode
        # producer to keep the KV for it instead of pushing it to the consumer in its own mooncake.json
        params[PUSH_TO] = target[0] if target else []
        if target and target[1]:
            params[PUSH_PROOF] = target[1]
        return params

    async def decode_params(self, transfer: None, prefill: Upstream,
                            answer: dict[str, Any] | None) -> dict[str, Any] | None:
        return answer

    async def _push_target(self, decode: Upstream) -> tuple[list[str], str] | None:
        target = push_target(await self.proxy.get_text(decode.url + "/metrics"))
        if target:
            log.info("decode instance %s takes pushed KV at %s", decode.url, target[0])
        return target


class BootstrapProtocol:
    """vLLM's built-in MooncakeConnector: a transfer id on both requests; the decode names the prefill instance's
    bootstrap server and engine id."""

    def __init__(self, proxy: Proxy):
        self.proxy = proxy

    def new_transfer(self) -> str:
        return uuid.uuid4().hex

    async def prepare(self, prefill: Upstream) -> None:
        """Learn the prefill instance's engine id before it prefills: if its bootstrap server cannot say, the request
        ends here (502), not after a prefill whose KV would wait for a decode that never comes."""
        await self._learned_engine_id(prefill)

    async def prefill_params(self, transfer: str, decode: Upstream) -> dict[str, Any]:
        return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer}

    async def decode_params(self, transfer: str, prefill: Upstream,
                            answer: dict[str, Any] | None) -> dict[str, Any] | None:
        engine_id = await self._learned_engine_id(prefill)  # the one it was prepared for, unless a retry moved it
        return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": transfer,
                "remote_engine_id": engine_id, "remote_bootstrap_addr": self.proxy.config.bootstrap_url(prefill.url)}

    async def _learned_engine_id(self, prefill: Upstream) -> str:
        bootstrap = self.proxy.config.bootstrap_url(prefill.url)
        try:
            return await self.proxy.learn(prefill, self._engine_id)
        except (TimeoutError, aiohttp.ClientError, ValueError) as error:
            raise ProxyError(502, "upstream_error", f"the bootstrap server of {prefill.name} did not say its engine "
                             "id", PREFILL, prefill.name,
                             f"{bootstrap} ({error!r}) for {prefill.url}; check --bootstrap") from None

    async def _engine_id(self, prefill: Upstream) -> str:
        text = await self.proxy.get_text(self.proxy.config.bootstrap_url(prefill.url) + "/query")
        return bootstrap_engine_id(json.loads(text))


class Proxy:
    """State shared by the handlers: the config, one balancer per role and the client session."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefill_balancer = Balancer.from_urls(PREFILL, config.prefill, config.cooldown)
        self.decode_balancer = Balancer.from_urls(DECODE, config.decode, config.cooldown)
        self.metrics = CollectorRegistry()
        self._dropped = Counter("mooncake_proxy_client_kv_params_dropped", "Requests whose client-supplied "
                                "kv_transfer_params the proxy dropped (only the proxy sets them).", registry=self.metrics)
        seconds = config.timeout
        connect = config.connect_timeout
        self.whole_timeout = aiohttp.ClientTimeout(total=seconds, sock_connect=connect)  # prefill, decode, /v1/models
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=seconds)
        self.health_timeout = aiohttp.ClientTimeout(total=config.health_timeout)
        self.protocol: ParamsProtocol | BootstrapProtocol = \
            BootstrapProtocol(self) if config.protocol == "bootstrap" else ParamsProtocol(self)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy is not serving (no client session)")
        return self._session

    async def start(self) -> None:
        # Idle connections are dropped before uvicorn's (vLLM's server) 5 s keep-alive ends, so none is reused just
        # as the server closes it.
        connector = aiohttp.TCPConnector(limit=self.config.max_connections, limit_per_host=0, keepalive_timeout=4.0)
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        log.info("proxy ready (protocol %s): prefill %s, decode %s", self.config.protocol, list(self.config.prefill),
                 list(self.config.decode))

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def outstanding(self) -> dict[str, int]:
        return {PREFILL: self.prefill_balancer.outstanding(), DECODE: self.decode_balancer.outstanding()}

    async def send(
        self, balancer: Balancer, method: str, path: str, body: bytes | None, headers: dict[str, str],
        timeout: aiohttp.ClientTimeout, reserved: Upstream | None = None,
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """Send to ``reserved`` (already acquired), else to the best instance of ``balancer``'s role, until one
        accepts the connection.

        Returns the instance (acquired: the caller releases it) and the response (headers read).
        """
        tried: list[Upstream] = []
        while (upstream := reserved or balancer.pick(exclude=tried)) is not None:
            tried.append(upstream)
            if reserved is None:
                balancer.acquire(upstream)
            reserved = None
            try:
                response = await self.session.request(method, upstream.url + path, data=body, headers=headers,
                                                      timeout=timeout)
            except TimeoutError:
                balancer.release(upstream)
                balancer.mark_failed(upstream, "timeout")
                raise ProxyError(504, "upstream_timeout", f"{upstream.name} timed out", balancer.role, upstream.name,
                                 upstream.url) from None
            except aiohttp.ClientConnectorError as error:  # never reached the instance: try another one
                balancer.release(upstream)
                balancer.mark_failed(upstream, str(error))
                continue
            except aiohttp.ClientError as error:
                balancer.release(upstream)
                balancer.mark_failed(upstream, repr(error))
                raise ProxyError(502, "upstream_error", f"{upstream.name} failed", balancer.role, upstream.name,
                                 f"{upstream.url}: {error!r}") from None
            except BaseException:
                balancer.release(upstream)
                raise
            return upstream, response
        raise ProxyError(502, "upstream_unreachable", f"no {balancer.role} instance reachable (tried "
                         f"{len(tried)})", balancer.role, tried[-1].name if tried else None,
                         "tried " + ", ".join(u.url for u in tried))

    async def read_body(self, balancer: Balancer, upstream: Upstream, response: aiohttp.ClientResponse) -> bytes:
        """The whole body; releases the instance and the connection whatever happens (closed unless complete)."""
        complete = False
        try:
            data = await response.read()
            complete = True
            return data
        except TimeoutError:
            balancer.mark_failed(upstream, "timeout")
            raise ProxyError(504, "upstream_timeout", f"{upstream.name} timed out", balancer.role, upstream.name,
                             upstream.url) from None
        except aiohttp.ClientError as error:
            balancer.mark_failed(upstream, repr(error))
            raise ProxyError(502, "upstream_error", f"{upstream.name} failed", balancer.role, upstream.name,
                             f"{upstream.url}: {error!r}") from None
        finally:
            if complete:
                response.release()
            else:
                response.close()
            balancer.release(upstream)

    async def prefill(self, path: str, body: bytes, headers: dict[str, str],
                      reserved: Upstream) -> tuple[Upstream, dict[str, Any] | None]:
        """Run the prefill copy on the reserved instance (another one if it cannot be reached) to completion; the
        instance that ran it and its answer's kv_transfer_params."""
        upstream, response = await self.send(self.prefill_balancer, "POST", path, body, headers, self.whole_timeout,
                                             reserved)
        data = await self.read_body(self.prefill_balancer, upstream, response)
        log.debug("[%s] prefill on %s: %d", headers[REQUEST_ID_HEADER], upstream.url, response.status)
        if response.status >= 400:
            raise RelayedError(response.status, data, response.headers.get("Content-Type"))
        return upstream, kv_transfer_params(data)

    async def forward_decode(self, path: str, raw: bytes, payload: dict[str, Any], kv_params: dict[str, Any] | None,
                             headers: dict[str, str], reserved: Upstream, streaming: bool) -> Response:
        """Send the original request (plus kv_transfer_params) to the reserved decode instance (another one if it
        cannot be reached) and relay its answer."""
        body = raw if kv_params is None else json.dumps(decode_payload(payload, kv_params)).encode()
        timeout = self.stream_timeout if streaming else self.whole_timeout
        balancer = self.decode_balancer
        upstream, response = await self.send(balancer, "POST", path, body, headers, timeout, reserved)
        content_type = response.headers.get("Content-Type", "application/json")
        log.debug("[%s] decode on %s: %d", headers[REQUEST_ID_HEADER], upstream.url, response.status)
        if response.status < 400 and content_type.startswith(SSE_CONTENT_TYPE):
            relay = StreamRelay(response, lambda: balancer.release(upstream), headers[REQUEST_ID_HEADER])
            relayed = Response(relay, status=response.status, content_type=content_type)
            relayed.headers["Cache-Control"] = "no-cache"
            relayed.headers["X-Accel-Buffering"] = "no"
            relayed.timeout = None  # a stream lasts as long as the generation
            return relayed
        data = await self.read_body(balancer, upstream, response)
        return Response(data, status=response.status, content_type=content_type)

    async def completion(self, path: str, raw: bytes, headers: dict[str, str]) -> Response:
        payload = parse_json_object(raw)
        streaming = validate(payload, path == CHAT_COMPLETIONS)
        if "kv_transfer_params" in payload:
            # Only the fields the protocol sets reach the instances: a client must not steer where KV comes from or
            # goes to (nor set test switches).
            payload = {k: v for k, v in payload.items() if k != "kv_transfer_params"}
            raw = json.dumps(payload).encode()
            self._dropped.inc()
            log.info("[%s] dropped the client's kv_transfer_params (only the proxy sets them)",
                     headers[REQUEST_ID_HEADER])
        decode = self.decode_balancer.reserve()
        try:
            transfer = self.protocol.new_transfer()
            prefill_params = await self.protocol.prefill_params(transfer, decode)
            body = json.dumps(prefill_payload(payload, path == CHAT_COMPLETIONS, prefill_params)).encode()
            chosen = self.prefill_balancer.reserve()
            try:  # what the decode will need to know about the prefill instance, asked before it prefills
                await self.protocol.prepare(chosen)
            except BaseException:
                self.prefill_balancer.release(chosen)
                raise
            prefill, answer = await self.prefill(path, body, headers, chosen)
            decode_params = await self.protocol.decode_params(transfer, prefill, answer)
        except BaseException:
            self.decode_balancer.release(decode)
            raise
        return await self.forward_decode(path, raw, payload, decode_params, headers, decode, streaming)

    async def learn(self, upstream: Upstream, fetch: Callable[[Upstream], Awaitable[Any]]) -> Any:
        """What ``fetch`` says about an instance, asked at most once per DISCOVERY_TTL (concurrent requests share one
        call; a failed call is not remembered)."""
        fresh = upstream.learned_at is not None and time.monotonic() - upstream.learned_at < DISCOVERY_TTL
        if fresh:
            return upstream.learned
        if upstream.learning is None:
            async def run() -> Any:
                try:
                    upstream.learned = await fetch(upstream)
                    upstream.learned_at = time.monotonic()
                    return upstream.learned
                finally:
                    upstream.learning = None
            upstream.learning = asyncio.ensure_future(run())
        return await asyncio.shield(upstream.learning)  # a client leaving does not cancel the others' call

    async def get_text(self, url: str) -> str:
        """The body of a GET; "" if there is no such page (404: nothing to learn there)."""
        async with self.session.get(url, timeout=self.health_timeout) as response:
            if response.status == 404:
                return ""
            response.raise_for_status()
            return await response.text()

    async def models(self, headers: dict[str, str]) -> Response:
        upstream, response = await self.send(self.decode_balancer, "GET", "/v1/models", None, headers,
                                             self.whole_timeout)
        data = await self.read_body(self.decode_balancer, upstream, response)
        return Response(data, status=response.status, content_type=response.headers.get("Content-Type"))

    async def probe(self, upstream: Upstream) -> dict[str, Any]:
        """One upstream's health: its /health status (or the error) and the proxy's bookkeeping."""
        report: dict[str, Any] = {"instance": upstream.index, "outstanding": upstream.outstanding,
                                  "cooling_down": upstream.cooling_down(), "failures": upstream.failures}
        try:
            async with self.session.get(upstream.url + "/health", timeout=self.health_timeout) as response:
                await response.read()
                report.update(healthy=response.status == 200, status=response.status)
        except TimeoutError:
            report.update(healthy=False, error="timeout")
        except aiohttp.ClientError as error:
            log.info("%s (%s) is unhealthy: %r", upstream.name, upstream.url, error)
            report.update(healthy=False, error=type(error).__name__)  # its text names the URL
        return report

    async def health(self) -> tuple[int, dict[str, Any]]:
        balancers = (self.prefill_balancer, self.decode_balancer)
        upstreams = [u for b in balancers for u in b.upstreams]
        reports = await asyncio.gather(*(self.probe(u) for u in upstreams))
        by_role: dict[str, list[dict[str, Any]]] = {PREFILL: [], DECODE: []}
        for upstream, report in zip(upstreams, reports, strict=True):
            by_role[upstream.role].append(report)
        healthy = all(any(r["healthy"] for r in by_role[role]) for role in (PREFILL, DECODE))
        return (200 if healthy else 503), {"status": "ok" if healthy else "unavailable", **by_role}


def forwarded_headers(request_id: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
    if (authorization := request.headers.get("Authorization")) is not None:
        headers["Authorization"] = authorization
    return headers


def create_app(config: ProxyConfig) -> Quart:
    """The Quart app of the proxy; its ``Proxy`` state is ``app.extensions["proxy"]``."""
    app = Quart(__name__)
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=config.client_timeout, MAX_CONTENT_LENGTH=config.max_body_bytes)
    proxy = Proxy(config)
    app.extensions["proxy"] = proxy
    app.before_serving(proxy.start)
    app.after_serving(proxy.stop)

    @app.before_request
    async def assign_request_id() -> None:
        g.request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex

    @app.after_request
    async def return_request_id(response: Response) -> Response:
        if request_id := getattr(g, "request_id", None):
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    async def handle(path: str) -> Response:
        try:
            return await proxy.completion(path, await request.get_data(), forwarded_headers(g.request_id))
        except (ProxyError, RelayedError) as error:
            if isinstance(error, ProxyError) and error.status >= 500:
                log.warning("[%s] %s: %s (%s)", g.request_id, error.status, error, error.detail)
            return error.response()

    @app.post(COMPLETIONS)
    async def completions() -> Response:
        return await handle(COMPLETIONS)

    @app.post(CHAT_COMPLETIONS)
    async def chat_completions() -> Response:
        return await handle(CHAT_COMPLETIONS)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            return await proxy.models(forwarded_headers(g.request_id))
        except ProxyError as error:
            return error.response()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics), content_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> Response:
        status, report = await proxy.health()
        return Response(json.dumps(report), status=status, content_type="application/json")

    return app


class _Client(socket.socket):
    """An accepted client connection, counted by its gate until closed."""

    gate: ClientGate | None = None
    address: tuple[str, int] = ("", 0)  # the client's, as the app's requests name it
    in_flight = 0  # requests of it the app is handling (a streamed answer counts until its end)
    last_active = 0.0
    evicted = False  # shut down to make room; closed once its transport sees the end

    def end(self) -> None:
        """Shut the connection down: its transport sees the end and closes it."""
        with contextlib.suppress(OSError):
            self.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.closed(self)
        super().close()


class _Listener(socket.socket):
    """The proxy's listening socket: asyncio calls its ``accept``, which asks the gate."""

    gate: ClientGate

    def accept(self) -> tuple[socket.socket, Any]:  # type: ignore[override]
        if not self.gate.room():
            raise BlockingIOError  # asyncio accepts again when the listener is readable again: the connection waits
        fd, address = self._accept()  # type: ignore[attr-defined]
        client = _Client(self.family, self.type, self.proto, fileno=fd)
        if not self.gate.admit(client, address):
            client.close()
            raise ConnectionAbortedError  # asyncio goes on accepting
        return client, address


class ClientGate:
    """Who may hold a connection to the proxy: at most ``max_clients`` at once, so slow clients cannot exhaust the
    proxy's file descriptors (a new one takes the place of the oldest with no request under way, or is closed if
    every one has a request under way), and a connection with no request under way is closed after
    ``client_timeout`` seconds (a request's head must arrive within them: a client that trickles
    its headers, or sits idle, gives its place up; the body has as long, see BODY_TIMEOUT). The app sees requests
    only once their head is complete, so it marks what a connection is doing (``wrap``)."""

    def __init__(self, config: ProxyConfig) -> None:
        self.limit, self.idle = config.max_clients, config.client_timeout
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.listener = _Listener(family, socket.SOCK_STREAM)
        self.listener.gate = self
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind((config.host, config.port))
        except OSError as error:
            self.listener.close()
            raise ConfigError(f"cannot listen on {config.host}:{config.port}: {error.strerror}") from None
        self.listener.listen(BACKLOG)
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.clients: dict[tuple[str, int], _Client] = {}  # by peer address: what the app's requests name
        self.open = 0  # connections accepted and not closed yet (evicted ones included): file descriptors held
        self.closing = 0  # of them, evicted and not closed yet
        self.crowded = 0  # times the limit was reached

    def room(self) -> bool:
        """Whether a new connection may be accepted now. At the limit the oldest connection with no request under way
        (idle, or still sending its head: a real client sends its request at once) is shut down to make room, and
        the new one waits in the listen queue until it is closed; if every one has a request under way the new one
        is accepted and closed at once (``admit``)."""
        if self.open < self.limit:
            return True
        if self.closing:
            return False
        idle = [c for c in self.clients.values() if c.in_flight == 0]
        self.crowded += 1
        if self.crowded in (1, 10, 100) or self.crowded % 1000 == 0:
            log.warning("%d client connections open (--max-clients): %s (%d times so far)", self.limit,
                        "closing the oldest idle one" if idle else "refusing a new one", self.crowded)
        if not idle:
            return True
        oldest = min(idle, key=lambda c: c.last_active)
        oldest.evicted = True
        self.closing += 1
        del self.clients[oldest.address]
        oldest.end()
        return False

    def admit(self, client: _Client, address: Any) -> bool:
        if self.open >= self.limit:
            return False
        client.gate, client.address, client.last_active = self, address[:2], time.monotonic()
        self.clients[client.address] = client
        self.open += 1
        return True

    def closed(self, client: _Client) -> None:
        self.open -= 1
        if client.evicted:
            self.closing -= 1
        if self.clients.get(client.address) is client:
            del self.clients[client.address]

    def wrap(self, app: Any) -> Callable[..., Awaitable[None]]:
        """The ASGI app, marking each request on its connection while the app handles it."""
        async def gated(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            client = self.clients.get(tuple(scope.get("client") or ())[:2]) if scope["type"] == "http" else None
            if client is None:
                await app(scope, receive, send)
                return
            client.in_flight += 1
            try:
                await app(scope, receive, send)
            finally:
                client.in_flight -= 1
                client.last_active = time.monotonic()
        return gated

    async def sweep(self) -> None:
        """Close, every fraction of ``client_timeout``, the connections idle (or still sending a head) for longer."""
        while True:
            await asyncio.sleep(min(1.0, self.idle / 4))
            cutoff = time.monotonic() - self.idle
            for client in list(self.clients.values()):
                if client.in_flight == 0 and client.last_active < cutoff:
                    client.end()

    async def serve(self, app: Quart, shutdown_trigger: Callable[..., Awaitable[Any]] | None = None) -> None:
        """Serve ``app`` with Hypercorn on this gate's socket until ``shutdown_trigger`` (default: SIGINT/SIGTERM)."""
        gate = self

        class _Config(HypercornConfig):
            def create_sockets(self) -> Sockets:
                return Sockets([], [gate.listener], [])

        server = _Config()
        server.backlog = BACKLOG
        server.accesslog = None
        server.errorlog = logging.getLogger("hypercorn.error")  # through this process's logging set-up, no own handler
        server.graceful_timeout = 5.0
        server.keep_alive_timeout = self.idle
        # no read_timeout: Hypercorn would close a connection whose client sends nothing while it waits for a long
        # answer or stream; heads and idle connections are the sweeper's, bodies BODY_TIMEOUT's
        sweeper = asyncio.create_task(self.sweep())
        try:
            await serve(self.wrap(app), server, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
        finally:
            sweeper.cancel()
            self.listener.close()


def parse_args(argv: list[str] | None = None) -> ProxyConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", required=True, metavar="URL",
                        help="a prefill instance, http(s)://host:port (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, metavar="URL",
                        help="a decode instance, http(s)://host:port (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds for a prefill or a non-streaming decode, and between two chunks of a stream")
    parser.add_argument("--connect-timeout", type=float, default=10.0,
                        help="seconds to connect to an upstream before the next instance is tried (default 10)")
    parser.add_argument("--cooldown", type=float, default=5.0, help="seconds a failed instance is skipped")
    parser.add_argument("--health-timeout", type=float, default=2.0, help="seconds for each upstream /health probe")
    parser.add_argument("--max-connections", type=int, default=1024, help="upstream connection pool size")
    parser.add_argument("--max-clients", type=int, default=1024,
                        help="client connections at once (default 1024; keep it below the process's open-file "
                             "limit): a new one takes the place of the oldest with no request under way")
    parser.add_argument("--client-timeout", type=float, default=30.0,
                        help="seconds a client may take to send a request's head, and its body; an idle client "
                             "connection is closed after as long (default 30)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="params",
                        help="how the instances are told where the KV goes: params (this project's "
                             "MooncakeConnector; default) or bootstrap (vLLM's built-in MooncakeConnector)")
    parser.add_argument("--bootstrap", action="append", default=[], metavar="URL",
                        help="--protocol bootstrap: a prefill instance's bootstrap server, one per --prefill in the same "
                             f"order (default http://<prefill host>:{DEFAULT_BOOTSTRAP_PORT})")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ProxyConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), host=args.host, port=args.port,
                           timeout=args.timeout, connect_timeout=args.connect_timeout, cooldown=args.cooldown,
                           health_timeout=args.health_timeout,
                           max_connections=args.max_connections, max_clients=args.max_clients,
                           client_timeout=args.client_timeout, protocol=args.protocol,
                           bootstrap=tuple(args.bootstrap))
    except ConfigError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    gate = ClientGate(config)
    log.info("listening on http://%s:%d", config.host, gate.port)
    asyncio.run(gate.serve(create_app(config)))


if __name__ == "__main__":
    main()
