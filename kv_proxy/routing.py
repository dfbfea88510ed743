"""``Router``: the instances each request goes to and whether it is prefilled remotely (``--routing prefix`` or
``estimate``), each choice counted on /metrics, the prefix indexes kept bounded and fresh, and token estimates
calibrated. A KV pool that instances share has an index of its own: what one member answered, every member can load.
One request's bookkeeping through the fleet is its ``Routed`` (``kv_proxy.routed``); docs/proxy.md tells the
rules."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kv_proxy.balancer import Balancer, Choice, Upstream
from kv_proxy.config import DECODE, PREFILL, ProxyConfig
from kv_proxy.discovery import METRICS_TOPIC, Discovery, InstanceInfo
from kv_proxy.estimate import LOCAL, ON_PREFILL, REMOTE, Decision, decide, local_option, remote_option
from kv_proxy.prefix_index import CHUNK_TOKENS, DEFAULT_CACHE_TOKENS, CacheInfo, CharsPerToken, Fingerprint, PrefixIndex

log = logging.getLogger(__name__)

RETRY = 5.0  # seconds before an instance whose /metrics could not be read is asked again (by the router)
POOL = "pool"  # the prefix index entries of the KV pools, as /metrics names them


class Router:
    """The choices of both roles, their bounds and their counters (docs/proxy.md)."""

    def __init__(self, config: ProxyConfig, prefill: Balancer, decode: Balancer, discovery: Discovery,
                 registry: CollectorRegistry) -> None:
        self.config = config
        self.balancers = {PREFILL: prefill, DECODE: decode}
        self.discovery = discovery
        discovery.watch(self.observe)  # whoever reads an instance's /metrics, the router hears what they say
        self.calibration = {True: CharsPerToken(), False: CharsPerToken()}  # chat, text
        self.refreshing: dict[int, asyncio.Task[None]] = {}  # background reads of /metrics, by instance
        self.pools: dict[str, PrefixIndex] = {}  # by KV pool (its master's address): the prompts its members answered
        self.routed = Counter("mooncake_proxy_routed", "Requests sent to an instance, by role and by the rule that "
                              "chose it (prefix: it held the longest cached prefix; balance: least outstanding).",
                              ["role", "rule"], registry=registry)
        self.passed_over = Counter("mooncake_proxy_prefix_passed_over", "Choices where the instance holding the "
                                   "longest prefix was overloaded (--balance-slack) and another one was chosen.",
                                   ["role"], registry=registry)
        self.cached_tokens = Counter("mooncake_proxy_cached_prefix_tokens", "Estimated prompt tokens the chosen "
                                     "instance already held (prefix index).", ["role"], registry=registry)
        self.skipped = Counter("mooncake_proxy_prefill_skipped", "Requests without a remote prefill: sent whole to "
                               "a decode instance (uncached prompt below --skip-prefill-below tokens, or below "
                               "--pool-tail on a KV pool member, or faster there by the estimate) or, "
                               "--decode-on-prefill, to a prefill instance.", registry=registry)
        self.decisions = Counter("mooncake_proxy_route_decisions", "Why each request was prefilled remotely or "
                                 "computed whole on its decode instance (local) or on a prefill instance (on_prefill): "
                                 "below_threshold / not_below_threshold (--skip-prefill-below, and --pool-tail on a KV "
                                 "pool member), pooled (a KV pool member, below --pool-tail), never (no skipping), "
                                 "unsized (prompt_embeds), not_learned (--routing estimate before the costs are known), "
                                 "faster_locally / faster_remotely / faster_on_prefill (the estimate), above_bound.",
                                 ["choice", "reason"], registry=registry)
        self.estimated = Gauge("mooncake_proxy_estimated_cost_seconds", "What work costs on each instance, as the "
                               "proxy learned it: prefill_per_token, prefill_base, load_per_token, load_base, step.",
                               ["role", "instance", "cost"], registry=registry)
        entries = Gauge("mooncake_proxy_prefix_index_entries", "Prefix chunks indexed, all instances of the role "
                        "(pool: all KV pools' indexes).", ["role"], registry=registry)
        for role in (PREFILL, DECODE):
            entries.labels(role=role).set_function(lambda role=role: sum(len(u.prefix) for u in self.balancer(role)
                                                                        .upstreams))
        entries.labels(role=POOL).set_function(lambda: sum(len(index) for index in self.pools.values()))
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
        """``balancer.reserve(hint)``, counted; the instance's /metrics refreshed in the background if stale. With
        ``--routing estimate`` the estimated time to the first token chooses, once it can be estimated."""
        score = None
        if self.config.routing == "estimate" and hint is not None:
            score = self._prefill_scores(hint) if balancer.role == PREFILL else self._decode_scores(hint)
        choice = balancer.reserve(hint, score)
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

    def uncached(self, upstream: Upstream, hint: Fingerprint, confirmed: bool = False, pool: bool = True) -> float:
        """Estimated tokens of the prompt ``upstream`` does not hold (``confirmed``: counting only prefixes it
        answered; sized cautiously, see ``route``): the longer of what it holds itself and (``pool``) what its KV
        pool holds, which it loads from there rather than compute. ``pool`` false: what it lacks in its own cache,
        e.g. what a decode loads after a remote prefill (from the producer or the pool)."""
        held = upstream.prefix.match(hint.chunks, confirmed=confirmed)
        if pool:
            held = max(held, self.pool_held(upstream, hint))
        total = self.tokens(hint, cautious=True)
        return total - min(self.tokens(hint, held * hint.chunk_units, cautious=True), total)

    # ---------------------------------------------------------------- KV pools
    def pool(self, upstream: Upstream) -> str:
        """The KV pool ``upstream`` shares, as the routing counts it: "" if none, and always with --protocol
        bootstrap (vLLM's own connector knows no pool-only decode)."""
        return upstream.pool if self.config.protocol == "params" else ""

    def _pool_index(self, upstream: Upstream) -> PrefixIndex | None:
        name = self.pool(upstream)
        return self.pools.get(name) if name else None

    def pool_held(self, upstream: Upstream, hint: Fingerprint) -> int:
        """How many of the prompt's chunks, from the first, ``upstream``'s KV pool holds (a member answered them)."""
        index = self._pool_index(upstream)
        return 0 if index is None else index.match(hint.chunks, confirmed=True)

    def pool_answered(self, upstream: Upstream, hint: Fingerprint) -> None:
        """``upstream`` answered a request of this prompt: a pool member stores the prompt's KV in its pool as the
        request ends (whole blocks, off the forward path: the pool may lag the answer by a moment), so the prompt's
        chunks are added to the pool's index as answered."""
        index = self._pool_index(upstream)
        if index is not None:
            index.add(hint.chunks)
            index.confirm(hint.chunks)

    def pool_lost(self, upstream: Upstream, why: str) -> None:
        """A member restarted or left: the pool's objects its memory held (mode embedded: its segment) went with it,
        and which ones the proxy cannot tell, so the pool's index is emptied."""
        index = self._pool_index(upstream)
        if index is not None and len(index):
            log.info("KV pool %s: forgetting its %d indexed prefix chunks (%s %s)", upstream.pool, len(index),
                     upstream.name, why)
            index.clear()

    def _best_prefill(self, hint: Fingerprint) -> tuple[Upstream, float] | None:
        """The prefill instance where the prompt's prefill would end first, and its uncached tokens there; None
        while any candidate's costs are unknown."""
        upstreams = [u for u in self.balancers[PREFILL].upstreams if not u.cooling_down()]
        if not upstreams or not all(u.costs.prefill.known for u in upstreams):
            return None
        best = min(upstreams, key=lambda u: u.costs.prefill.predict(u.work.tokens + self.uncached(u, hint)))
        return best, self.uncached(best, hint)

    def _prefill_scores(self, hint: Fingerprint) -> Callable[[list[Upstream]], list[float] | None]:
        def score(pool: list[Upstream]) -> list[float] | None:
            if not all(u.costs.prefill.known for u in pool):
                return None
            return [u.costs.prefill.predict(u.work.tokens + self.uncached(u, hint)) for u in pool]
        return score

    def _decode_scores(self, hint: Fingerprint) -> Callable[[list[Upstream]], list[float] | None]:
        """Each decode instance's cost: the better of its two options (remote via the best prefill instance, or
        whole there), the time it makes its running requests wait included."""
        def score(pool: list[Upstream]) -> list[float] | None:
            best = self._best_prefill(hint)
            if best is None or not all(u.costs.load.known for u in pool):
                return None
            prefill, uncached_p = best
            bound = self.config.skip_prefill_below
            scores = []
            for upstream in pool:
                uncached_d = self.uncached(upstream, hint)
                loaded_d = self.uncached(upstream, hint, pool=False)  # a decode after a remote prefill loads it all
                via = remote_option(prefill.costs, prefill.work, uncached_p, upstream.costs, loaded_d).cost
                if not bound or uncached_d < bound:
                    fit = upstream.costs.prefill if upstream.costs.prefill.known else prefill.costs.prefill
                    via = min(via, local_option(upstream.costs, upstream.work, uncached_d, fit).cost)
                scores.append(via)
            return scores
        return score

    def route(self, decode: Choice, hint: Fingerprint | None, request_id: str,
              output_tokens: float | None = None) -> tuple[str, Upstream | None]:
        """Where the request goes: ``remote`` (prefill remotely, decode on ``decode``), ``local`` (the decode instance
        computes the prompt itself) or, with ``--decode-on-prefill``, ``on_prefill`` (the whole request on the
        prefill instance returned). ``--routing prefix``: local when its uncached part (estimated) is below
        ``--skip-prefill-below`` tokens. ``--routing estimate``: ``kv_proxy.estimate.decide`` (``output_tokens``: the
        request's, if it says). ``--routing prefix`` on a KV pool member: also local when its uncached part (what
        neither it nor its pool holds) is below ``--pool-tail``. Always remote for a prompt the index cannot size
        (``prompt_embeds``). Cautious: only chunks the instance or a member of its pool has answered count as cached
        (a prompt routed there a moment ago may still be loading), and a text prompt is sized with the lowest
        characters per token seen lately (a character per token before any calibration)."""
        threshold = self.config.skip_prefill_below
        upstream = decode.upstream
        if hint is None:
            return self._decided(REMOTE, "unsized"), None
        uncached = self.uncached(upstream, hint, confirmed=True)
        total = self.tokens(hint, cautious=True)
        if self.config.routing == "estimate":
            best = self._best_prefill(hint)
            if best is None:
                return self._decided(REMOTE, "not_learned"), None
            prefill, uncached_p = best
            decision = decide(prefill.costs, prefill.work, uncached_p, upstream.costs, upstream.work, uncached,
                              threshold, self.config.decode_on_prefill, output_tokens,
                              loaded_d=self.uncached(upstream, hint, confirmed=True, pool=False))
            log.info("[%s] %s: ~%d of ~%d prompt tokens uncached on %s%s", request_id, self._explain(decision),
                     uncached, total, upstream.name, "" if decision.via is None else f" (~{uncached_p:.0f} on "
                     f"{prefill.name})")
            return self._decided(decision.where, decision.reason), prefill if decision.where == ON_PREFILL else None
        tail = self.config.pool_tail if self.pool(upstream) else 0
        if not threshold and not tail:
            return self._decided(REMOTE, "never"), None
        if uncached < threshold:
            where, reason, why = LOCAL, "below_threshold", f"below --skip-prefill-below {threshold}"
        elif uncached < tail:  # the pool (and its cache) hold all but a tail it computes cheaply
            where, reason, why = LOCAL, "pooled", f"a KV pool member, below --pool-tail {tail}"
        else:
            limits = [f"--skip-prefill-below {threshold}"] if threshold else []
            limits += [f"--pool-tail {tail} (a KV pool member)"] if tail else []
            where, reason, why = REMOTE, "not_below_threshold", "not below " + " nor ".join(limits)
        log.info("[%s] %s prefill: ~%d of ~%d prompt tokens uncached on %s (rule %s), %s", request_id,
                 "skipped the" if where == LOCAL else "remote", uncached, total, upstream.name, decode.rule, why)
        return self._decided(where, reason), None

    @staticmethod
    def _explain(decision: Decision) -> str:
        if decision.via is None:
            return f"remote prefill ({decision.reason})"
        said = {REMOTE: "remote prefill", LOCAL: "skipped the prefill", ON_PREFILL: "whole on the prefill instance"}
        options = [f"remote ~{decision.via.cost:.3f} s"]
        if decision.local is not None:
            options.append(f"local ~{decision.local.first_token:.3f} s + ~{decision.local.imposed:.3f} s for the "
                           "requests decoding there")
        if decision.on_prefill is not None:
            whole = decision.on_prefill
            options.append(f"on the prefill instance ~{whole.first_token:.3f} s + ~{whole.imposed:.3f} s for the "
                           f"requests decoding there, its decode ~{whole.decode:+.3f} s against the decode instance's")
        return f"{said[decision.where]} ({decision.reason}: {', '.join(options)})"

    def _decided(self, where: str, reason: str) -> str:
        self.decisions.labels(choice=where, reason=reason).inc()
        if where != REMOTE:
            self.skipped.inc()
        return where

    def take(self, balancer: Balancer, upstream: Upstream, hint: Fingerprint | None) -> int:
        """Count ``upstream`` busy with the request (chosen by ``route``), as ``reserve`` does with its choice; the
        prompt's chunks it held when chosen."""
        balancer.acquire(upstream)
        held = upstream.prefix.match(hint.chunks) if hint is not None else 0
        if hint is not None:
            upstream.prefix.add(hint.chunks)
        self.routed.labels(role=balancer.role, rule="estimate").inc()
        self.refresh(upstream)
        return held

    def publish(self, upstream: Upstream) -> None:
        """``upstream``'s learned costs on /metrics."""
        name = str(upstream.index)
        costs = upstream.costs
        (prefill_base, prefill_per_token), (load_base, load_per_token) = costs.prefill.line(), costs.load.line()
        for cost, value in (("prefill_base", prefill_base), ("prefill_per_token", prefill_per_token),
                            ("load_base", load_base), ("load_per_token", load_per_token), ("step", costs.step)):
            self.estimated.labels(role=upstream.role, instance=name, cost=cost).set(value)

    # ---------------------------------------------------------------- bounds and freshness
    def resize(self) -> None:
        """Every index's capacity: an instance's, its cache's size in chunks; a KV pool's, as its largest member's;
        each within an equal share of --prefix-index-entries (the pools counted with the instances). A pool without
        members loses its index."""
        upstreams = self.balancers[PREFILL].upstreams + self.balancers[DECODE].upstreams
        members: dict[str, list[Upstream]] = {}
        for upstream in upstreams:
            if name := self.pool(upstream):
                members.setdefault(name, []).append(upstream)
        for name in set(self.pools) - set(members):
            del self.pools[name]
        share = self.config.prefix_index_entries // max(len(upstreams) + len(members), 1)

        def bound(upstream: Upstream) -> int:
            return min(max((upstream.cache.tokens or DEFAULT_CACHE_TOKENS) // CHUNK_TOKENS, 1), share)

        for upstream in upstreams:
            upstream.prefix.resize(bound(upstream))
        # A pool's size is on no /metrics the proxy reads (its members give it bytes; the KV's bytes per token are not
        # known here), so its index is bounded as its largest member's. Too small, and a prompt the pool still holds
        # is prefilled remotely; too large, and a pool-only decode computes what the pool evicted: both only cost time.
        for name, group in members.items():
            self.pools.setdefault(name, PrefixIndex(0)).resize(max(bound(u) for u in group))

    def observe(self, upstream: Upstream, info: InstanceInfo) -> None:
        """What an instance's /metrics said: a restart (another start time or cache size) empties its index and its
        KV pool's (see ``pool_lost``); one that names another pool counts as that pool's member from now on (and
        forgets what it held: the pool is set when the instance starts, so it restarted)."""
        before, after = upstream.cache, info.cache
        changed = False
        if (before.started, before.tokens) != (after.started, after.tokens):
            if before != CacheInfo():
                upstream.forget("restarted: its /metrics changed")
                self.pool_lost(upstream, "restarted")
            upstream.cache = after
            changed = True
        if info.pool != upstream.pool:
            if upstream.pool:
                upstream.forget("its KV pool changed")
            upstream.pool = info.pool
            changed = True
        if changed:
            self.resize()

    def refresh(self, upstream: Upstream) -> None:
        """Read the instance's /metrics in the background (``Discovery.metrics``: at most once per DISCOVERY_TTL)."""
        now = time.monotonic()
        if self.config.prefix_index_entries == 0 or id(upstream) in self.refreshing or \
                self.discovery.knows(upstream, METRICS_TOPIC) or now - upstream.cache_asked < RETRY:
            return
        upstream.cache_asked = now

        async def run() -> None:
            try:
                await self.discovery.metrics(upstream)
            except Exception as error:  # whatever it is, a request to it will meet it too
                log.debug("%s: no /metrics (%r)", upstream.url, error)
            finally:
                del self.refreshing[id(upstream)]

        self.refreshing[id(upstream)] = asyncio.ensure_future(run())

    async def stop(self) -> None:
        for task in list(self.refreshing.values()):
            task.cancel()
