"""Latency the disaggregation proxy adds per request, against calling the decode upstream directly.

Set-up, all on 127.0.0.1, each in its own process: a tiny aiohttp upstream that answers ``POST /v1/completions``
immediately with a small JSON body (it serves as both the prefill and the decode instance), the proxy
(``proxy_server.py --prefill U --decode U``, log level WARNING) and this process, the client (one aiohttp session,
keep-alive). Both paths are non-streaming. Through the proxy a request costs one prefill round trip plus one decode
round trip to the upstream, so the overhead includes the extra (prefill) hop, as in a real deployment.

For each concurrency (1 and 64 by default) the client runs ``concurrency`` workers, each sending requests back to
back; the latency of every request is taken with ``time.perf_counter()``. Direct and proxied rounds alternate
(``--rounds``) after an untimed warm-up, and the latencies of all rounds are pooled. Overhead = proxied percentile
minus direct percentile (p50 and p99); the proxy's CPU time per request (psutil) is reported too.
Target: p50 overhead <= 2 ms at concurrency 1.

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_proxy.py            # about 20 s
    .venv/bin/python benchmarks/bench_proxy.py --quick    # a few seconds (smoke test)

It prints a markdown table and writes ``bench_proxy.json`` to ``--out-dir`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.support import common, proxy_upstream  # noqa: E402
from benchmarks.support.common import percentile  # noqa: E402
from harness.ports import HOST, free_port  # noqa: E402

TARGET_P50_OVERHEAD_MS = 2.0
REQUEST = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 16}
async def one_round(session: aiohttp.ClientSession, url: str, concurrency: int, per_worker: int) -> list[float]:
    """Latencies (seconds) of ``concurrency * per_worker`` requests sent by ``concurrency`` back-to-back workers."""
    body = json.dumps(REQUEST).encode()
    headers = {"Content-Type": "application/json"}

    async def worker() -> list[float]:
        latencies = []
        for _ in range(per_worker):
            start = time.perf_counter()
            async with session.post(url + "/v1/completions", data=body, headers=headers) as response:
                await response.read()
                if response.status != 200:
                    raise RuntimeError(f"{url}: status {response.status}")
            latencies.append(time.perf_counter() - start)
        return latencies

    results = await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [latency for result in results for latency in result]


@dataclass
class Row:
    concurrency: int
    requests: int  # per path, all rounds
    direct_p50_ms: float
    direct_p99_ms: float
    proxy_p50_ms: float
    proxy_p99_ms: float
    overhead_p50_ms: float
    overhead_p99_ms: float
    direct_rps: float
    proxy_rps: float
    proxy_cpu_ms_per_request: float | None  # user + system CPU of the proxy process (psutil), None without psutil


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, None if psutil is missing."""
    try:
        import psutil
    except ImportError:
        return None
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


async def measure(direct: str, proxied: str, concurrency: int, requests: int, rounds: int, proxy_pid: int) -> Row:
    per_worker = max(1, requests // (concurrency * rounds))
    latencies: dict[str, list[float]] = {"direct": [], "proxy": []}
    elapsed = {"direct": 0.0, "proxy": 0.0}
    proxy_cpu: float | None = 0.0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in (direct, proxied):  # warm-up: connections and code paths
            await one_round(session, url, concurrency, max(5, per_worker // 5))
        for _ in range(rounds):
            for name, url in (("direct", direct), ("proxy", proxied)):
                cpu_before, start = cpu_seconds(proxy_pid), time.perf_counter()
                latencies[name] += await one_round(session, url, concurrency, per_worker)
                elapsed[name] += time.perf_counter() - start
                cpu_after = cpu_seconds(proxy_pid)
                if name == "proxy" and proxy_cpu is not None and cpu_before is not None and cpu_after is not None:
                    proxy_cpu += cpu_after - cpu_before
                elif name == "proxy":
                    proxy_cpu = None
    ms = {name: (percentile(values, 50) * 1e3, percentile(values, 99) * 1e3) for name, values in latencies.items()}
    return Row(concurrency, len(latencies["proxy"]), *ms["direct"], *ms["proxy"],
               ms["proxy"][0] - ms["direct"][0], ms["proxy"][1] - ms["direct"][1],
               len(latencies["direct"]) / elapsed["direct"], len(latencies["proxy"]) / elapsed["proxy"],
               None if proxy_cpu is None else proxy_cpu * 1e3 / len(latencies["proxy"]))


def markdown(rows: list[Row]) -> str:
    lines = ["| concurrency | requests | direct p50 (ms) | direct p99 (ms) | proxy p50 (ms) | proxy p99 (ms) "
             "| overhead p50 (ms) | overhead p99 (ms) | direct req/s | proxy req/s | proxy CPU/req (ms) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.concurrency} | {r.requests} | {r.direct_p50_ms:.2f} | {r.direct_p99_ms:.2f} "
                     f"| {r.proxy_p50_ms:.2f} | {r.proxy_p99_ms:.2f} | {r.overhead_p50_ms:.2f} "
                     f"| {r.overhead_p99_ms:.2f} | {r.direct_rps:.0f} | {r.proxy_rps:.0f} "
                     f"| {'n/a' if r.proxy_cpu_ms_per_request is None else f'{r.proxy_cpu_ms_per_request:.2f}'} |")
    return "\n".join(lines)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for package in ("quart", "hypercorn", "aiohttp"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "missing"
    return found


async def run(args: argparse.Namespace) -> list[Row]:
    upstream_port, proxy_port = free_port(), free_port()
    upstream_url, proxy_url = f"http://{HOST}:{upstream_port}", f"http://{HOST}:{proxy_port}"
    upstream = proxy_upstream.start(upstream_port)
    proxy = subprocess.Popen([sys.executable, str(ROOT / "proxy_server.py"), "--prefill", upstream_url,
                              "--decode", upstream_url, "--host", HOST, "--port", str(proxy_port),
                              "--log-level", "WARNING", "--skip-prefill-below", "0"])
    try:
        await proxy_upstream.wait_health(upstream_url, upstream)
        await proxy_upstream.wait_health(proxy_url, proxy)
        rows = []
        for concurrency in args.concurrency:
            requests = args.requests * (8 if concurrency > 1 else 1)
            rows.append(await measure(upstream_url, proxy_url, concurrency, requests, args.rounds, proxy.pid))
        return rows
    finally:
        for process in (proxy, upstream):
            process.terminate()
        for process in (proxy, upstream):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--requests", type=int, default=2000,
                        help="requests per path at concurrency 1 (8x that at higher concurrency)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating direct/proxy rounds")
    parser.add_argument("--quick", action="store_true", help="few requests (smoke test)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rounds = 200, 2
    rows = asyncio.run(run(args))
    table = markdown(rows)
    print(table)
    first = next((r for r in rows if r.concurrency == 1), None)
    met = first is not None and first.overhead_p50_ms <= TARGET_P50_OVERHEAD_MS
    if first is not None:
        print(f"\ntarget p50 overhead <= {TARGET_P50_OVERHEAD_MS} ms at concurrency 1: "
              f"{'met' if met else 'NOT met'} ({first.overhead_p50_ms:.2f} ms)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"commit": common.commit(), "command": common.command(), "cpu": common.cpu(),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
              "cpus": os.cpu_count(), "versions": versions(),
              "config": {"concurrency": args.concurrency, "requests": args.requests, "rounds": args.rounds},
              "target_p50_overhead_ms": TARGET_P50_OVERHEAD_MS, "target_met": met,
              "rows": [asdict(r) for r in rows], "table": table}
    path = args.out_dir / "bench_proxy.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
