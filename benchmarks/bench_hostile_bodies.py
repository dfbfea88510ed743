"""Another client's latency and the proxy's peak memory while one client (or one upstream answer) is hostile (#46).

Set-up, all on 127.0.0.1: an upstream in this process (aiohttp; both the prefill and the decode instance) that
answers at once - a prefill with a producer's ``kv_transfer_params``, a decode with a short text - except where a
request's prompt asks it to misbehave; the proxy (``proxy_server.py`` of ``--proxy-root``, default options, but
``--max-body-bytes 64 MiB`` for the "before" tree's default); this process as the clients. For each attack, a
normal client sends a tiny completion every 50 ms from the moment the attack starts until it ended; reported are
those requests' p50 and max time to the whole answer, the attack's own outcome (HTTP status, or how it ended), and
the proxy's peak RSS (VmHWM: the main process; with "+ workers": also the largest of its child processes).

Attacks:
- ``lists N``: a completion whose prompt is N MiB of one-token lists (``[[1],[1],...]``);
- ``ids N``: a completion whose prompt is N MiB of token ids (``[1,1,...]``);
- ``junk N``: a completion with an unknown field of N MiB of empty objects (``{"junk":[{},{},...]}``);
- ``prefill answer 1 GiB`` / ``decode answer 1 GiB``: the upstream answers the prefill (or the non-streamed decode)
  with 1 GiB of JSON.

Rows: each attack run against each ``--proxy-root`` given (``--before``: another checkout, e.g. made by ``git
worktree add``), one after the other, in one run.

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_hostile_bodies.py --before ../before    # a few minutes
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from benchmarks.support import proxy_upstream  # noqa: E402
from benchmarks.support.common import fmt, header, percentile, write  # noqa: E402
from harness.ports import HOST, free_port  # noqa: E402
from harness.processes import stop  # noqa: E402

TINY = {"model": "fake-model", "prompt": "The capital of France is", "max_tokens": 16}
MiB = 1 << 20
HUGE = 1 << 30


def attack_body(kind: str, mib: int) -> bytes:
    size = mib * MiB - 4096  # just under N MiB: a body of the default cap's size is not refused for its size
    if kind == "lists":
        return b'{"model":"fake-model","max_tokens":2,"prompt":[' + b",".join([b"[1]"] * (size // 4)) + b"]}"
    if kind == "ids":
        return b'{"model":"fake-model","max_tokens":2,"prompt":[' + b",".join([b"1"] * (size // 2)) + b"]}"
    if kind == "junk":
        return b'{"model":"fake-model","prompt":"x","junk":[' + b",".join([b"{}"] * (size // 3)) + b"]}"
    raise ValueError(kind)


async def upstream(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    asks = body[:200]
    prefill = b'"do_remote_decode":true' in body.replace(b" ", b"")
    if (prefill and b"HUGE-PREFILL" in asks) or (not prefill and b"HUGE-DECODE" in asks):
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"choices":[{"text":"')
        chunk = b"x" * MiB
        for _ in range(HUGE // MiB):
            await response.write(chunk)
        await response.write(b'"}]}')
        await response.write_eof()
        return response
    answer: dict[str, Any] = {"choices": [{"index": 0, "text": "Paris"}]}
    if prefill:
        answer["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                        "remote_pipe": ["127.0.0.1:9"], "remote_tp_size": 1}
    return web.json_response(answer)


def peak_rss(pid: int) -> tuple[int, int]:
    """VmHWM (KiB) of ``pid`` and the largest of its children's."""
    def hwm(p: int) -> int:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
        return 0
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return hwm(pid), max((hwm(int(c)) for c in children), default=0)


