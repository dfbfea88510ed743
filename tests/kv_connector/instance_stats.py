"""What the tests read off a running vLLM instance: the connector's stats and vLLM's counters from /metrics, waits
for loads, lookups and requests to settle, and the warnings of its log since a mark."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable

from harness.vllm import VllmServer

STAT_PREFIX = "vllm:mooncake_kv_"
LOADS = ("loaded", "load_misses", "load_failures")  # the stats of a load's end


def metrics(server: VllmServer) -> dict[str, float]:
    """Every counter and gauge of the instance's /metrics, summed over labels: ``name`` -> value (counters without
    their ``_total``)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
        if name.endswith(("_bucket", "_sum", "_count", "_created")):
            continue
        name = name.removesuffix("_total")
        out[name] = out.get(name, 0.0) + value
    return out


def flush(server: VllmServer) -> None:
    """One engine step that moves no KV: what the instance did before reaches its /metrics (the connector's stats
    travel with its next step)."""
    from kv_proxy.protocols import NO_LOAD  # here: the GPU machines running this folder's cuda tests have no Quart

    server.complete([1, 2, 3], 1, kv_transfer_params=NO_LOAD)  # a consumer loads nothing, a producer keeps nothing


def kv_stats(server: VllmServer, every: dict[str, float] | None = None) -> dict[str, float]:
    """The connector's own stats (``vllm:mooncake_kv_*``) plus vLLM's prefix-cache hit counters, in tokens (from
    ``every``, the instance's ``metrics``, if given)."""
    every = metrics(server) if every is None else every
    out = {name.removeprefix(STAT_PREFIX): v for name, v in every.items() if name.startswith(STAT_PREFIX)}
    out["local_hits"] = every.get("vllm:prefix_cache_hits", 0.0)
    out["external_hits"] = every.get("vllm:external_prefix_cache_hits", 0.0)
    return out


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def settled_stats(server: VllmServer, before: dict[str, float], loads: int, timeout: float = 10.0) -> dict[str, float]:
    """The change in ``kv_stats`` since ``before`` once ``loads`` more loads have ended (loaded, missed or failed),
    a lookup that found nothing or failed counting as one that will never start (find before you claim): stats reach
    /metrics with the engine step after the load."""
    deadline = time.monotonic() + timeout
    while True:
        change = diff(kv_stats(server), before)
        ended = sum(change.get(k, 0) for k in ("loaded", "load_misses", "load_failures", "lookup_misses",
                                                "lookup_errors"))
        if ended >= loads or time.monotonic() > deadline:
            return change
        time.sleep(0.05)


def looked_up(server, before: dict[str, float], n: int, timeout: float = 10.0) -> dict[str, float]:
    """The change in ``kv_stats`` once ``n`` more lookups were answered (their stats come with a later step)."""
    deadline = time.monotonic() + timeout
    while True:
        change = diff(kv_stats(server), before)
        if change.get("lookups", 0) >= n or time.monotonic() > deadline:
            return change
        time.sleep(0.05)


def log_mark(server: VllmServer) -> int:
    """Where the instance's log ends now (for ``warnings_since``)."""
    return server.log.stat().st_size


def warnings_since(server: VllmServer, mark: int) -> str:
    """The warnings and errors the instance logged after ``mark``: what an assertion about its loads shows."""
    with server.log.open("rb") as log:
        log.seek(mark)
        text = log.read().decode(errors="replace")
    said = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line or line.startswith(("W", "E"))]
    return f"{server.name} logged:\n" + "\n".join(said[-15:])


def busy(every: dict[str, float]) -> float:
    """Requests running or waiting, from an instance's ``metrics``."""
    return every.get("vllm:num_requests_running", 0.0) + every.get("vllm:num_requests_waiting", 0.0)


def wait_busy(server: VllmServer, timeout: float, gone: Callable[[], bool] = lambda: False) -> None:
    """Wait until the instance holds a request (running or waiting); fails at ``timeout`` or once ``gone()``
    (e.g. the client's answer came back first)."""
    deadline = time.monotonic() + timeout
    while not busy(metrics(server)):
        assert time.monotonic() < deadline and not gone(), f"{server.name} never took the request"
        time.sleep(0.05)


def wait_idle(server: VllmServer, timeout: float = 30.0) -> None:
    """Wait until the instance has no request running or waiting and its ``kv_stats`` stopped changing: requests
    clients abandoned are aborted, and their loads end, in the engine's later steps."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] | None = None
    while True:
        every = metrics(server)
        held = busy(every)
        now = kv_stats(server, every)
        if not held and now == last:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{server.name} still busy after {timeout:g} s: {held:g} requests")
        last = now
        time.sleep(0.5)
