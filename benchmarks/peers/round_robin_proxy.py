"""Benchmark-only: a round-robin HTTP proxy in front of several plain (colocated) vLLM instances.

Used by ``benchmarks/bench_serve.py`` for the colocated stack, two vLLM instances on the same two cores as a 1P1D
pair, so that the client reaches both through one address and through one HTTP hop, as it reaches a disaggregated
pair through ``proxy_server.py``. Each ``POST`` goes to the next instance in turn, whole (a prompt and its decode stay
on one instance); the answer is relayed chunk by chunk as it arrives, so a streamed completion streams through.
``GET /health`` answers 200 only when every instance does; other ``GET`` requests (``/v1/models``, ``/metrics``) go
to the first instance.

Run::

    python benchmarks/peers/round_robin_proxy.py --upstream http://127.0.0.1:8100 --upstream http://127.0.0.1:8200 \\
        --port 8000

Never used by the product.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging

import aiohttp
from aiohttp import web

logger = logging.getLogger("round_robin_proxy")

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host"}


class RoundRobin:
    def __init__(self, upstreams: list[str], timeout: float) -> None:
        self.upstreams = [u.rstrip("/") for u in upstreams]
        self.turn = itertools.cycle(range(len(self.upstreams)))
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None

    async def start(self, _: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0)
        self.session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, trust_env=False,
                                             auto_decompress=False)

    async def stop(self, _: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, _: web.Request) -> web.Response:
        assert self.session is not None

        async def ok(url: str) -> bool:
            try:
                async with self.session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2.0)) as resp:  # type: ignore[union-attr]
                    return resp.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False

        healthy = await asyncio.gather(*(ok(u) for u in self.upstreams))
        return web.Response(status=200 if all(healthy) else 503)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        upstream = self.upstreams[next(self.turn) if request.method == "POST" else 0]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.read()
        response: web.StreamResponse | None = None
        try:
            async with self.session.request(request.method, f"{upstream}{request.rel_url}", data=body or None,
                                            headers=headers) as upstream_resp:
                response = web.StreamResponse(status=upstream_resp.status, headers={
                    k: v for k, v in upstream_resp.headers.items() if k.lower() not in HOP_HEADERS})
                await response.prepare(request)
                async for chunk in upstream_resp.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (TimeoutError, aiohttp.ClientError) as error:
            logger.warning("%s %s via %s failed: %r", request.method, request.rel_url, upstream, error)
            if response is not None:  # the status went out already: end the answer short, the client sees it cut
                raise
            return web.json_response({"error": {"message": f"upstream {upstream}: {error!r}"}}, status=502)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", action="append", required=True, metavar="URL", help="an instance (repeat)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds between two chunks of an answer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = RoundRobin(args.upstream, args.timeout)
    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_get("/health", proxy.health)
    app.router.add_route("*", "/{tail:.*}", proxy.forward)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
