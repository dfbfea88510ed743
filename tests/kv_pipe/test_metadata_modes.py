"""MooncakePipe over every metadata-server mode: P2PHANDSHAKE, etcd (URL and bare host:port) and the wheel's HTTP server.

Real processes, real Transfer Engines, real servers, all on 127.0.0.1. The test process is the consumer end
(kv_rank 1) and sends first; a spawned child runs ``peers.echo`` as the producer end (kv_rank 0) and sends each
item back. A metadata server where nothing listens must give a ConfigError within a bounded time, not a hang or
an abort: that is tried in a child process so that an engine crash cannot take pytest down.
"""

from __future__ import annotations

import gc
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.pipes import make_config
from harness.ports import free_port
from kv_pipe import MooncakePipe, MooncakeTransferEngineConfig
from kv_pipe.errors import ConfigError, PipeError
from tests import servers
from tests.kv_pipe.peers import Peer, echo

pytestmark = pytest.mark.pipes

UNREACHABLE_BUDGET = 20.0  # etcd: 5 s to fail the registration + 5 s to fail the removal when the engine is freed


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd on 127.0.0.1 (free client and peer ports, tmp data dir); yields "127.0.0.1:PORT"."""
    try:
        with servers.etcd_server(tmp_path_factory.mktemp("etcd")) as endpoint:
            yield endpoint
    except servers.ServerUnavailable as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def http_metadata(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The wheel's mooncake_http_metadata_server on 127.0.0.1; yields "http://127.0.0.1:PORT/metadata"."""
    try:
        with servers.http_metadata_server(tmp_path_factory.mktemp("http-metadata")) as url:
            yield url
    except servers.ServerUnavailable as e:
        pytest.fail(str(e), pytrace=False)


def _metadata_server(mode: str, request: pytest.FixtureRequest) -> str:
    if mode == "p2p":
        return "P2PHANDSHAKE"
    if mode == "etcd-url":
        return "etcd://" + request.getfixturevalue("etcd")
    if mode == "etcd-bare":
        return request.getfixturevalue("etcd")
    if mode == "http":
        return request.getfixturevalue("http_metadata")
    raise AssertionError(mode)


def _published(mode: str, server: str, session: str) -> bytes | None:
    """The segment descriptor the engine ``session`` published in the metadata server (None in P2P mode)."""
    key = f"mooncake/ram/{session}"
    if mode.startswith("etcd"):
        return servers.etcd_get(server.removeprefix("etcd://"), key)
    if mode == "http":
        return servers.http_metadata_get(server, key)
    return None


def _items() -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1234)
    return [
        torch.randn(5, 6, generator=gen),
        torch.randn(1000, 1000, generator=gen).to(torch.bfloat16),
        torch.tensor(-(2**62) + 12345, dtype=torch.int64),
        None,
    ]


def _round_trip(pipe: MooncakePipe, items: list[torch.Tensor | None]) -> None:
    """Send each item to the echoing child and check that it comes back bit-exact."""
    for sent in items:
        pipe.send_tensor(sent)
        got = pipe.recv_tensor()
        if sent is None:
            assert got is None
            continue
        assert got is not None
        assert got.dtype == sent.dtype and got.shape == sent.shape
        # bit-exact: compare the raw bytes, not values (NaN-safe, no float tolerance)
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["p2p", "etcd-url", "etcd-bare", "http"])
def test_round_trip(mode: str, request: pytest.FixtureRequest) -> None:
    server = _metadata_server(mode, request)
    cfg = make_config(metadata_server=server)
    items = _items()
    start = time.monotonic()
    child = Peer(echo, cfg, 0, len(items))
    try:
        pipe = MooncakePipe(local_rank=0, kv_rank=1, config=MooncakeTransferEngineConfig(**cfg))
        try:
            session = pipe._engine.session
            if mode == "p2p":
                assert session != cfg["decode_url"]  # host:rpc_port chosen by the engine
            else:
                # Named by local_hostname (plus a tag of this engine's own: a restarted process is a new segment),
                # and really registered in the server (no silent fallback to P2P).
                assert session.startswith(cfg["decode_url"] + "#")
                assert _published(mode, server, session), f"no segment of {session} in {server}"
            _round_trip(pipe, items)
            pipe.send_tensor(None)  # "done": the child closes its pipe and returns
            assert child.result(timeout=30) == sum(item is not None for item in items)
        finally:
            pipe.close()
        child.proc.join(timeout=10)
        assert child.proc.exitcode == 0
    finally:
        child.kill()
    # Free our engine while its metadata server still runs (the pipe sits in a reference cycle, see
    # test_close_deregisters_from_metadata_server): freed, it must leave no entry behind.
    del pipe
    gc.collect()
    assert _published(mode, server, session) is None, f"{session} is still registered in {server} after the engine was freed"
    print(f"round trip over {mode}: {time.monotonic() - start:.1f} s")  # a hang is the timeout mark's (60 s)


