"""One notion of "this device" (``kv_pipe.devices``), and the pipe on a GPU: device tensors staged through pinned host
memory without synchronizing the device (the ``cuda`` cases run where a GPU is; elsewhere they are skipped)."""

from __future__ import annotations

import pytest
import torch

from harness.pipes import make_config, open_pipe
from kv_pipe.devices import canonical, same_device, to_device, to_host
from tests.devices import CUDA
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, same

pytestmark = pytest.mark.pipes

MiB = 1 << 20


def test_host_spellings_are_one_device():
    assert canonical("cpu") == canonical(torch.device("cpu", 0)) == canonical(torch.device("cpu")) == torch.device("cpu")
    assert same_device("cpu", torch.device("cpu", 0))
    assert not same_device("cpu", "meta")


def test_cuda_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this process has a GPU")
    with pytest.raises(ValueError, match="CUDA is not available"):
        canonical("cuda")


def test_host_tensors_pass_through_to_host():
    t = torch.arange(10)
    assert to_host(t) is t


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")
def test_cuda_spellings_are_one_device():
    here = torch.cuda.current_device()
    names = ["cuda", f"cuda:{here}", torch.device("cuda", here), torch.device("cuda"), torch.zeros(1, device="cuda").device]
    assert {canonical(n) for n in names} == {torch.device("cuda", here)}
    assert same_device("cuda", f"cuda:{here}") and not same_device("cuda", "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")
def test_staging_copies_never_synchronize_the_device():
    src = torch.randn(4 * MiB, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        host = to_host(src * 2)  # waits for its own copy's event only
        back = to_device(host, canonical("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert host.is_pinned() and torch.equal(back, src * 2)


@pytest.mark.parametrize("size", [1 * MiB, 64 * MiB, pytest.param(256 * MiB, marks=CUDA)])
def test_large_tensors_round_trip_exactly_on_the_device(device, size):
    """Sent from ``device``, echoed by a host peer, received on ``device`` again: bit for bit."""
    if device == "cpu" and size > MiB:
        pytest.skip("the host path's large tensors are covered by test_mooncake_pipe")
    cfg = make_config()
    item = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    peer = Peer(peers.echo, cfg, 0, 1)
    with open_pipe(cfg, 1, device=device) as pipe:
        pipe.send_tensor(item.to(device))
        back = pipe.recv_tensor()
        pipe.send_tensor(None)
    assert peer.result() == 1
    assert back.device == canonical(device) and same(item, back)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device in this process")
def test_a_device_pipe_never_synchronizes_the_device():
    """``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronizing CUDA call (a blocking copy, a stream or
    device synchronize): sending and receiving device tensors makes none (waiting on an event is not one)."""
    cfg = make_config()
    items = [torch.randn(3, 5, device="cuda"), torch.arange(16 * MiB, dtype=torch.int32, device="cuda")]
    peer = Peer(peers.echo, cfg, 0, len(items) + 1)
    with open_pipe(cfg, 1, device="cuda") as pipe:
        pipe.send_tensor(None)  # links both ways first (outside the checked part: the handshake is not a transfer)
        assert pipe.recv_tensor() is None
        torch.cuda.set_sync_debug_mode("error")
        try:
            for item in items:
                pipe.send_tensor(item)
            back = [pipe.recv_tensor() for _ in items]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        pipe.send_tensor(None)
    peer.result()
    assert all(same(a, b) for a, b in zip(items, back, strict=True))
