"""proxy/gate.py: client connections, bounded in number and in how long a client may take to send, never in how long
it waits for its answer; real HTTP, ``proxy_server.main()`` in a subprocess where the process's limits matter."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time

import pytest

from proxy.config import ProxyConfig
from proxy.gate import ClientGate
from tests.proxy.upstreams import COMPLETION, Environment, run, start_main

pytestmark = pytest.mark.timeout(60)


def test_slow_clients_under_a_low_open_file_limit_do_not_starve_the_others() -> None:
    """Finding 6: with no cap on client connections and slow bodies allowed --timeout (300 s), 300 slow clients
    under a 256-file limit made normal requests time out and logged 110,450 accept errors in 10 s. Now at most
    --max-clients connections are open, a new one takes the place of the oldest with no request under way, and a
    request head must arrive within --client-timeout."""

    async def test(env: Environment) -> None:
        process, url = await start_main(env, "--max-clients", "100", "--client-timeout", "3",
                                        stderr=asyncio.subprocess.PIPE,
                                        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)))
        port = int(url.rsplit(":", 1)[1])
        slow: list[socket.socket] = []
        try:
            for _ in range(300):  # a head that never ends
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
                slow.append(sock)
            await asyncio.sleep(0.5)
            fds = len(os.listdir(f"/proc/{process.pid}/fd"))
            assert fds < 200, f"the proxy holds {fds} files"
            start = time.monotonic()
            for _ in range(5):
                async with env.client.post(url + "/v1/completions", json=COMPLETION) as response:
                    assert response.status == 200
            # answered, not timed out (before the gate they never were); the first waits while the ~200 slow
            # connections queued ahead of it are accepted and closed in turn: 2.5 s here idle, 5.5 s under the
            # suite's load (issue #37 asks for under a second)
            assert time.monotonic() - start < 12.0
            await asyncio.sleep(4.0)  # --client-timeout: every slow head is closed by now
            assert all(_closed(sock) for sock in slow)
        finally:
            for sock in slow:
                sock.close()
            if process.returncode is None:
                process.terminate()
        _, err = await process.communicate()
        assert err.count(b"Too many open files") == 0 and err.count(b"accept") < 10, err[-2000:]

    run(test)


def test_answers_longer_than_the_client_timeout_are_not_cut() -> None:
    """--client-timeout bounds what a client sends (a request's head and body) and idle connections, never how long
    the client waits for an answer or a stream while sending nothing."""
    async def test(env: Environment) -> None:
        env.decode[0].delay = 2.5
        assert (await env.post("/v1/completions", COMPLETION))[0] == 200
        env.decode[0].delay, env.decode[0].chunk_delay = 0.0, 1.0
        status, _, body = await env.post("/v1/completions", {**COMPLETION, "stream": True})
        assert status == 200 and "[DONE]" in body

    run(test, client_timeout=1.0)


def _closed(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_client_connections_send_without_delay() -> None:
    """A small answer goes out at once: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and the gate's
    accepted sockets did not say so, so Nagle's algorithm held each answer until the client's delayed ACK."""
    gate = ClientGate(ProxyConfig(prefill=("http://127.0.0.1:1",), decode=("http://127.0.0.1:2",), port=0))
    try:
        with socket.create_connection(("127.0.0.1", gate.port)):
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    accepted, _ = gate.listener.accept()
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the connection was not accepted"
                    time.sleep(0.01)
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        gate.listener.close()
