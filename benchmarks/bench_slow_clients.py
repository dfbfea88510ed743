"""Time to a normal answer from the proxy while slow clients hold connections under a low open-file limit.

Set-up, all on 127.0.0.1: bench_proxy.py's tiny upstream (benchmarks/support/proxy_upstream.py: answers at once;
both the prefill and the decode instance), the proxy (``proxy_server.py`` with its default options, log level INFO,
its open-file limit set to ``--nofile``, 256 by default) and this process. First ``--requests`` normal requests are
timed with nothing else going on (``quiet``); then ``--slow`` slow clients connect - a third silent, a third sending
a request head that never ends, a third a complete head whose body comes a byte every half second - and each one the
proxy closes is opened again, as an attacker would; after ``--settle`` seconds the same normal requests are timed
again (``attacked``), one every 0.25 s, each with a 10 s timeout (a request that takes longer counts as not
answered). Also reported: the files the proxy holds, the slow connections it closed (and that were opened again) and
its log lines saying "Too many open files".

``--proxy-root`` runs the proxy of another checkout (e.g. ``git worktree add ../before <commit>``) to compare.

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_slow_clients.py    # about 30 s
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.support import proxy_upstream  # noqa: E402
from benchmarks.support.common import fmt, header, percentile, write  # noqa: E402
from harness.ports import HOST, free_port  # noqa: E402
from harness.processes import stop  # noqa: E402
from harness.slow_clients import SlowClients  # noqa: E402

REQUEST = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 16}
@dataclass
class Row:
    scenario: str
    requests: int
    answered: int
    p50_ms: float | None
    max_ms: float | None
    proxy_files: int
    slow_reopened: int


async def timed(session: aiohttp.ClientSession, url: str, count: int) -> list[float | None]:
    """Each request's seconds to its whole answer, None if it failed or took over 10 s."""
    out: list[float | None] = []
    for _ in range(count):
        start = time.monotonic()
        try:
            async with session.post(url + "/v1/completions", json=REQUEST,
                                    timeout=aiohttp.ClientTimeout(total=10)) as response:
                await response.read()
                out.append(time.monotonic() - start if response.status == 200 else None)
        except (TimeoutError, aiohttp.ClientError):
            out.append(None)
        await asyncio.sleep(0.25)
    return out


def row(scenario: str, took: list[float | None], files: int, reopened: int) -> Row:
    done = [t * 1e3 for t in took if t is not None]
    return Row(scenario, len(took), len(done), percentile(done, 50) if done else None, max(done) if done else None,
               files, reopened)


async def run(args: argparse.Namespace, log: Path) -> tuple[list[Row], int]:
    upstream_port, proxy_port = free_port(), free_port()
    upstream_url, proxy_url = f"http://{HOST}:{upstream_port}", f"http://{HOST}:{proxy_port}"
    upstream = proxy_upstream.start(upstream_port)
    nofile = args.nofile
    with log.open("wb") as out:
        proxy = subprocess.Popen([sys.executable, str(args.proxy_root / "proxy_server.py"), "--prefill", upstream_url,
                                  "--decode", upstream_url, "--host", HOST, "--port", str(proxy_port)],
                                 cwd=args.proxy_root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)))
    attack = None
    try:
        await proxy_upstream.wait_health(upstream_url, upstream)
        await proxy_upstream.wait_health(proxy_url, proxy)
        async with aiohttp.ClientSession() as session:
            rows = [row("quiet", await timed(session, proxy_url, args.requests),
                        len(os.listdir(f"/proc/{proxy.pid}/fd")), 0)]
            attack = await asyncio.to_thread(SlowClients, proxy_port, args.slow)
            await asyncio.sleep(args.settle)
            took = await timed(session, proxy_url, args.requests)
            rows.append(row(f"attacked ({args.slow} slow clients)", took, len(os.listdir(f"/proc/{proxy.pid}/fd")),
                            attack.reopened))
        return rows, attack.failed
    finally:
        if attack is not None:
            await asyncio.to_thread(attack.stop)
        for process in (proxy, upstream):
            stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=300, help="slow clients (default 300)")
    parser.add_argument("--nofile", type=int, default=256, help="the proxy's open-file limit (default 256)")
    parser.add_argument("--requests", type=int, default=20, help="normal requests timed per scenario (default 20)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between the attack's start and the "
                        "timed requests (default 3)")
    parser.add_argument("--proxy-root", type=Path, default=ROOT, help="the checkout whose proxy_server.py runs")
    parser.add_argument("--name", default="bench_slow_clients")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.slow + 256)), hard))
    with tempfile.TemporaryDirectory(prefix="bench_slow_clients-") as work:
        log = Path(work) / "proxy.log"
        rows, failed = asyncio.run(run(args, log))
        said = log.read_bytes()
    emfile = said.count(b"Too many open files")
    lines = ["| scenario | requests | answered (within 10 s) | p50 ms | max ms | files the proxy holds "
             "| slow connections closed and opened again |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.scenario} | {r.requests} | {r.answered} | {fmt(r.p50_ms)} | {fmt(r.max_ms)} "
                     f"| {r.proxy_files} | {r.slow_reopened} |")
    table = "\n".join(lines)
    proxy_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=args.proxy_root, capture_output=True,
                                  text=True).stdout.strip() or "unknown"
    notes = (f"The proxy measured: commit {proxy_commit}{'' if args.proxy_root.resolve() == ROOT else ' (another checkout)'}"
             f". The proxy's open-file limit {args.nofile}, its default options; its log said \"Too many open files\" "
             f"{emfile} times; {failed} slow connections could not be opened (the listen queue full).")
    md = header("bench_slow_clients: a normal answer while slow clients hold connections") + "\n" + table + "\n\n" + \
        notes + "\n"
    print(md)
    write(args.name, {"rows": [asdict(r) for r in rows], "emfile_lines": emfile, "slow_connect_failures": failed,
                      "nofile": args.nofile, "slow": args.slow, "proxy_commit": proxy_commit},
          md, args.out_dir)


if __name__ == "__main__":
    main()
