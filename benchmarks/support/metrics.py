"""What the benchmarks read off a running server's Prometheus ``/metrics`` (a vLLM instance's, a proxy's)."""

from __future__ import annotations

import re
import urllib.request

LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(url: str) -> list[str]:
    """The sample lines of ``url``/metrics (Prometheus text format, comments left out)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics summed over labels (``name`` -> value)."""
    out: dict[str, float] = {}
    for line in samples(url):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def scrape_labeled(url: str, metric: str, labels: tuple[str, ...]) -> dict[str, float]:
    """The samples of one ``metric`` of ``url``/metrics, kept apart by ``labels``: their values joined by "/" ->
    value (the route decisions' reasons are what tells a skip rule's choices apart, which ``scrape`` sums away)."""
    out: dict[str, float] = {}
    for line in samples(url):
        if line.split("{", 1)[0].split(" ", 1)[0] != metric:
            continue
        found = dict(LABEL.findall(line.rsplit(" ", 1)[0]))
        key = "/".join(found.get(label, "") for label in labels)
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
