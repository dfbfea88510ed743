"""The push channel (PushSender, PushReceiver) between two real processes over the real MooncakePipe: the producer
pushes from a child process, the test is the consumer."""

from __future__ import annotations

import time

import pytest
import torch

from harness.pipes import make_config, open_pipe
from kv_lookup_buffer.push_buffer import PushBuffer, PushReceiver, entry_key
from kv_lookup_buffer.push_receiver import STAGED
from kv_lookup_buffer.push_wire import Begin, Commit
from tests.kv_lookup_buffer import programs
from tests.kv_pipe.peers import Peer, ctx

pytestmark = pytest.mark.pipes

ENTRY_BYTES = programs.PUSH_LAYERS * programs.PUSH_BLOCKS * 4 * 8 * 4


@pytest.fixture
def cfg():
    return make_config()


def consumer_for(pipe, **kwargs) -> PushReceiver:
    """The consumer's end, once the producer child has said HELLO (until then ``take`` does not wait)."""
    buf = PushReceiver(pipe, **kwargs)
    deadline = time.monotonic() + 60
    while not buf.has_producer() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert buf.has_producer(), "the producer never said HELLO"
    return buf


def take_once_begun(buf: PushReceiver, key: bytes, timeout: float = 30.0):
    """``take`` waits only for a push that has begun: wait for its BEGIN first (a real load comes after the prefill,
    long after the BEGIN)."""
    deadline = time.monotonic() + timeout
    while buf.look(key) != STAGED and time.monotonic() < deadline:
        time.sleep(0.01)
    return buf.take(key, timeout=max(deadline - time.monotonic(), 0.0))


def assemble(entry) -> torch.Tensor:
    """The pieces of a taken entry, put back into [layers, blocks, *block]."""
    kv = torch.full((entry.num_layers, entry.num_blocks, *programs.PUSH_BLOCK), float("nan"))
    for layer, first, blocks in entry.pieces:
        kv[layer, first:first + blocks.shape[0]] = blocks
    return kv


def test_pushed_entries_arrive_exactly_and_are_taken_once(cfg):
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1, 2, 3], done)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20)
        try:
            for seed in (2, 1, 3):  # any order
                tokens, kv = programs.push_entry(seed)
                entry = take_once_begun(buf, entry_key(tokens))
                assert entry is not None and entry.committed and entry.num_tokens == len(tokens)
                assert torch.equal(assemble(entry), kv)
                assert entry.meta.tolist() == [seed, 7] and entry.received == ENTRY_BYTES
                assert buf.take(entry_key(tokens), timeout=0.2) is None  # taken: gone
            assert len(buf) == 0 and buf.staged_bytes() == 0 and buf.stats["taken"] == 3
        finally:
            done.set()
            outcome = producer.result()
            buf.close()
    assert outcome["pushed"] == [1, 2, 3] and outcome["stats"]["push_failed"] == 0


def test_a_prompt_pushed_again_while_staged_keeps_the_staged_copy(cfg):
    """A repeated prompt prefilled twice before its decode: the second push of the same key must neither be taken
    for the first one's pieces nor drop it (it did: 'DATA ... does not fit its entry: entry dropped')."""
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1, 1, 2], done, None, 0.5)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20)
        try:
            key2 = entry_key(programs.push_entry(2)[0])
            second = take_once_begun(buf, key2)  # the last entry: every message before it has arrived
            tokens, kv = programs.push_entry(1)
            first = buf.take(entry_key(tokens), timeout=1.0)
            assert first is not None and torch.equal(assemble(first), kv) and first.received == ENTRY_BYTES
            assert second is not None and torch.equal(assemble(second), programs.push_entry(2)[1])
            assert buf.stats["duplicates"] == 1 and buf.stats["malformed"] == 0 and buf.stats["aborted"] == 0
        finally:
            done.set()
            outcome = producer.result()
            buf.close()
    assert outcome["pushed"] == [1, 1, 2]


def test_no_room_means_pull_and_the_consumer_does_not_wait(cfg):
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1, 2], done)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=ENTRY_BYTES + 100)  # room for one entry
        try:
            deadline = time.monotonic() + 60
            while buf.stats["pulled"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            start = time.monotonic()
            assert buf.take(entry_key(programs.push_entry(2)[0]), timeout=30) is None  # went by pull: no wait
            assert time.monotonic() - start < 1.0
            first = take_once_begun(buf, entry_key(programs.push_entry(1)[0]))
            assert first is not None and torch.equal(assemble(first), programs.push_entry(1)[1])
        finally:
            done.set()
            outcome = producer.result()
            buf.close()
    assert outcome["pushed"] == [1] and outcome["pulled"] == [2] and outcome["stats"]["no_credit"] > 0


def test_the_producer_learns_the_room_and_pulls_what_does_not_fit(cfg):
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1, 2, 3], done)
    with open_pipe(cfg, 1) as pipe:
        buf = PushReceiver(pipe, capacity=2 * ENTRY_BYTES)  # nobody takes: room for two entries only
        try:
            deadline = time.monotonic() + 60
            while buf.stats["pulled"] < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            done.set()
            outcome = producer.result()
            buf.close()
    assert outcome["pushed"] == [1, 2] and outcome["pulled"] == [3]
    assert buf.stats["staged"] == 2 and buf.stats["rejected"] == 0 and buf.staged_bytes() == 2 * ENTRY_BYTES


