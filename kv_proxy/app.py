"""The proxy's request flow over HTTP: ``Proxy`` (the state the handlers share, and what each request does upstream;
its routing bookkeeping is its ``Routed``) and ``create_app``, the Quart app around it."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

import aiohttp
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from quart import Quart, Response, g, request

from kv_proxy.admin import register_admin
from kv_proxy.balancer import Balancer, Upstream
from kv_proxy.config import DECODE, PREFILL, ProxyConfig
from kv_proxy.discovery import Discovery
from kv_proxy.errors import ProxyError, RelayedError
from kv_proxy.estimate import LOCAL, ON_PREFILL
from kv_proxy.prefix_index import Fingerprint
from kv_proxy.prepare import BodyBudget, Prepared, Preparer, with_params
from kv_proxy.protocols import (
    NO_LOAD,
    POOL_ONLY_LOAD,
    BootstrapProtocol,
    ParamsProtocol,
    answer_params,
    json_answer,
    loads_kv,
    pool_only,
)
from kv_proxy.relay import SSE_CONTENT_TYPE, BodyRelay, StreamRelay, error_event, first_event
from kv_proxy.routed import Routed
from kv_proxy.routing import Router
from kv_proxy.validate import request_id

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
BODIES_HELD = 32  # request bodies of the largest size the proxy holds at once
ERROR_ANSWER_MAX = 1 << 20  # bytes of an upstream's error answer read (and relayed) at most
PREFILL_ANSWER_MAX = 1 << 20  # bytes: a one-token answer is a few KiB (1 MiB leaves room for prompt logprobs)
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


class _FailedBeforeFirstToken(Exception):
    """A decode that loads KV failed before its first token (``reason``: for /metrics): sent again whole."""

    def __init__(self, reason: str, upstream: str) -> None:
        super().__init__(reason)
        self.reason, self.upstream = reason, upstream


class Proxy:
    """State shared by the handlers: the config, one balancer per role, the router, the client session, and what the
    instances said about themselves (``discovery``, shared with the router and the protocol)."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefill_balancer = Balancer.from_urls(PREFILL, config.prefill, config.cooldown, config.balance_slack)
        self.decode_balancer = Balancer.from_urls(DECODE, config.decode, config.cooldown, config.balance_slack)
        if config.protocol == "bootstrap":
            for upstream in self.prefill_balancer.upstreams:
                upstream.bootstrap = config.bootstrap_url(upstream.url)
        self.metrics = CollectorRegistry()
        self.health_timeout = aiohttp.ClientTimeout(total=config.health_timeout)
        self.discovery = Discovery(lambda: self.session, self.health_timeout)
        self.router = Router(config, self.prefill_balancer, self.decode_balancer, self.discovery, self.metrics)
        self._dropped = Counter("mooncake_proxy_client_kv_params_dropped", "Requests whose client-supplied "
                                "kv_transfer_params the proxy dropped (only the proxy sets them).", registry=self.metrics)
        self._dispatched = Counter("mooncake_proxy_dispatched", "Requests with a remote prefill, by when their decode "
                                   "went out: with the prefill (concurrent, push mode) or after its answer "
                                   "(sequential).", ["mode"], registry=self.metrics)
        self._background_failed = Counter("mooncake_proxy_background_prefill_failed", "Prefills sent beside their "
                                          "decode (concurrent dispatch) that failed; the decode instance computed "
                                          "the prompt itself.", registry=self.metrics)
        self._fallbacks = Counter("mooncake_proxy_prefill_fallbacks", "Requests no prefill instance could take (all "
                                  "unreachable, timed out, or failed with a server error), computed whole on their "
                                  "decode instance instead (--no-fallback: refused).", ["reason"], registry=self.metrics)
        self._retries = Counter("mooncake_proxy_decode_retries", "Decodes of a remote prefill that failed before their "
                                "first token with a server error (under vLLM's default kv_load_failure_policy "
                                "\"fail\" a KV load that broke ends its request so) and were sent again, once, whole "
                                "to a decode instance (computed there).", ["reason"], registry=self.metrics)
        self._bad_answers = Counter("mooncake_proxy_prefill_bad_answers", "Prefill answers the decode could not use "
                                    "(not a JSON object, no kv_transfer_params, too large): failed prefills.",
                                    ["reason"], registry=self.metrics)
        self._told_bad: set[tuple[str, str]] = set()  # (instance, kind) of bad answers logged already
        self._outage = False  # the last remote prefill failed for want of a prefill instance (logged once an outage)
        self.background: set[asyncio.Task[None]] = set()  # prefills running beside their decode
        seconds = config.timeout
        connect = config.connect_timeout
        self.whole_timeout = aiohttp.ClientTimeout(total=seconds, sock_connect=connect)  # prefill, decode, /v1/models
        self.stream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=seconds)
        self.protocol: ParamsProtocol | BootstrapProtocol = \
            BootstrapProtocol(self.discovery) if config.protocol == "bootstrap" else ParamsProtocol(self.discovery)
        self._session: aiohttp.ClientSession | None = None
        self.preparer = Preparer()
        self.bodies = BodyBudget(BODIES_HELD * config.max_body_bytes)
        self._busy = Counter("mooncake_proxy_bodies_refused", "Requests refused with a 503 because the proxy held as "
                             "many request bodies as it may (32 x --max-body-bytes).", registry=self.metrics)

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
        log.info("proxy ready (protocol %s): prefill %s, decode %s; routing %s, prefix index of %d chunks, balance "
                 "slack %d, skip the prefill below %d tokens, --pool-tail %d%s", self.config.protocol,
                 list(self.config.prefill), list(self.config.decode), self.config.routing,
                 self.config.prefix_index_entries, self.config.balance_slack, self.config.skip_prefill_below,
                 self.config.pool_tail, "; admin endpoints on" if self.config.admin_token else "")

    def busy(self) -> None:
        self._busy.inc()

    async def stop(self) -> None:
        self.preparer.close()
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.router.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self, balancer: Balancer, method: str, path: str, body: bytes | None, headers: dict[str, str],
        timeout: aiohttp.ClientTimeout, reserved: Upstream | None = None, hint: Fingerprint | None = None,
    ) -> tuple[Upstream, aiohttp.ClientResponse]:
        """Send to ``reserved`` (already acquired), else to the best instance of ``balancer``'s role, until one
        accepts the connection.

        Returns the instance (acquired: the caller releases it) and the response (headers read).
        """
        tried: list[Upstream] = []
        while (upstream := reserved or balancer.pick_upstream(exclude=tried, hint=hint)) is not None:
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

    def bad_prefill(self, upstream: Upstream, what: str) -> ProxyError:
        """A prefill answer the decode cannot use (counted; said once per instance and kind): a failed prefill."""
        self._bad_answers.labels(reason=what.replace(" ", "_")).inc()
        key = (upstream.name, what)
        if key not in self._told_bad:
            self._told_bad.add(key)
            log.warning("%s answered a prefill with %s: such answers count as failed prefills (the request goes whole "
                        "to its decode instance); is it a kv_producer running MooncakeConnector?", upstream.name, what)
        return ProxyError(502, "upstream_bad_answer", f"{upstream.name} answered the prefill with {what}", PREFILL,
                          upstream.name, upstream.url)

    async def read_body(self, balancer: Balancer, upstream: Upstream, response: aiohttp.ClientResponse,
                        limit: int | None = None) -> bytes:
        """The whole body (``limit``: at most that many bytes, else a 502); releases the instance and the connection
        whatever happens (closed unless complete)."""
        complete = False
        try:
            if limit is None:
                data = await response.read()
            else:
                parts, size = [], 0
                while chunk := await response.content.readany():
                    parts.append(chunk)
                    size += len(chunk)
                    if size > limit:
                        if balancer.role == PREFILL:
                            raise self.bad_prefill(upstream, f"more than {limit} bytes")
                        raise ProxyError(502, "upstream_error", f"{upstream.name} answered with more than {limit} "
                                         "bytes of error", balancer.role, upstream.name, upstream.url)
                data = b"".join(parts)
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

    async def prefill(self, path: str, body: bytes, headers: dict[str, str], reserved: Upstream,
                      routed: Routed) -> tuple[Upstream, dict[str, Any] | None]:
        """Run the prefill copy on the reserved instance (sent: ``routed.prefill_sent``; another one if it cannot be
        reached) to completion; the instance that ran it and its answer's kv_transfer_params."""
        answer: dict[str, Any] | None = None
        ok = False
        try:
            upstream, response = await self.send(self.prefill_balancer, "POST", path, body, headers,
                                                 self.whole_timeout, reserved, routed.hint)
            if upstream is not reserved:
                routed.prefill_sent(upstream)
            data = await self.read_body(self.prefill_balancer, upstream, response, PREFILL_ANSWER_MAX)
            log.debug("[%s] prefill on %s: %d", headers[REQUEST_ID_HEADER], upstream.url, response.status)
            if response.status >= 400:
                raise RelayedError(response.status, data, response.headers.get("Content-Type"))
            answer = json_answer(data)
            if answer is None or (self.protocol.needs_params and answer_params(answer) is None):
                raise self.bad_prefill(upstream, "no JSON object" if answer is None else "no kv_transfer_params")
            ok = True
        finally:
            routed.prefill_ended(answer if ok else None)
        self.prefilled()
        return upstream, answer_params(answer)

    async def forward_decode(self, path: str, request: Prepared, kv_params: dict[str, Any] | None,
                             headers: dict[str, str], routed: Routed, local: bool) -> Response:
        """Send the original request (plus kv_transfer_params) to the request's reserved decode instance (another one
        if it cannot be reached; on_prefill: a prefill instance) and relay its answer. ``local``: it computes the
        prompt itself (no KV to load but, sent with ``POOL_ONLY_LOAD``, what its KV pool holds).

        A decode that loads KV (a pool-only one too) and fails before its first token with a server error (a 5xx
        answer, or a stream whose first event is an error: under vLLM's default ``kv_load_failure_policy`` a KV load
        that broke ends its request so) is sent again, once, whole (``NO_LOAD``) to a decode instance: the client gets
        the right text. One that already streamed a token is not retried."""
        may_load = kv_params is None or loads_kv(kv_params)  # without params a consumer loads what it finds
        try:
            return await self._decode_once(path, request, kv_params, headers, routed, local, may_load)
        except _FailedBeforeFirstToken as failed:
            self._retries.labels(reason=failed.reason).inc()
            log.warning("[%s] the decode on %s failed before its first token (%s): sending it again whole to a decode "
                        "instance", routed.request_id, failed.upstream, failed.reason)
            routed.retry()
            return await self._decode_once(path, request, dict(NO_LOAD), headers, routed, True)

    async def _decode_once(self, path: str, request: Prepared, kv_params: dict[str, Any] | None,
                           headers: dict[str, str], routed: Routed, local: bool, retry: bool = False) -> Response:
        """``forward_decode``'s one attempt; raises ``_FailedBeforeFirstToken`` where a retry is due (``retry``: the
        decode may load KV)."""
        body = with_params(request.body, kv_params)
        timeout = self.stream_timeout if request.stream else self.whole_timeout
        balancer, reserved = routed.decode_balancer, routed.decode
        pooled = pool_only(kv_params)
        routed.decode_sent(reserved, local, pooled)
        relaying = False
        try:
            upstream, response = await self.send(balancer, "POST", path, body, headers, timeout, reserved, routed.hint)
            if upstream is not reserved:
                routed.decode_sent(upstream, local, pooled)
            content_type = response.headers.get("Content-Type", "application/json")
            log.debug("[%s] decode on %s: %d", headers[REQUEST_ID_HEADER], upstream.url, response.status)
            if response.status < 400 and content_type.startswith(SSE_CONTENT_TYPE):
                def release() -> None:
                    balancer.release(upstream)
                    routed.decode_ended()

                first = b""
                if retry:  # whether its first event is an error (a load that broke) decides a retry
                    reason = None
                    try:
                        first = await first_event(response)
                        reason = error_event(first)
                    except aiohttp.ClientError:  # the stream broke before its first token
                        reason = "stream_broken"
                    except BaseException as error:  # a timeout (not retried: it would double), the client gone
                        response.close()
                        balancer.release(upstream)
                        if isinstance(error, TimeoutError):
                            balancer.mark_failed(upstream, "timeout")
                            raise ProxyError(504, "upstream_timeout", f"{upstream.name} timed out", balancer.role,
                                             upstream.name, upstream.url) from None
                        raise
                    if reason is not None:
                        response.close()
                        balancer.release(upstream)
                        raise _FailedBeforeFirstToken(reason, upstream.name)
                relay = StreamRelay(response, release, headers[REQUEST_ID_HEADER], routed.answered, routed.chunk,
                                    first=first)
                relaying = True
                relayed = Response(relay, status=response.status, content_type=content_type)
                relayed.headers["Cache-Control"] = "no-cache"
                relayed.headers["X-Accel-Buffering"] = "no"
                relayed.timeout = None  # a stream lasts as long as the generation
                return relayed
            if response.status < 400:  # relayed as it comes: an answer of any size costs the proxy a chunk

                def whole(data: bytes | None) -> None:  # its start (all of it, if small: its usage times the step)
                    balancer.release(upstream)
                    routed.answered()
                    routed.decode_ended(json_answer(data) if data else None)

                relaying = True
                body = BodyRelay(response, whole, headers[REQUEST_ID_HEADER])
                relayed = Response(body, status=response.status, content_type=content_type)
                relayed.timeout = None
                return relayed
            data = await self.read_body(balancer, upstream, response, ERROR_ANSWER_MAX)
            if response.status >= 500 and retry:
                raise _FailedBeforeFirstToken(f"status_{response.status}", upstream.name)
            return Response(data, status=response.status, content_type=content_type)
        finally:
            if not relaying:
                routed.decode_ended()

    async def completion(self, path: str, raw: bytes, headers: dict[str, str]) -> Response:
        chat = path == CHAT_COMPLETIONS
        request = await self.preparer(raw, chat)
        del raw  # the prepared bodies are what goes upstream
        request_id = headers[REQUEST_ID_HEADER]
        if request.dropped_params:
            # Only the fields the protocol sets reach the instances: a client must not steer where KV comes from or
            # goes to (nor set test switches).
            self._dropped.inc()
            log.info("[%s] dropped the client's kv_transfer_params (only the proxy sets them)", request_id)
        routed = Routed.open(self.router, request.hint, request_id, request.output_tokens)
        try:
            return await self.serve(path, request, headers, routed)
        except BaseException:
            routed.release()  # what was reserved for it and never sent
            raise

    async def serve(self, path: str, request: Prepared, headers: dict[str, str], routed: Routed) -> Response:
        """The routed request's way: whole on a prefill instance (on_prefill), or a remote prefill (unless skipped:
        local) and then the decode."""
        if routed.where == ON_PREFILL:
            try:
                # NO_LOAD says do_remote_decode false too: the prefill instance keeps nothing for a consumer
                return await self.forward_decode(path, request, dict(NO_LOAD), headers, routed, True)
            except ProxyError as error:
                reason = self.prefill_unavailable(error)
                if reason is None or not self.config.fallback:
                    raise
                self.fell_back(reason, error, routed.request_id)
            routed.retry()
            return await self.forward_decode(path, request, dict(NO_LOAD), headers, routed, True)
        try:
            if routed.where == LOCAL:
                # a KV pool member still loads what its pool holds of the prompt; NO_LOAD would forbid that too
                pooled = bool(self.router.pool(routed.decode))
                decode_params: dict[str, Any] | None = dict(POOL_ONLY_LOAD if pooled else NO_LOAD)
            else:
                decode_params = await self.remote_prefill(path, request, headers, routed)
        except (ProxyError, RelayedError) as error:
            reason = self.prefill_unavailable(error)
            if reason is None or not self.config.fallback:
                raise
            self.fell_back(reason, error, routed.request_id)
            decode_params = dict(NO_LOAD)
        local = not loads_kv(decode_params) or pool_only(decode_params)
        return await self.forward_decode(path, request, decode_params, headers, routed, local)

    @staticmethod
    def prefill_unavailable(error: ProxyError | RelayedError) -> str | None:
        """Why no prefill instance could take the request (a reason for /metrics), or None if the request itself is
        at fault (a 4xx answer: the decode instance would refuse it too) or the failure was not the prefill's."""
        if isinstance(error, RelayedError):
            return "server_error" if error.status >= 500 else None
        if error.stage != PREFILL or error.status < 500:
            return None
        return {"upstream_unreachable": "unreachable", "upstream_timeout": "timeout",
                "upstream_cooling_down": "cooldown", "upstream_bad_answer": "bad_answer"}.get(error.kind, "error")

    def fell_back(self, reason: str, error: ProxyError | RelayedError, request_id: str) -> None:
        """Count a request sent whole to its decode instance; say so once per outage (``prefilled`` ends it)."""
        self._fallbacks.labels(reason=reason).inc()
        if not self._outage:
            self._outage = True
            log.warning("[%s] no prefill instance could take the request (%s: %s): sending requests whole to the decode "
                        "instances until a prefill succeeds again (--no-fallback refuses them instead)", request_id,
                        reason, error)
        else:
            log.debug("[%s] sent whole to its decode instance (%s)", request_id, reason)

    def prefilled(self) -> None:
        """A remote prefill succeeded: an outage, if one was under way, is over."""
        if self._outage:
            self._outage = False
            log.warning("a prefill instance answers again: remote prefills resume")

    async def remote_prefill(self, path: str, request: Prepared, headers: dict[str, str],
                             routed: Routed) -> dict[str, Any] | None:
        """The prefill copy run on a prefill instance; the decode's kv_transfer_params. Before the decode, unless the
        decode instance takes pushed KV (``--dispatch concurrent``): then the prefill runs in the background and the
        decode goes out at once, waiting for the push."""
        transfer = self.protocol.new_transfer()
        prefill_params = await self.protocol.prefill_params(transfer, routed.decode)
        body = with_params(request.prefill, prefill_params)
        awaited = self.protocol.awaited_push(prefill_params) if self.config.dispatch == "concurrent" else None
        chosen = routed.reserve_prefill()
        if awaited is not None and chosen.cooling_down() and self.config.fallback:
            # every prefill instance failed a moment ago (a cooling-down one is chosen only then): a decode sent
            # beside it would wait push_wait for a push that is unlikely to come
            routed.release(PREFILL)
            raise ProxyError(502, "upstream_cooling_down", "every prefill instance failed recently", PREFILL,
                             chosen.name)
        if awaited is not None:
            self._dispatched.labels(mode="concurrent").inc()
            routed.prefill_sent(chosen)  # the background task owns the reservation from here
            task = asyncio.create_task(self.background_prefill(path, body, headers, chosen, routed))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            return awaited
        self._dispatched.labels(mode="sequential").inc()
        try:  # what the decode will need to know about the prefill instance, asked before it prefills
            await self.protocol.prepare(chosen)
        except BaseException:
            routed.release(PREFILL)
            raise
        routed.prefill_sent(chosen)
        prefill, answer = await self.prefill(path, body, headers, chosen, routed)
        return await self.protocol.decode_params(transfer, prefill, answer)

    async def background_prefill(self, path: str, body: bytes, headers: dict[str, str], chosen: Upstream,
                                 routed: Routed) -> None:
        """A prefill whose decode is already on its way: its failure is logged and counted, never the client's (the
        decode instance stops waiting for the push after its ``push_wait`` and computes the prompt itself)."""
        try:
            await self.prefill(path, body, headers, chosen, routed)
        except asyncio.CancelledError:
            raise
        except (ProxyError, RelayedError) as error:
            self._background_failed.inc()
            detail = error.detail if isinstance(error, ProxyError) else f"status {error.status}"
            log.warning("[%s] the prefill sent beside its decode failed (%s: %s); the decode instance computes the "
                        "prompt itself", headers[REQUEST_ID_HEADER], error, detail)
        except Exception:
            self._background_failed.inc()
            log.exception("[%s] the prefill sent beside its decode failed", headers[REQUEST_ID_HEADER])

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
    """The headers that go upstream: the request id, and the client's Authorization if it sent one."""
    headers = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
    if (authorization := request.headers.get("Authorization")) is not None:
        headers["Authorization"] = authorization
    return headers


