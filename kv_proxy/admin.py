"""``/admin/instances`` (``register_admin``, only with an admin token): instances listed, added and removed while the
proxy runs, in the ``Router``'s balancers (docs/proxy.md#admin)."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from quart import Quart, Response, request

from kv_proxy.balancer import Upstream
from kv_proxy.config import DECODE, PREFILL, ConfigError, ProxyConfig, default_bootstrap_url, normalize_upstream_url
from kv_proxy.errors import ProxyError
from kv_proxy.routing import Router
from kv_proxy.validate import parse_json_object

log = logging.getLogger(__name__)

PATH = "/admin/instances"
MAX_INSTANCES = 256  # per role
MAX_URL = 2048


def describe(upstream: Upstream) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": upstream.role, "instance": upstream.index, "url": upstream.url,
                             "outstanding": upstream.outstanding, "failures": upstream.failures,
                             "cooling_down": upstream.cooling_down(), "prefix_chunks": len(upstream.prefix),
                             "cache_tokens": upstream.cache.tokens}
    if upstream.bootstrap:
        entry["bootstrap"] = upstream.bootstrap
    if upstream.pool:
        entry["kv_pool"] = upstream.pool
    return entry


def _bad(message: str) -> ProxyError:
    return ProxyError(400, "invalid_request_error", message)


def _url(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_URL:
        raise _bad(f"{field} must be a URL string of at most {MAX_URL} characters")
    try:
        return normalize_upstream_url(value)
    except ConfigError as error:
        raise _bad(f"{field}: {error}") from None


def parse_instance(body: bytes, bootstrap_allowed: bool) -> tuple[str, str, str]:
    """Role, URL and bootstrap URL ("" unless given or needed) of an admin body; ProxyError 400 if malformed."""
    payload = parse_json_object(body)
    allowed = {"role", "url"} | ({"bootstrap"} if bootstrap_allowed else set())
    if unknown := sorted(set(payload) - allowed):
        raise _bad(f"unknown field(s) {json.dumps(unknown)[:200]}; expected {sorted(allowed)}")
    role = payload.get("role")
    if role not in (PREFILL, DECODE):
        raise _bad(f'role must be "{PREFILL}" or "{DECODE}", got {json.dumps(role)[:100]}')
    url = _url(payload.get("url"), "url")
    bootstrap = ""
    if "bootstrap" in payload:
        if role != PREFILL:
            raise _bad("bootstrap is given for prefill instances only")
        bootstrap = _url(payload["bootstrap"], "bootstrap")
    elif bootstrap_allowed and role == PREFILL:
        bootstrap = default_bootstrap_url(url)
    return role, url, bootstrap


def register_admin(app: Quart, config: ProxyConfig, router: Router) -> None:
    """Add the admin endpoint to ``app`` (call it only with a token: without one the endpoint does not exist);
    instances are added to and removed from ``router``'s balancers."""
    token = config.admin_token.encode()
    draining: list[Upstream] = []

    def refused() -> Response | None:
        header = request.headers.get("Authorization")
        if header is None:
            response = ProxyError(401, "unauthorized", "the admin endpoint needs Authorization: Bearer <token>").response()
            response.headers["WWW-Authenticate"] = 'Bearer realm="mooncake-proxy-admin"'
            return response
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"),
                                                                 token):
            log.warning("admin: refused a %s %s with a wrong token from %s", request.method, request.path,
                        request.remote_addr)
            return ProxyError(403, "forbidden", "wrong admin token").response()
        return None

    def listing() -> dict[str, Any]:
        draining[:] = [u for u in draining if u.outstanding > 0]
        return {PREFILL: [describe(u) for u in router.balancer(PREFILL).upstreams],
                DECODE: [describe(u) for u in router.balancer(DECODE).upstreams],
                "draining": [describe(u) for u in draining]}

    def answer(status: int, payload: Any) -> Response:
        return Response(json.dumps(payload), status=status, content_type="application/json")

    @app.get(PATH)
    async def instances() -> Response:
        return refused() or answer(200, listing())

    @app.post(PATH)
    async def add_instance() -> Response:
        if (denied := refused()) is not None:
            return denied
        try:
            role, url, bootstrap = parse_instance(await request.get_data(), config.protocol == "bootstrap")
            balancer = router.balancer(role)
            if balancer.find(url) is not None:
                raise ProxyError(409, "conflict", f"{url} is already a {role} instance")
            if len(balancer.upstreams) >= MAX_INSTANCES:
                raise ProxyError(409, "conflict", f"{role} has {MAX_INSTANCES} instances already (the most allowed)")
        except ProxyError as error:
            return error.response()
        upstream = balancer.add(url, bootstrap)
        router.resize()
        router.refresh(upstream)
        log.info("admin: added %s (%s)", upstream.name, url)
        return answer(201, describe(upstream))

    @app.delete(PATH)
    async def remove_instance() -> Response:
        if (denied := refused()) is not None:
            return denied
        try:
            role, url, _ = parse_instance(await request.get_data(), False)
            balancer = router.balancer(role)
            if (upstream := balancer.find(url)) is None:
                raise ProxyError(404, "not_found", f"{url} is not a {role} instance")
            if len(balancer.upstreams) == 1:
                raise ProxyError(409, "conflict", f"{url} is the last {role} instance: add another one first")
        except ProxyError as error:
            return error.response()
        router.pool_lost(upstream, "removed")  # it stops soon, and its share of its KV pool with it
        balancer.remove(upstream)
        router.resize()
        if upstream.outstanding:
            draining.append(upstream)
        log.info("admin: removed %s (%s); %d request(s) of it in flight finish there", upstream.name, url,
                 upstream.outstanding)
        return answer(200, describe(upstream))
