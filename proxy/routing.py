"""Routing around ``Balancer.pick``: ``Router`` keeps the prefix indexes bounded and fresh, counts each choice on the
proxy's /metrics, calibrates token estimates, and decides when the remote prefill is not worth it (``skip_prefill``).

Bounds: every instance's index holds at most the chunks its KV cache holds (``vllm:cache_config_info`` on its
/metrics: ``num_gpu_blocks * block_size`` tokens, ``DEFAULT_CACHE_TOKENS`` if it does not say), and all indexes
together at most ``--prefix-index-entries`` chunks (each instance gets an equal share). An instance's /metrics are
read in the background at most once per ``DISCOVERY_TTL`` (``Discovery``, which tells the router what they say
whoever reads them); one whose process start time or cache size changed (a restart) loses its index, as does one
that failed or was removed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from proxy.balancer import Balancer, Choice, Upstream
from proxy.config import DECODE, PREFILL, ProxyConfig
from proxy.discovery import METRICS_TOPIC, Discovery, InstanceInfo
from proxy.prefix_index import CHUNK_TOKENS, DEFAULT_CACHE_TOKENS, CacheInfo, CharsPerToken, Fingerprint

log = logging.getLogger(__name__)

RETRY = 5.0  # seconds before an instance whose /metrics could not be read is asked again (by the router)


class Router:
    """The choices of both roles, their bounds and their counters (see the module docstring)."""

    def __init__(self, config: ProxyConfig, prefill: Balancer, decode: Balancer, discovery: Discovery,
                 registry: CollectorRegistry) -> None:
        self.config = config
        self.balancers = {PREFILL: prefill, DECODE: decode}
        self.discovery = discovery
        discovery.watch(self.observe)  # whoever reads an instance's /metrics, the router hears what they say
        self.calibration = {True: CharsPerToken(), False: CharsPerToken()}  # chat, text
        self._refreshing: dict[int, asyncio.Task[None]] = {}
        self.routed = Counter("mooncake_proxy_routed", "Requests sent to an instance, by role and by the rule that "
                              "chose it (prefix: it held the longest cached prefix; balance: least outstanding).",
                              ["role", "rule"], registry=registry)
        self.passed_over = Counter("mooncake_proxy_prefix_passed_over", "Choices where the instance holding the "
                                   "longest prefix was overloaded (--balance-slack) and another one was chosen.",
                                   ["role"], registry=registry)
        self.cached_tokens = Counter("mooncake_proxy_cached_prefix_tokens", "Estimated prompt tokens the chosen "
                                     "instance already held (prefix index).", ["role"], registry=registry)
        self.skipped = Counter("mooncake_proxy_prefill_skipped", "Requests sent straight to a decode instance "
                               "(uncached prompt below --skip-prefill-below tokens).", registry=registry)
        entries = Gauge("mooncake_proxy_prefix_index_entries", "Prefix chunks indexed, all instances of the role.",
                        ["role"], registry=registry)
        for role in (PREFILL, DECODE):
            entries.labels(role=role).set_function(lambda role=role: sum(len(u.prefix) for u in self.balancer(role)
                                                                        .upstreams))
        self.resize()

    def balancer(self, role: str) -> Balancer:
        """The balancer of ``role`` (prefill or decode)."""
        return self.balancers[role]

    # ---------------------------------------------------------------- estimates
    def tokens(self, hint: Fingerprint, units: int | None = None, cautious: bool = False) -> float:
        """Estimated tokens of ``units`` of the prompt (characters or tokens; default the whole prompt). ``cautious``:
        as many tokens as recent prompts of that kind were seen to hold at most (the lowest characters per token
        among them); until a prefill answer has calibrated the ratio, a character counts as a token."""
        units = hint.size if units is None else units
        if hint.tokens:
            return float(units)
        ratio = self.calibration[hint.chat]
        return units / (ratio.low if cautious else ratio.value)

    def cached(self, hint: Fingerprint | None, choice: Choice) -> float:
        return 0.0 if hint is None else min(self.tokens(hint, choice.cached * hint.chunk_units), self.tokens(hint))

    def calibrate(self, hint: Fingerprint | None, answer: dict[str, Any] | None) -> None:
        """Characters per token from a prefill answer's ``usage.prompt_tokens`` (text prompts only)."""
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if hint is not None and not hint.tokens and isinstance(usage, dict):
            self.calibration[hint.chat].observe(hint.size, usage.get("prompt_tokens"))

    # ---------------------------------------------------------------- choices
    def reserve(self, balancer: Balancer, hint: Fingerprint | None, request_id: str) -> Choice:
        """``balancer.reserve(hint)``, counted; the instance's /metrics refreshed in the background if stale."""
        choice = balancer.reserve(hint)
        self.routed.labels(role=balancer.role, rule=choice.rule).inc()
        if choice.passed_over:
            self.passed_over.labels(role=balancer.role).inc()
        cached = self.cached(hint, choice)
        if cached:
            self.cached_tokens.labels(role=balancer.role).inc(cached)
        log.debug("[%s] %s: %s (rule %s, ~%d cached tokens, %d outstanding)", request_id, balancer.role,
                  choice.upstream.name, choice.rule, cached, choice.upstream.outstanding)
        self.refresh(choice.upstream)
        return choice

    def skip_prefill(self, decode: Choice, hint: Fingerprint | None, request_id: str) -> bool:
        """Whether the decode instance computes the prompt itself: its uncached part (estimated) is below
        ``--skip-prefill-below`` tokens. Never for a prompt the index cannot size (``prompt_embeds``). Cautious:
        only chunks the instance has answered count as cached (a prompt routed there a moment ago may still be
        loading), and a text prompt is sized with the lowest characters per token seen lately (a character per
        token before any calibration)."""
        threshold = self.config.skip_prefill_below
        if not threshold or hint is None:
            return False
        held = decode.upstream.prefix.match(hint.chunks, confirmed=True) * hint.chunk_units
        total = self.tokens(hint, cautious=True)
        uncached = total - min(self.tokens(hint, held, cautious=True), total)
        skip = uncached < threshold
        if skip:
            self.skipped.inc()
        log.info("[%s] %s prefill: ~%d of ~%d prompt tokens uncached on %s (rule %s), %s --skip-prefill-below %d",
                 request_id, "skipped the" if skip else "remote", uncached, total, decode.upstream.name, decode.rule,
                 "below" if skip else "not below", threshold)
        return skip

    def answered(self, upstream: Upstream, hint: Fingerprint | None) -> None:
        """``upstream`` answered a request for ``hint``'s prompt: it holds that prompt's KV now."""
        if hint is not None:
            upstream.prefix.confirm(hint.chunks)

    # ---------------------------------------------------------------- bounds and freshness
    def resize(self) -> None:
        """Every index's capacity: its cache's size in chunks, within an equal share of --prefix-index-entries."""
        upstreams = self.balancers[PREFILL].upstreams + self.balancers[DECODE].upstreams
        share = self.config.prefix_index_entries // max(len(upstreams), 1)
        for upstream in upstreams:
            upstream.prefix.resize(min(max((upstream.cache.tokens or DEFAULT_CACHE_TOKENS) // CHUNK_TOKENS, 1), share))

    def observe(self, upstream: Upstream, info: InstanceInfo) -> None:
        """What an instance's /metrics said: a restart (another start time or cache size) empties its index."""
        before, after = upstream.cache, info.cache
        if (before.started, before.tokens) != (after.started, after.tokens):
            if before != CacheInfo():
                upstream.forget("restarted: its /metrics changed")
            upstream.cache = after
            self.resize()

    def refresh(self, upstream: Upstream) -> None:
        """Read the instance's /metrics in the background (``Discovery.metrics``: at most once per DISCOVERY_TTL)."""
        now = time.monotonic()
        if self.config.prefix_index_entries == 0 or id(upstream) in self._refreshing or \
                self.discovery.knows(upstream, METRICS_TOPIC) or now - upstream.cache_asked < RETRY:
            return
        upstream.cache_asked = now

        async def run() -> None:
            try:
                await self.discovery.metrics(upstream)
            except Exception as error:  # whatever it is, a request to it will meet it too
                log.debug("%s: no /metrics (%r)", upstream.url, error)
            finally:
                del self._refreshing[id(upstream)]

        self._refreshing[id(upstream)] = asyncio.ensure_future(run())

    async def settle(self) -> None:
        """Wait for the background reads under way."""
        await asyncio.gather(*self._refreshing.values(), return_exceptions=True)

    async def stop(self) -> None:
        for task in list(self._refreshing.values()):
            task.cancel()