def create_app(config: ProxyConfig) -> Quart:
    """The Quart app of the proxy; its ``Proxy`` state is ``app.extensions["proxy"]``."""
    app = Quart(__name__)
    app.url_map.merge_slashes = False  # "//" is a 404, never a redirect built from the client's Host header
    app.config.update(RESPONSE_TIMEOUT=None, BODY_TIMEOUT=config.client_timeout, MAX_CONTENT_LENGTH=config.max_body_bytes)
    proxy = Proxy(config)
    app.extensions["proxy"] = proxy
    app.before_serving(proxy.start)
    app.after_serving(proxy.stop)
    if config.admin_token:
        register_admin(app, config, proxy.router)

    @app.before_request
    async def assign_request_id() -> None:
        g.request_id = request_id(request.headers.get(REQUEST_ID_HEADER)) or uuid.uuid4().hex

    @app.after_request
    async def return_request_id(response: Response) -> Response:
        if request_id := getattr(g, "request_id", None):
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    async def handle(path: str) -> Response:
        length = request.content_length
        held = config.max_body_bytes if length is None else min(length, config.max_body_bytes)
        if not proxy.bodies.take(held):  # before the body is read: what clients send cannot swell the proxy
            proxy.busy()
            return ProxyError(503, "server_busy", "the proxy holds as many request bodies as it may; try again "
                              "shortly").response()
        try:
            return await proxy.completion(path, await request.get_data(), forwarded_headers(g.request_id))
        except (ProxyError, RelayedError) as error:
            if isinstance(error, ProxyError) and error.status >= 500:
                log.warning("[%s] %s: %s (%s)", g.request_id, error.status, error, error.detail)
            return error.response()
        finally:
            proxy.bodies.give(held)

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
