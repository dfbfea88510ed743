"""What the instances say about themselves: ``Discovery`` asks them over the proxy's client session (their /metrics:
``InstanceInfo``; a bootstrap server's engine id) at most once per ``DISCOVERY_TTL`` per topic, and tells its
watchers (the router) what each /metrics read says. It knows neither the request flow nor the routing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kv_connector.param_keys import (
    ENDPOINT_INFO,
    KV_ROLE_LABEL,
    PIPES_LABEL,
    POOL_LABEL,
    PUSH_PROOF_LABEL,
    TRANSFER_MODE_LABEL,
)
from kv_proxy.balancer import Upstream
from kv_proxy.prefix_index import CacheInfo, cache_info

log = logging.getLogger(__name__)

DISCOVERY_TTL = 30.0  # seconds what an instance said about itself (push address, engine id) is reused
METRICS_TOPIC = "metrics"  # Discovery.learn's topic for what an instance's /metrics say (InstanceInfo)
MAX_POOL = 256  # characters of a pool's name (its master's host:port) taken from an instance's /metrics


def endpoint_labels(metrics: str) -> list[dict[str, str]]:
    """The labels of each sample of our connector's endpoint info on a /metrics text (one per engine)."""
    lines = [line for line in metrics.splitlines() if line.startswith(ENDPOINT_INFO + "{")]
    return [sample.labels for family in text_string_to_metric_families("\n".join(lines) + "\n")
            for sample in family.samples]


def push_target(metrics: str) -> tuple[list[str], str] | None:
    """A decode instance's pipe addresses and their proof ("" without a secret) if its /metrics text says it runs
    our connector as a push-mode consumer."""
    for labels in endpoint_labels(metrics):
        if (labels.get(KV_ROLE_LABEL) == "kv_consumer" and labels.get(TRANSFER_MODE_LABEL) == "push"
                and labels.get(PIPES_LABEL)):
            return labels[PIPES_LABEL].split(","), labels.get(PUSH_PROOF_LABEL, "")
    return None


def kv_pool(metrics: str) -> str:
    """The KV pool an instance shares (its master's ``host:port``, the endpoint info's ``kv_pool`` label), "" if
    none: instances naming the same pool find each other's KV there."""
    for labels in endpoint_labels(metrics):
        pool = labels.get(POOL_LABEL, "").strip()
        if pool and len(pool) <= MAX_POOL:
            return pool
    return ""


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance's /metrics say: where it takes pushed KV (ParamsProtocol), its cache and its KV pool (the
    router)."""

    push_target: tuple[tuple[str, ...], str] | None
    cache: CacheInfo
    pool: str = ""  # "": no pool


def instance_info(metrics: str) -> InstanceInfo:
    target = push_target(metrics)
    return InstanceInfo(None if target is None else (tuple(target[0]), target[1]), cache_info(metrics),
                        kv_pool(metrics))


class Discovery:
    """What each instance said about itself, by topic (kept on its ``Upstream``), and how to ask it."""

    def __init__(self, session: Callable[[], aiohttp.ClientSession], timeout: aiohttp.ClientTimeout) -> None:
        self._session = session  # the proxy's client session (it exists only while the proxy serves)
        self._timeout = timeout
        self._watchers: list[Callable[[Upstream, InstanceInfo], None]] = []
        self._asking: dict[tuple[int, str], asyncio.Future[Any]] = {}  # (instance, topic): the call under way

    def watch(self, watcher: Callable[[Upstream, InstanceInfo], None]) -> None:
        """Tell ``watcher`` every time an instance's /metrics are read (before the answer is remembered)."""
        self._watchers.append(watcher)

    def knows(self, upstream: Upstream, topic: str) -> bool:
        """Whether what the instance said on ``topic`` was learned less than DISCOVERY_TTL ago."""
        return upstream.knows(topic, DISCOVERY_TTL)

    async def learn(self, upstream: Upstream, fetch: Callable[[Upstream], Awaitable[Any]], topic: str) -> Any:
        """What ``fetch`` says about an instance on ``topic``, asked at most once per DISCOVERY_TTL (concurrent
        requests share one call; a failed call is not remembered)."""
        if self.knows(upstream, topic):
            return upstream.said(topic)
        key = (id(upstream), topic)  # the call under way holds the upstream: its id is not reused meanwhile
        if key not in self._asking:
            async def run() -> Any:
                try:
                    value = await fetch(upstream)
                    upstream.remember(topic, value)
                    return value
                finally:
                    del self._asking[key]
            future = self._asking[key] = asyncio.ensure_future(run())
            future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if nobody waits
        return await asyncio.shield(self._asking[key])  # a client leaving does not cancel the others' call

    async def metrics(self, upstream: Upstream) -> InstanceInfo:
        """``instance_info`` learned (topic ``METRICS_TOPIC``: at most one read per DISCOVERY_TTL)."""
        info: InstanceInfo = await self.learn(upstream, self.instance_info, METRICS_TOPIC)
        return info

    async def instance_info(self, upstream: Upstream) -> InstanceInfo:
        """What the instance's /metrics say (push address, cache size, start time); the watchers are told."""
        info = instance_info(await self.get_text(upstream.url + "/metrics"))
        for watcher in self._watchers:
            watcher(upstream, info)
        before = upstream.said(METRICS_TOPIC)
        if info.push_target and before != info:
            log.info("%s %s takes pushed KV at %s", upstream.role, upstream.url, list(info.push_target[0]))
        if info.pool and (before is None or before.pool != info.pool):
            log.info("%s %s shares the KV pool at %s", upstream.role, upstream.url, info.pool)
        return info

    async def get_text(self, url: str) -> str:
        """The body of a GET; "" if there is no such page (404: nothing to learn there)."""
        async with self._session().get(url, timeout=self._timeout) as response:
            if response.status == 404:
                return ""
            response.raise_for_status()
            return await response.text()
