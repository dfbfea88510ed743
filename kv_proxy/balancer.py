"""Which instance of a role serves the next request: ``Upstream`` (one instance and its bookkeeping), ``Choice`` (a
pick and why) and ``Balancer`` (one per role: ``pick``, what each instance has under way, failures and cooldowns,
instances added and removed). The rules: docs/proxy.md#choosing-instances."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kv_proxy.estimate import Costs, Work
from kv_proxy.prefix_index import CacheInfo, Fingerprint, PrefixIndex

log = logging.getLogger(__name__)

PREFIX, BALANCE, ESTIMATE = "prefix", "balance", "estimate"  # the rules of a choice, as /metrics names them


@dataclass(eq=False)
class Upstream:
    """One vLLM instance and its bookkeeping."""

    url: str
    role: str
    index: int = 0  # its number among the instances its role ever had (never reused): what clients are told
    bootstrap: str = ""  # --protocol bootstrap, a prefill instance: its bootstrap server
    outstanding: int = 0  # requests sent and not finished (a stream counts until its last byte)
    down_until: float = 0.0  # time.monotonic() before which the instance is skipped
    failures: int = 0
    last_error: str | None = None
    removed: bool = False  # taken out by the admin API: its requests in flight finish, no new one comes
    learned: dict[str, Any] = field(default_factory=dict)  # what it said about itself, by topic (see Discovery.learn)
    learned_at: dict[str, float] = field(default_factory=dict)
    cache: CacheInfo = field(default_factory=CacheInfo)  # its KV cache size and start time, from its /metrics
    cache_asked: float = float("-inf")  # time.monotonic() of the last attempt to read them
    pool: str = ""  # the KV pool it shares (its master's address, from its /metrics); "": none, or not said yet
    prefix: PrefixIndex = field(default_factory=lambda: PrefixIndex(0))  # the prompt prefixes routed to it
    costs: Costs = field(default_factory=Costs)  # what work cost there, learned from its answers (--routing estimate)
    work: Work = field(default_factory=Work)  # what it was sent and has not answered yet

    @property
    def name(self) -> str:
        """How clients hear of it: role and index, never its URL (an internal address)."""
        return f"{self.role} instance {self.index}"

    def cooling_down(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.down_until

    def knows(self, topic: str, ttl: float) -> bool:
        """Whether it said something about itself on ``topic`` less than ``ttl`` seconds ago."""
        at = self.learned_at.get(topic)
        return at is not None and time.monotonic() - at < ttl

    def said(self, topic: str) -> Any:
        """What it said last on ``topic`` (None if never), however long ago."""
        return self.learned.get(topic)

    def remember(self, topic: str, value: Any) -> None:
        """What it says on ``topic`` now. An instance that says something new about itself may have restarted: its
        prefix index is emptied."""
        if topic in self.learned and self.learned[topic] != value:
            self.forget(f"its {topic} changed")
        self.learned[topic] = value
        self.learned_at[topic] = time.monotonic()

    def ask_again(self) -> None:
        """What it said is stale (it may come back as another engine, e.g. after a failure): ask again."""
        self.learned_at.clear()

    def forget(self, why: str) -> None:
        """It may hold nothing of what was routed to it (a restart, a failure): its prefix index is emptied."""
        if len(self.prefix):
            log.info("%s (%s): forgetting its %d indexed prefix chunks (%s)", self.name, self.url, len(self.prefix), why)
        self.prefix.clear()


@dataclass(frozen=True)
class Choice:
    """A pick: the instance, the rule that chose it, how many chunks of the prompt it holds, and whether an instance
    holding a longer prefix was passed over for its load."""

    upstream: Upstream
    rule: str = BALANCE
    cached: int = 0
    passed_over: bool = False


@dataclass
class Balancer:
    """The instances of one role and the choice among them (see ``pick``)."""

    role: str
    upstreams: list[Upstream]
    cooldown: float
    slack: int = 4
    _next: int = field(default=0, repr=False)
    _numbered: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._numbered = max((u.index + 1 for u in self.upstreams), default=0)

    @classmethod
    def from_urls(cls, role: str, urls: Iterable[str], cooldown: float, slack: int = 4) -> Balancer:
        return cls(role, [Upstream(url, role, i) for i, url in enumerate(urls)], cooldown, slack)

    def pick(self, exclude: Iterable[Upstream] = (), hint: Fingerprint | None = None,
             score: Callable[[list[Upstream]], list[float] | None] | None = None) -> Choice | None:
        """The best instance not in ``exclude``; cooling-down ones only if nothing else is left. None if none. With
        a ``hint`` the chosen instance is recorded as holding the prompt from now on. ``score``: the candidates'
        estimated seconds to the request's first token (the lowest wins, rule ``estimate``), or None where they
        cannot be estimated yet (then the prefix rule chooses)."""
        excluded = {id(u) for u in exclude}
        now = time.monotonic()
        candidates = [u for u in self.upstreams if id(u) not in excluded]
        pool = [u for u in candidates if not u.cooling_down(now)] or candidates
        if not pool:
            return None
        least = min(u.outstanding for u in pool)
        held = {id(u): u.prefix.match(hint.chunks) for u in pool} if hint is not None and hint.chunks else {}
        longest = max(held.values(), default=0)
        scores = score(pool) if score is not None and len(pool) > 1 else None
        eligible = [u for u in pool if u.outstanding <= least + self.slack]
        best = max((held.get(id(u), 0) for u in eligible), default=0)
        if scores is not None:
            lowest = min(scores)
            group = [u for u, s in zip(pool, scores, strict=True) if s <= lowest * (1 + 1e-6) + 1e-9]
            upstream = self._rotate(group)
            mine = held.get(id(upstream), 0)
            chosen = Choice(upstream, ESTIMATE, mine, longest > mine)
        elif best > 0:
            group = [u for u in eligible if held[id(u)] == best]
            chosen = Choice(self._rotate(group), PREFIX, best, longest > best)
        else:
            chosen = Choice(self._rotate(pool), BALANCE, 0, longest > 0)
        if hint is not None:
            chosen.upstream.prefix.add(hint.chunks)
        return chosen

    def pick_upstream(self, exclude: Iterable[Upstream] = (), hint: Fingerprint | None = None) -> Upstream | None:
        """``pick``'s instance."""
        choice = self.pick(exclude, hint)
        return None if choice is None else choice.upstream

    def _rotate(self, group: list[Upstream]) -> Upstream:
        """Of ``group``, the one with the fewest outstanding requests, the next in round robin order on ties."""
        fewest = min(u.outstanding for u in group)
        members = {id(u) for u in group if u.outstanding == fewest}
        count = len(self.upstreams)
        for step in range(count):
            index = (self._next + step) % count
            upstream = self.upstreams[index]
            if id(upstream) in members:
                self._next = (index + 1) % count
                return upstream
        raise AssertionError("unreachable: the group is a subset of the upstreams")

    def reserve(self, hint: Fingerprint | None = None,
                score: Callable[[list[Upstream]], list[float] | None] | None = None) -> Choice:
        """Pick an instance and count it as busy now (the caller releases it)."""
        choice = self.pick(hint=hint, score=score)
        assert choice is not None, "a balancer has at least one instance"
        self.acquire(choice.upstream)
        return choice

    def acquire(self, upstream: Upstream) -> None:
        upstream.outstanding += 1

    def release(self, upstream: Upstream) -> None:
        upstream.outstanding -= 1

    def mark_failed(self, upstream: Upstream, error: str) -> None:
        upstream.failures += 1
        upstream.last_error = error
        upstream.down_until = time.monotonic() + self.cooldown
        upstream.ask_again()  # it may come back as another engine (a restart)
        upstream.forget("it failed")
        log.warning("%s %s failed (%s); skipped for %.1f s", self.role, upstream.url, error, self.cooldown)

    def find(self, url: str) -> Upstream | None:
        return next((u for u in self.upstreams if u.url == url), None)

    def add(self, url: str, bootstrap: str = "") -> Upstream:
        """A new instance (``url`` normalized and not already there), numbered after every one its role ever had."""
        upstream = Upstream(url, self.role, self._numbered, bootstrap)
        self._numbered += 1
        self.upstreams = [*self.upstreams, upstream]
        return upstream

    def remove(self, upstream: Upstream) -> None:
        """No new request goes to ``upstream``; those in flight finish (they hold it and release it as usual)."""
        self.upstreams = [u for u in self.upstreams if u is not upstream]
        upstream.removed = True
        upstream.forget("removed")