async def one_attack(url: str, name: str, pid: int) -> dict[str, Any]:
    """Run attack ``name`` against the proxy at ``url`` while a tiny client measures."""
    timeout = aiohttp.ClientTimeout(total=600)
    done = asyncio.Event()
    took: list[float] = []
    failed = 0

    async def tiny(session: aiohttp.ClientSession) -> None:
        nonlocal failed
        while not done.is_set():
            start = time.monotonic()
            try:
                async with session.post(url + "/v1/completions", json=TINY) as response:
                    await response.read()
                    took.append(time.monotonic() - start) if response.status == 200 else None
                    failed += response.status != 200
            except aiohttp.ClientError:
                failed += 1
            await asyncio.sleep(0.05)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        watcher = asyncio.create_task(tiny(session))
        start = time.monotonic()
        try:
            if name.startswith(("prefill answer", "decode answer")):
                marker = "HUGE-PREFILL" if name.startswith("prefill") else "HUGE-DECODE"
                body = json.dumps({**TINY, "prompt": marker}).encode()
            else:
                kind, mib = name.split()
                body = attack_body(kind, int(mib))
            try:
                async with session.post(url + "/v1/completions", data=body,
                                        headers={"Content-Type": "application/json"}) as response:
                    received = 0
                    while chunk := await response.content.readany():
                        received += len(chunk)
                    outcome = f"{response.status}, {received / MiB:.1f} MiB"
            except aiohttp.ClientError as error:
                outcome = type(error).__name__
        finally:
            seconds = time.monotonic() - start
            await asyncio.sleep(0.3)
            done.set()
            await watcher
    main, workers = peak_rss(pid)
    ms = [t * 1e3 for t in took]
    return {"attack": name, "outcome": outcome, "seconds": seconds, "tiny": len(ms), "tiny_failed": failed,
            "p50_ms": percentile(ms, 50) if ms else None, "max_ms": max(ms) if ms else None,
            "peak_rss_mib": main / 1024, "worker_peak_rss_mib": workers / 1024}


def serve_upstream(port: int) -> None:
    """The upstream, in a process of its own (its 1 GiB answers must not slow the measuring client)."""
    app = web.Application(client_max_size=1 << 31)
    app.router.add_post("/v1/completions", upstream)
    app.router.add_get("/health", lambda request: web.Response(text="ok"))
    web.run_app(app, host=HOST, port=port, access_log=None, print=None)


async def against(root: Path, attacks: list[str], log: Path) -> list[dict[str, Any]]:
    rows = []
    up_port = free_port()
    up = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-upstream", str(up_port)],
                          start_new_session=True)
    try:
        await proxy_upstream.wait_health(f"http://{HOST}:{up_port}")
        for name in attacks:  # a fresh proxy per attack: its peak memory is this attack's
            port = free_port()
            with log.open("ab") as out:
                proxy = subprocess.Popen([sys.executable, str(root / "proxy_server.py"), "--prefill",
                                          f"http://{HOST}:{up_port}", "--decode", f"http://{HOST}:{up_port}",
                                          "--host", HOST, "--port", str(port), "--timeout", "600",
                                          "--client-timeout", "600"],
                                         cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                await proxy_upstream.wait_health(f"http://{HOST}:{port}")
                print(f"  {root.name}: {name} ...", flush=True)
                rows.append(await one_attack(f"http://{HOST}:{port}", name, proxy.pid))
            finally:
                stop(proxy)
    finally:
        stop(up)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=None, help="another checkout to run first (the tree before)")
    parser.add_argument("--attacks", nargs="+", default=["lists 4", "lists 16", "ids 4", "junk 4", "junk 60",
                                                          "prefill answer 1 GiB", "decode answer 1 GiB"])
    parser.add_argument("--name", default="bench_hostile_bodies")
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream)
        return
    roots = ([args.before] if args.before else []) + [ROOT]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_hostile_bodies-") as work:
        for root in roots:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                    text=True).stdout.strip() or "unknown"
            label = f"{'before' if root != ROOT else 'after'} ({commit})"
            results[label] = asyncio.run(against(root, args.attacks, Path(work) / "proxy.log"))
    lines = ["| proxy | attack | its outcome | attack seconds | other client: requests (failed) | p50 ms | max ms "
             "| proxy peak RSS MiB (+ largest worker) |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for label, rows in results.items():
        for r in rows:
            workers = f" (+ {r['worker_peak_rss_mib']:.0f})" if r["worker_peak_rss_mib"] else ""
            lines.append(f"| {label} | {r['attack']} | {r['outcome']} | {r['seconds']:.1f} | {r['tiny']} "
                         f"({r['tiny_failed']}) | {fmt(r['p50_ms'])} | {fmt(r['max_ms'])} | "
                         f"{r['peak_rss_mib']:.0f}{workers} |")
    md = (header("bench_hostile_bodies: another client's latency and the proxy's memory under hostile bodies and "
                 "answers") + "\n" + "\n".join(lines) + "\n\nA fresh proxy per attack (default options but "
          "--timeout 600 and --client-timeout 600, for both trees: no deadline cuts a large body or answer short). "
          "The other client sends a tiny completion every 50 ms while the attack runs. Peak RSS: VmHWM.\n")
    print(md)
    write(args.name, {"results": results}, md, args.out_dir)


if __name__ == "__main__":
    main()