@pytest.mark.timeout(60)
def test_close_deregisters_from_metadata_server(http_metadata: str) -> None:
    cfg = make_config(metadata_server=http_metadata)
    child = Peer(echo, cfg, 0, 1)
    pipe = MooncakePipe(local_rank=0, kv_rank=1, config=MooncakeTransferEngineConfig(**cfg))
    session = pipe._engine.session
    try:
        _round_trip(pipe, [torch.arange(10)])
        pipe.send_tensor(None)
        assert child.result(timeout=30) == 1
        assert _published("http", http_metadata, session)
        pipe.close()
        assert _published("http", http_metadata, session) is None, f"{session} is still registered after close()"
    finally:
        pipe.close()
        child.kill()
        del pipe
        gc.collect()  # deregister now, while the server still runs


def open_with_unreachable_metadata(cfg: dict) -> dict:
    """Child side: try to open a pipe end; report what happened, how long it took, and whether its port was freed."""
    host, port = cfg["prefill_url"].rsplit(":", 1)
    start = time.monotonic()
    outcome: dict = {}
    try:
        pipe = MooncakePipe(local_rank=0, kv_rank=0, config=MooncakeTransferEngineConfig(**cfg))
    except (ConfigError, PipeError) as e:
        outcome.update(error=type(e).__name__, message=str(e), raised_after=time.monotonic() - start)
    else:
        pipe.close()
        outcome.update(error=None, message=f"opened, engine session {pipe._engine.session}")
    outcome["total"] = time.monotonic() - start  # includes freeing the failed engine (it retries its deregistration)
    try:
        socket.create_server((host, int(port))).close()
        outcome["port_freed"] = True
    except OSError:
        outcome["port_freed"] = False
    return outcome


@pytest.mark.timeout(90)
@pytest.mark.parametrize("scheme", ["etcd", "http"])
def test_unreachable_metadata_server(scheme: str) -> None:
    dead = free_port()  # nothing listens there
    server = f"etcd://127.0.0.1:{dead}" if scheme == "etcd" else f"http://127.0.0.1:{dead}/metadata"
    cfg = make_config(metadata_server=server)
    child = Peer(open_with_unreachable_metadata, cfg)
    try:
        try:
            outcome = child.result(timeout=UNREACHABLE_BUDGET + 30)
        except Exception:
            child.proc.join(timeout=1)
            pytest.fail(f"the child reported nothing (exit code {child.proc.exitcode}): the engine hung or aborted "
                        f"with metadata server {server}")
        child.proc.join(timeout=10)
        assert child.proc.exitcode == 0, f"the child crashed after the failure (exit code {child.proc.exitcode})"
    finally:
        child.kill()
    assert outcome["error"] == "ConfigError", outcome
    assert "failed to initialize" in outcome["message"] and server in outcome["message"], outcome["message"]
    assert "metadata server is running and reachable" in outcome["message"], outcome["message"]
    assert outcome["total"] < UNREACHABLE_BUDGET, outcome
    assert outcome["port_freed"], "the pipe kept its side-channel port after a failed start"


def test_servers_are_stopped(tmp_path: Path) -> None:
    """The helpers leave nothing running: after the with-block the ports refuse connections."""
    with servers.etcd_server(tmp_path) as endpoint, servers.http_metadata_server(tmp_path) as url:
        ports = [int(endpoint.rsplit(":", 1)[1]), int(url.split(":")[2].split("/")[0])]
    for port in ports:
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