def test_unclaimed_entries_expire_and_free_their_room(cfg):
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1], done)
    with open_pipe(cfg, 1) as pipe:
        buf = PushReceiver(pipe, capacity=1 << 20, ttl=1.0)
        try:
            deadline = time.monotonic() + 60
            while buf.stats["expired"] < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert buf.stats["staged"] == 1 and buf.stats["expired"] == 1
            assert len(buf) == 0 and buf.staged_bytes() == 0
            assert buf.take(entry_key(programs.push_entry(1)[0]), timeout=0.5) is None
        finally:
            done.set()
            producer.result()
            buf.close()


def test_a_producer_killed_mid_entry_leaves_nothing_waiting(cfg):
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1], done, 4)  # hangs after 4 of 6 pieces
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20, ttl=3.0)
        try:
            deadline = time.monotonic() + 60
            while buf.stats["staged"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            producer.kill()
            start = time.monotonic()
            assert buf.take(entry_key(programs.push_entry(1)[0]), timeout=2.0) is None  # never committed
            assert time.monotonic() - start < 5.0  # (a 2 s wait took 3.6 s once under the full suite)
            deadline = time.monotonic() + 30
            while buf.stats["expired"] < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert buf.stats["expired"] == 1 and buf.staged_bytes() == 0
        finally:
            buf.close()


def test_take_of_an_entry_nobody_pushes_returns_at_once(cfg):
    """A request sent straight to the consumer (nothing prefilled, nothing pushed): no waiting for a push."""
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1], done)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20)
        try:
            assert take_once_begun(buf, entry_key(programs.push_entry(1)[0])) is not None
            start = time.monotonic()
            assert buf.take(entry_key([5, 6, 7]), timeout=10) is None
            assert time.monotonic() - start < 0.1
        finally:
            done.set()
            producer.result()
            buf.close()


def test_take_without_any_producer_returns_at_once(cfg):
    with open_pipe(cfg, 1) as pipe:
        buf = PushReceiver(pipe)
        try:
            start = time.monotonic()
            assert buf.take(entry_key([1, 2]), timeout=10) is None
            assert time.monotonic() - start < 1.0
        finally:
            buf.close()


def test_malformed_messages_are_counted_and_the_consumer_keeps_serving(cfg):
    done = ctx().Event()
    producer = Peer(programs.push_garbage_then_entry, cfg, 9, done)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20)
        try:
            tokens, kv = programs.push_entry(9)
            entry = take_once_begun(buf, entry_key(tokens))
            assert entry is not None and torch.equal(assemble(entry), kv)
            assert buf.stats["malformed"] >= 4  # not a header, bad magic, unknown kind, oversized DATA
            assert buf.take(entry_key([1, 2, 3]), timeout=0.5) is None  # the oversized entry was dropped
        finally:
            done.set()
            producer.result()
            buf.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match="role must be"):
        PushBuffer(None, "both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity and ttl must be > 0"):
        PushBuffer(None, "consumer", capacity=0)  # type: ignore[arg-type]


def test_no_thread_dies_silently_a_failing_message_is_skipped(cfg, monkeypatch):
    """Hardening finding 4: the push channel's threads caught only PipeError/ValueError, so any other error (a bug, or
    input nobody foresaw) ended the receiving for good and nobody noticed. Here handling the first BEGIN raises a
    TypeError: that message is skipped and counted, the thread lives on, and the next entries arrive exactly."""
    real = PushReceiver._handle
    failed: list[object] = []

    def flaky(self, message):
        if not failed and isinstance(message, Begin):  # the first BEGIN
            failed.append(message)
            raise TypeError("a bug")
        return real(self, message)

    monkeypatch.setattr(PushReceiver, "_handle", flaky)
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1, 2, 3], done)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20)
        try:
            got = []
            for seed in (2, 3):
                tokens, kv = programs.push_entry(seed)
                entry = take_once_begun(buf, entry_key(tokens))
                got.append(entry is not None and torch.equal(assemble(entry), kv))
            assert got == [True, True] and buf.healthy and buf.stats["malformed"] >= 1
        finally:
            done.set()
            producer.result()
            buf.close()
    assert not buf.healthy  # closed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # SystemExit, on purpose
def test_a_dead_receiving_thread_releases_what_it_staged(cfg, monkeypatch):
    """Hardening finding 4: if the consumer's receiving thread ever ends (SystemExit injected at the first COMMIT:
    its catch-all keeps any error from doing it), nobody expires its staged entries any more: the first ``healthy``
    check says it is unhealthy, releases them, and ``take`` answers None at once (the load goes by pull)."""
    real = PushReceiver._handle

    def dies_at_commit(self, message):
        if isinstance(message, Commit):
            raise SystemExit("test: the receiving thread ends")
        return real(self, message)

    monkeypatch.setattr(PushReceiver, "_handle", dies_at_commit)
    done = ctx().Event()
    producer = Peer(programs.push_entries, cfg, [1], done)
    with open_pipe(cfg, 1) as pipe:
        buf = consumer_for(pipe, capacity=1 << 20)
        try:
            tokens, _ = programs.push_entry(1)
            key = entry_key(tokens)
            deadline = time.monotonic() + 60
            while buf._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert buf.staged_bytes() == ENTRY_BYTES and buf.look(key) == STAGED  # staged, never committed
            start = time.monotonic()
            assert not buf.healthy
            assert buf.staged_bytes() == 0 and buf.look(key) != STAGED
            assert buf.take(key, timeout=30) is None and time.monotonic() - start < 1.0
        finally:
            done.set()
            producer.result()
            buf.close()
