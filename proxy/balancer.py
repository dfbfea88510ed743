"""Which instance of a role serves the next request: ``Upstream`` (one instance and its bookkeeping) and
``Balancer`` (one per role).

``Balancer.pick`` is the one choice; ``reserve``/``acquire``/``release`` count what each instance has under way and
``mark_failed`` puts a failed instance aside for the cooldown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


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
