"""The tiny upstream of the proxy benchmarks (bench_proxy, bench_slow_clients): an aiohttp server in a process of its
own that answers ``POST /v1/completions`` at once with a small JSON body, as both the prefill and the decode instance
(a prefill's answer carries a producer's ``kv_transfer_params``, as MooncakeConnector's does: without them the proxy
counts a failed prefill and sends the request whole to the decode instance); and the wait until a server's
``/health`` answers."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

from benchmarks.support.common import ROOT
from harness.ports import HOST

ANSWER = {"id": "cmpl-1", "object": "text_completion", "model": "fake-model",
          "choices": [{"index": 0, "text": " Paris.", "finish_reason": "stop"}]}
PRODUCER_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_pipe": ["127.0.0.1:9"],
                   "remote_tp_size": 1}


def serve(port: int) -> None:
    """Serve the upstream on ``port`` until killed (in its own process: ``start``)."""

    async def completion(request: web.Request) -> web.Response:
        body = await request.read()
        prefill = b'"do_remote_decode":true' in body.replace(b" ", b"")
        return web.json_response({**ANSWER, "kv_transfer_params": PRODUCER_PARAMS} if prefill else ANSWER)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/health", health)
    web.run_app(app, host=HOST, port=port, access_log=None, print=None, backlog=1024)


def start(port: int) -> subprocess.Popen[bytes]:
    """The upstream on 127.0.0.1:``port`` in a child process (a session of its own: stop it with harness.processes.stop
    or terminate)."""
    return subprocess.Popen([sys.executable, "-m", "benchmarks.support.proxy_upstream", str(port)], cwd=ROOT,
                            start_new_session=True)


async def wait_health(url: str, process: subprocess.Popen[bytes] | None = None, timeout: float = 30.0) -> None:
    """Return once ``url``/health answers 200; RuntimeError if ``process`` exits first or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"{process.args} exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} not ready")


if __name__ == "__main__":
    serve(int(sys.argv[1]))
