"""The in-process pipe (``kv_pipe.local_pipe``) keeps the ``KVPipeBase`` contract the layers above rely on: FIFO per
direction, None passes, copies on send, bit-exact results, PipeTimeout on a wait that runs out, PipeClosed on the end
that was closed, PeerDisconnected on the other. No engine, no subprocess: it runs in well under a second."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_pipe import KVPipeBase, PeerDisconnected, PipeClosed, PipeStalled, PipeTimeout
from kv_pipe.local_pipe import local_pipe_pair
from kv_pipe.scatter import Scatter

pytestmark = pytest.mark.pipes


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit: dtype, shape and bytes (NaN payloads included)."""
    if a is None or b is None:
        return a is b
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run ``fn(*args)`` in a thread; the list gets its result or the exception it raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_fifo_none_and_bit_exact_in_both_directions():
    a, b = local_pipe_pair(timeout=1.0)
    assert isinstance(a, KVPipeBase) and a.config.timeout == 1.0
    items = [torch.arange(5), None, torch.tensor(3.5, dtype=torch.bfloat16), torch.tensor([True, False]),
             torch.full((2, 3), float("nan"), dtype=torch.float16), torch.empty(0, 4), torch.tensor([1 + 2j])]
    for t in items:
        a.send_tensor(t)
    b.send_tensor(torch.tensor([42]))  # the other direction is a FIFO of its own
    got = [b.recv_tensor(timeout=1.0) for _ in items]
    assert all(same(x, y) for x, y in zip(got, items, strict=True))
    assert same(a.recv_tensor(timeout=1.0), torch.tensor([42]))


def test_the_sender_may_reuse_its_tensor_at_once():
    a, b = local_pipe_pair()
    t = torch.arange(12.0).view(3, 4)
    a.send_tensor(t)
    a.send_tensor(t.t())  # not contiguous: arrives as the same values, contiguous
    t.fill_(-1)
    first, second = b.recv_tensor(timeout=1), b.recv_tensor(timeout=1)
    assert same(first, torch.arange(12.0).view(3, 4))
    assert same(second, torch.arange(12.0).view(3, 4).t().contiguous()) and second.is_contiguous()
    assert first.data_ptr() != t.data_ptr()


def test_a_wait_that_runs_out_is_a_plain_timeout_and_consumes_nothing():
    a, b = local_pipe_pair(timeout=0.05)
    start = time.monotonic()
    with pytest.raises(PipeTimeout) as err:
        b.recv_tensor()  # the configured timeout
    assert not isinstance(err.value, PipeStalled) and time.monotonic() - start < 1.0
    a.send_tensor(torch.tensor([1]))
    assert same(b.recv_tensor(timeout=1), torch.tensor([1]))


def test_send_waits_for_room_and_times_out():
    a, b = local_pipe_pair(capacity=2)
    a.send_tensor(torch.tensor([1]))
    a.send_tensor(None)
    with pytest.raises(PipeTimeout, match="made no room"):
        a.send_tensor(torch.tensor([3]), timeout=0.05)
    thread, out = in_thread(a.send_tensor, torch.tensor([3]), 5.0)
    assert same(b.recv_tensor(timeout=1), torch.tensor([1]))  # makes room: the waiting send goes on
    thread.join(5)
    assert out == [None]
    assert b.recv_tensor(timeout=1) is None and same(b.recv_tensor(timeout=1), torch.tensor([3]))


def test_close_fails_this_ends_pending_and_later_calls_with_pipe_closed():
    a, b = local_pipe_pair(timeout=30.0)
    thread, out = in_thread(b.recv_tensor)
    time.sleep(0.05)  # blocked in recv_tensor (if not yet, it finds the pipe closed: the same error)
    b.close()
    thread.join(5)
    assert isinstance(out[0], PipeClosed) and b.closed
    with pytest.raises(PipeClosed):
        b.send_tensor(torch.tensor([1]))
    with pytest.raises(PipeClosed):
        b.recv_tensor(timeout=0)
    b.close()  # idempotent


def test_the_other_end_gets_what_was_sent_then_peer_disconnected():
    a, b = local_pipe_pair(timeout=30.0)
    a.send_tensor(torch.tensor([7]))
    a.close()
    assert same(b.recv_tensor(timeout=1), torch.tensor([7]))  # it had arrived before the close
    with pytest.raises(PeerDisconnected):
        b.recv_tensor(timeout=1)
    with pytest.raises(PeerDisconnected):
        b.send_tensor(torch.tensor([1]))
    c, d = local_pipe_pair(timeout=30.0)
    thread, out = in_thread(d.recv_tensor)
    time.sleep(0.05)
    c.close()  # a receive blocked on the other end ends at once
    thread.join(5)
    assert isinstance(out[0], PeerDisconnected)


def test_only_a_tensor_or_none_is_sent():
    a, b = local_pipe_pair()
    with pytest.raises(TypeError, match="torch.Tensor or None"):
        a.send_tensor([1, 2])  # type: ignore[arg-type]
    with pytest.raises(PipeTimeout):
        b.recv_tensor(timeout=0)  # nothing was queued


def test_receive_into_out_or_a_scatter():
    a, b = local_pipe_pair()
    key = torch.arange(6, dtype=torch.float32).view(2, 3)
    room = torch.empty(64, dtype=torch.uint8)
    a.send_tensor(key)
    got = b.recv_tensor(timeout=1, out=room)
    assert same(got, key) and got.data_ptr() == room.data_ptr()  # a view of out
    small = torch.empty(4, dtype=torch.uint8)
    a.send_tensor(key)
    got = b.recv_tensor(timeout=1, out=small)
    assert same(got, key) and got.data_ptr() != small.data_ptr()  # too small: a tensor of its own
    with pytest.raises(ValueError, match="contiguous"):
        b.recv_tensor(timeout=0, out=torch.empty(4, 4).t())
    regions = [torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)]
    a.send_tensor(key)  # 24 bytes: fills both regions exactly
    got = b.recv_tensor(timeout=1, out=Scatter.of([(r.data_ptr(), r.numel()) for r in regions], regions))
    assert got.device.type == "meta" and got.shape == key.shape
    assert torch.equal(torch.cat(regions), key.reshape(-1).view(torch.uint8))
