"""The push channel's logic over the in-process pipe (``kv_pipe.local_pipe``): the header layout and its checks,
credits, staging, taking, PULL notices, expiry, failed sends and hostile messages. No engine and no subprocess: the
whole file runs in seconds. test_push_buffer.py runs the same ends over the real MooncakePipe between real processes."""

from __future__ import annotations

import time

import pytest
import torch

from kv_lookup_buffer import push_receiver
from kv_lookup_buffer import push_wire as pw
from kv_lookup_buffer.push_buffer import PushBuffer, PushReceiver, PushSender, entry_key
from kv_pipe import TransferError
from kv_pipe.local_pipe import LocalPipe, local_pipe_pair
from tests.polling import wait_for

pytestmark = [pytest.mark.pipes, pytest.mark.usefixtures("quick_poll")]

LAYERS, BLOCKS, BLOCK = 2, 3, (4,)
KV = torch.arange(LAYERS * BLOCKS * 4, dtype=torch.float32).view(LAYERS, BLOCKS, *BLOCK)
NBYTES = KV.numel() * 4
KEY = entry_key([1, 2, 3])


@pytest.fixture
def ends():
    """``make(**receiver_options)``: a receiver and a raw producer pipe (``raw=True``) or a sender on a local pipe."""
    made: list = []

    def make(raw: bool = False, **options):
        a, b = local_pipe_pair(timeout=5.0)
        receiver = PushReceiver(b, **options)
        sender = a if raw else PushSender(a)
        made.extend([receiver, sender])
        return sender, receiver

    yield make
    for end in made:
        if not isinstance(end, LocalPipe):
            end.close()


def take_once_begun(receiver: PushReceiver, key: bytes = KEY) -> push_receiver.PushedEntry | None:
    """``take`` waits only for a push whose BEGIN has arrived (a real load comes long after it): wait for that first."""
    return receiver.take(key, timeout=5) if wait_for(lambda: receiver.look(key) == push_receiver.STAGED) else None


def push_all(sender: PushSender, key: bytes = KEY, kv: torch.Tensor = KV) -> None:
    for layer in range(kv.shape[0]):
        sender.push(key, layer, 0, kv[layer, :2].clone(), 2)
        sender.push(key, layer, 2, kv[layer, 2:].clone(), kv.shape[1] - 2)
    sender.commit(key, 3, torch.tensor([7]))


def assemble(entry: push_receiver.PushedEntry) -> torch.Tensor:
    kv = torch.full((entry.num_layers, entry.num_blocks, *BLOCK), float("nan"))
    for layer, first, blocks in entry.pieces:
        kv[layer, first:first + blocks.shape[0]] = blocks
    return kv


# ----------------------------------------------------------------------------- the header
def old_header(kind: int, key: bytes = pw.NO_KEY, a: int = 0, b: int = 0, c: int = 0, d: int = 0) -> list[int]:
    """The header as the positional a, b, c, d layout wrote it."""
    return [pw.MAGIC, pw.VERSION, kind, *torch.frombuffer(bytearray(key), dtype=torch.int64).tolist(), a, b, c, d]


def test_named_fields_lay_out_the_same_words():
    cases = [(pw.Hello(12345), old_header(pw.HELLO, a=12345)),
             (pw.Begin(KEY, 100, 3, 5), old_header(pw.BEGIN, KEY, 100, 3, 5)),
             (pw.Data(KEY, 2, 1, 4), old_header(pw.DATA, KEY, 2, 1, 4)),
             (pw.Commit(KEY, 37), old_header(pw.COMMIT, KEY, 37)),
             (pw.Pull(KEY), old_header(pw.PULL, KEY)),
             (pw.Abort(KEY), old_header(pw.ABORT, KEY)),
             (pw.Credit(9, 1 << 30, 4), old_header(pw.CREDIT, a=9, b=1 << 30, c=4))]
    for message, words in cases:
        header = pw.encode(message)
        assert header.dtype == torch.int64 and header.tolist() == words
        assert pw.parse(header) == message and pw.key_of(message) == (KEY if hasattr(message, "key") else pw.NO_KEY)


def test_hostile_headers_are_refused_with_a_clear_error():
    good = pw.encode(pw.Begin(KEY, 100, 3, 5))

    def changed(i: int, value: int) -> torch.Tensor:
        t = good.clone()
        t[i] = value
        return t

    for frame, match in [(None, "expected a push header"), (good.float(), "expected a push header"),
                         (good[:10], "expected a push header"), (good.view(1, 11), "expected a push header"),
                         (changed(0, 7), "magic/version"), (changed(1, pw.VERSION - 1), "magic/version"),
                         (changed(2, 99), "unknown push message kind 99"), (changed(2, 0), "unknown push message"),
                         (changed(8, -1), "negative field in a BEGIN header"),
                         (changed(10, -5), "negative field")]:
        with pytest.raises(ValueError, match=match):
            pw.parse(frame)
    commit = pw.encode(pw.Commit(KEY, 3, 1))
    assert pw.parse(commit) == pw.Commit(KEY, 3, 1)
    commit[8] = 2  # how many tensors follow must be known: hidden is 0 or 1
    with pytest.raises(ValueError, match="hidden must be 0 or 1"):
        pw.parse(commit)


# ----------------------------------------------------------------------------- sender and receiver together
def test_an_entry_pushed_in_pieces_is_taken_once(ends):
    sender, receiver = ends(capacity=1 << 20)
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))  # once the first credit arrived
    push_all(sender)
    entry = take_once_begun(receiver)
    assert entry is not None and entry.committed and entry.num_tokens == 3 and entry.meta.tolist() == [7]
    assert torch.equal(assemble(entry), KV) and entry.received == NBYTES
    assert receiver.take(KEY, timeout=0.5) is None and len(receiver) == 0 and receiver.staged_bytes() == 0
    assert wait_for(lambda: sender.stats["committed"] == 1)
    assert sender.stats["begun"] == 1 and sender.stats["pushed_bytes"] == NBYTES and receiver.stats["taken"] == 1
    assert receiver.has_producer() and sender.healthy and receiver.healthy


def test_a_commit_carries_a_hidden_tensor_filled_once_every_piece_before_it_is_sent(ends):
    """``commit(hidden=, ready=)``: the sender thread runs each piece's ``ready`` then the commit's, in the order they
    were queued (what the KV digests of a push rely on); the entry carries the tensor to whoever takes it."""
    sender, receiver = ends(capacity=1 << 20)
    assert wait_for(lambda: sender.begin(KEY, NBYTES + 8 * BLOCKS, LAYERS, BLOCKS))  # its hidden tensor announced too
    order: list[str] = []
    hidden = torch.zeros(BLOCKS, dtype=torch.int64)
    for layer in range(LAYERS):
        sender.push(KEY, layer, 0, KV[layer].clone(), BLOCKS, ready=lambda layer=layer: order.append(f"data {layer}"))

    def fill() -> None:
        order.append("commit")
        hidden.copy_(torch.tensor([5, 6, 7]))
    sender.commit(KEY, 3, torch.tensor([7]), hidden, ready=fill)
    entry = take_once_begun(receiver)
    assert entry is not None and entry.hidden.tolist() == [5, 6, 7] and entry.meta.tolist() == [7]
    assert order == ["data 0", "data 1", "commit"] and torch.equal(assemble(entry), KV)


def test_a_hidden_tensor_is_staged_in_the_room_its_begin_announced(ends):
    """A COMMIT's hidden tensor is staged with its entry, in the bytes its BEGIN announced: one larger than what is
    left of them drops the entry (counted as malformed); the producer's next push is staged and taken as usual."""
    pipe, receiver = ends(raw=True, capacity=1 << 20)
    pipe.send_tensor(pw.encode(pw.Hello(5)))
    for hidden in (torch.zeros(8, dtype=torch.int64), torch.tensor([1, 2, 3])):  # 64 bytes, then 24, of 32 left
        pipe.send_tensor(pw.encode(pw.Begin(KEY, NBYTES + 32, LAYERS, BLOCKS)))
        for layer in range(LAYERS):
            pipe.send_tensor(pw.encode(pw.Data(KEY, layer, 0, BLOCKS)))
            pipe.send_tensor(KV[layer].clone())
        pipe.send_tensor(pw.encode(pw.Commit(KEY, 3, 1)))
        pipe.send_tensor(torch.tensor([7]))
        pipe.send_tensor(hidden)
        if hidden.numel() > 3:
            assert wait_for(lambda: receiver.stats["malformed"] == 1)
            assert receiver.look(KEY) == push_receiver.DROPPED and receiver.staged_bytes() == 0
    entry = take_once_begun(receiver)
    assert entry is not None and entry.hidden.tolist() == [1, 2, 3] and torch.equal(assemble(entry), KV)
    assert receiver.stats["malformed"] == 1 and receiver.healthy and receiver.staged_bytes() == 0

def test_a_commit_that_fails_to_send_aborts_its_entry_at_once(ends):
    """The producer committed (nothing was kept for pull) but the commit's ``ready`` fails: the consumer is told at
    once (ABORT), not left to wait for the entry until its deadline."""
    sender, receiver = ends(capacity=1 << 20)
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    for layer in range(LAYERS):
        sender.push(KEY, layer, 0, KV[layer].clone(), BLOCKS)

    def fail() -> None:
        raise RuntimeError("hashing failed")
    sender.commit(KEY, 3, torch.tensor([7]), torch.zeros(BLOCKS, dtype=torch.int64), ready=fail)
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.DROPPED)
    assert receiver.stats["aborted"] == 1 and sender.stats["push_failed"] == 1 and receiver.staged_bytes() == 0


def test_an_entry_given_up_is_dropped_by_the_consumer_and_its_queued_pieces_are_not_sent(ends):
    """``abort`` (its request ended mid-prefill): the consumer drops what it staged at once; pieces queued after it
    are not sent."""
    sender, receiver = ends(capacity=1 << 20)
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.STAGED)
    with sender._out_cv:  # the sender thread busy elsewhere: the pieces are still queued when the request ends
        sender.push(KEY, 0, 0, KV[0].clone(), BLOCKS)
        sender.abort(KEY)
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.DROPPED)
    time.sleep(0.2)
    assert receiver.stats["aborted"] == 1 and receiver.staged_bytes() == 0 and sender.stats["pushed_bytes"] == 0
    assert not sender.failed(KEY)  # a later push of the same prompt goes as usual
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    push_all(sender)
    entry = take_once_begun(receiver)
    assert entry is not None and torch.equal(assemble(entry), KV)


def test_no_credit_means_pull(ends):
    a, b = local_pipe_pair(timeout=5.0)
    sender = PushSender(a, first_credit_wait=0.3)
    try:
        start = time.monotonic()
        assert not sender.begin(KEY, NBYTES, LAYERS, BLOCKS)  # no consumer heard from: waited for it once
        assert 0.25 < time.monotonic() - start < 2.0
        start = time.monotonic()
        assert not sender.begin(KEY, NBYTES, LAYERS, BLOCKS) and time.monotonic() - start < 0.1  # not again
        assert sender.stats["no_credit"] == 2
    finally:
        sender.close()
    sender, receiver = ends(capacity=NBYTES + 10)  # room for one entry
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    other = entry_key([4, 5])
    assert not sender.begin(other, NBYTES, LAYERS, BLOCKS)  # the first one's BEGIN holds the room
    sender.notify_pull(other)
    start = time.monotonic()
    assert receiver.take(other, timeout=5) is None and time.monotonic() - start < 1.0  # never begun: no wait
    push_all(sender)
    assert take_once_begun(receiver) is not None
    assert wait_for(lambda: sender.begin(other, NBYTES, LAYERS, BLOCKS))  # taken: its room is credited back


def test_the_first_begin_on_a_new_link_waits_for_the_first_credit(ends):
    """A link made for a request (its first, or again after link_idle) has not heard from the consumer yet: that
    request is pushed all the same, not served by pull."""
    sender, receiver = ends(capacity=1 << 20)
    assert sender.begin(KEY, NBYTES, LAYERS, BLOCKS)  # at once, no retry
    assert sender.stats["no_credit"] == 0
    push_all(sender)
    assert take_once_begun(receiver) is not None


def test_a_pull_notice_ends_a_begun_push_and_take_does_not_wait(ends):
    sender, receiver = ends(capacity=1 << 20)
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.STAGED)
    sender.notify_pull(KEY)
    assert wait_for(lambda: receiver.stats["pulled"] == 1)
    start = time.monotonic()
    assert receiver.take(KEY, timeout=5) is None and time.monotonic() - start < 1.0
    assert receiver.staged_bytes() == 0


def test_unclaimed_entries_expire_and_free_their_room(ends):
    sender, receiver = ends(capacity=1 << 20, ttl=0.1)
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    push_all(sender)
    assert wait_for(lambda: receiver.stats["expired"] == 1)
    assert receiver.staged_bytes() == 0 and len(receiver) == 0 and receiver.take(KEY, timeout=0) is None


class FlakyPipe(LocalPipe):
    """A local pipe end whose sends fail while ``failing`` is set (as a transfer to a dead peer does)."""

    failing = False

    def send_tensor(self, tensor, timeout=None):
        if self.failing:
            raise TransferError("test: the transfer failed")
        super().send_tensor(tensor, timeout)


def test_a_failed_send_fails_its_entry_and_its_pull_notice_still_goes():
    a, b = local_pipe_pair(timeout=5.0)
    a.__class__ = FlakyPipe
    receiver, sender = PushReceiver(b, capacity=1 << 20), PushSender(a)
    try:
        assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
        assert wait_for(lambda: receiver.look(KEY) == push_receiver.STAGED)
        a.failing = True
        sender.push(KEY, 0, 0, KV[0].clone(), BLOCKS)
        assert wait_for(lambda: sender.failed(KEY)) and sender.stats["push_failed"] == 1
        a.failing = False
        push_all(sender)  # the rest of a failed entry is not sent
        sender.notify_pull(KEY)
        assert wait_for(lambda: receiver.stats["pulled"] == 1)
        assert receiver.take(KEY, timeout=0) is None and sender.stats["committed"] == 0
        assert receiver.stats["malformed"] == 0
        # its request is done with it (the pull notice went): the same prompt again is pushed as usual
        assert wait_for(lambda: not sender.failed(KEY))
        assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
        push_all(sender)
        entry = take_once_begun(receiver)
        assert entry is not None and torch.equal(assemble(entry), KV)
    finally:
        sender.close()
        receiver.close()


# ----------------------------------------------------------------------------- hostile or odd producers
def test_hostile_messages_are_counted_and_the_receiver_keeps_serving(ends):
    pipe, receiver = ends(raw=True, capacity=1 << 20)
    send = pipe.send_tensor
    send(pw.encode(pw.Hello(12345)))
    send(torch.zeros(3))                                                   # not a header
    send(pw.encode(pw.Credit(1, 2, 3)))                                    # a consumer's message
    other = entry_key([9])
    send(pw.encode(pw.Begin(other, 64, 3, 5)))
    send(pw.encode(pw.Data(other, 0, 0, 1)))
    send(torch.zeros(1000))                                                # 4000 bytes > the 64 announced
    send(pw.encode(pw.Begin(entry_key([8]), 64, 0, 5)))                    # no layers: refused
    send(pw.encode(pw.Data(entry_key([7]), 0, 0, 1)))                      # never begun: its bytes are dropped
    send(torch.zeros(4))
    send(pw.encode(pw.Begin(KEY, NBYTES, LAYERS, BLOCKS)))
    send(pw.encode(pw.Data(KEY, LAYERS, 0, 1)))                            # a layer it does not have: dropped
    send(KV[0, :1].clone())
    send(pw.encode(pw.Begin(KEY, NBYTES, LAYERS, BLOCKS)))                 # again, after the drop: staged
    for layer in range(LAYERS):
        send(pw.encode(pw.Data(KEY, layer, 0, BLOCKS)))
        send(KV[layer].clone())
    send(pw.encode(pw.Commit(KEY, 3)))
    send(None)
    # past the first BEGIN's drop (else ``take`` may see the first entry, begun then dropped, and return None)
    assert wait_for(lambda: receiver.stats["malformed"] == 4)
    entry = take_once_begun(receiver)
    assert entry is not None and torch.equal(assemble(entry), KV) and entry.meta is None
    assert receiver.stats["malformed"] == 4  # not a header, CREDIT, oversized DATA, DATA of a missing layer
    assert receiver.stats["rejected"] == 1 and receiver.take(other, timeout=0) is None
    assert receiver.staged_bytes() == 0 and receiver.healthy


def test_a_prompt_pushed_again_while_staged_keeps_the_staged_copy(ends):
    pipe, receiver = ends(raw=True, capacity=1 << 20)
    pipe.send_tensor(pw.encode(pw.Hello(5)))
    for value in (1.0, 2.0):  # the second push is the same prompt: its bytes are the same in truth
        pipe.send_tensor(pw.encode(pw.Begin(KEY, NBYTES, LAYERS, BLOCKS)))
        for layer in range(LAYERS):
            pipe.send_tensor(pw.encode(pw.Data(KEY, layer, 0, BLOCKS)))
            pipe.send_tensor(torch.full((BLOCKS, *BLOCK), value))
        pipe.send_tensor(pw.encode(pw.Commit(KEY, 3)))
        pipe.send_tensor(torch.tensor([int(value)]))
    assert wait_for(lambda: receiver.stats["duplicates"] == 1 and not receiver._repeats)
    entry = receiver.take(KEY, timeout=0)
    assert entry is not None and entry.meta.tolist() == [1] and entry.received == NBYTES
    assert receiver.stats["malformed"] == 0 and receiver.stats["aborted"] == 0


def test_an_abort_drops_the_staged_entry(ends):
    pipe, receiver = ends(raw=True, capacity=1 << 20)
    pipe.send_tensor(pw.encode(pw.Hello(5)))
    pipe.send_tensor(pw.encode(pw.Begin(KEY, NBYTES, LAYERS, BLOCKS)))
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.STAGED)
    pipe.send_tensor(pw.encode(pw.Abort(KEY)))
    assert wait_for(lambda: receiver.stats["aborted"] == 1)
    assert not receiver.look(KEY) == push_receiver.STAGED and receiver.staged_bytes() == 0


def test_the_receivers_credits_follow_its_room():
    a, b = local_pipe_pair(timeout=5.0)
    receiver = PushReceiver(b, capacity=1000)
    try:
        assert pw.parse(a.recv_tensor(timeout=5)) == pw.Credit(0, 1000, 0)  # it exists: no producer met yet
        a.send_tensor(pw.encode(pw.Hello(77)))
        assert pw.parse(a.recv_tensor(timeout=5)) == pw.Credit(77, 1000, 0)
        a.send_tensor(pw.encode(pw.Begin(KEY, 600, 1, 1)))
        assert pw.parse(a.recv_tensor(timeout=5)) == pw.Credit(77, 400, 1)
    finally:
        receiver.close()


def test_a_sender_ignores_odd_credits_and_says_hello_to_a_new_consumer():
    a, b = local_pipe_pair(timeout=5.0)
    sender = PushSender(a)
    try:
        hello = pw.parse(b.recv_tensor(timeout=5))
        assert isinstance(hello, pw.Hello)
        b.send_tensor(pw.encode(pw.Begin(KEY, 1, 1, 1)))  # not a consumer's message
        b.send_tensor(torch.zeros(2))
        assert wait_for(lambda: sender.stats["malformed"] == 2)
        b.send_tensor(pw.encode(pw.Credit(hello.epoch + 1, 1 << 20, 0)))  # a consumer of another epoch
        assert pw.parse(b.recv_tensor(timeout=5)) == hello  # said again
        assert not sender.begin(KEY, 10, 1, 1)
        b.send_tensor(pw.encode(pw.Credit(hello.epoch, 1 << 20, 0)))
        assert wait_for(lambda: sender.begin(KEY, 10, 1, 1))
        assert pw.parse(b.recv_tensor(timeout=5)) == pw.Begin(KEY, 10, 1, 1)
    finally:
        sender.close()


def test_push_buffer_makes_the_end_for_a_role():
    a, b = local_pipe_pair()
    sender, receiver = PushBuffer(a, "producer"), PushBuffer(b, "consumer", capacity=5, ttl=1.0)
    try:
        assert isinstance(sender, PushSender) and isinstance(receiver, PushReceiver) and receiver.capacity == 5
        assert set(sender.stats) == set(receiver.stats)  # one set of counters: callers sum them over ends
    finally:
        sender.close()
        receiver.close()
    with pytest.raises(ValueError, match="role must be"):
        PushBuffer(a, "both")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity and ttl must be > 0"):
        PushBuffer(b, "consumer", capacity=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # SystemExit, on purpose
def test_a_dead_receiving_thread_releases_what_it_staged(ends, monkeypatch):
    real = PushReceiver._handle

    def dies_at_commit(self, message):
        if isinstance(message, pw.Commit):
            raise SystemExit("test: the receiving thread ends")
        return real(self, message)

    monkeypatch.setattr(PushReceiver, "_handle", dies_at_commit)
    sender, receiver = ends(capacity=1 << 20)
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    push_all(sender)
    assert wait_for(lambda: not receiver._thread.is_alive())
    assert receiver.staged_bytes() == NBYTES and receiver.look(KEY) == push_receiver.STAGED
    assert not receiver.healthy
    assert receiver.staged_bytes() == 0 and receiver.take(KEY, timeout=5) is None


# ----------------------------------------------------------------------------- a load awaiting a push (concurrent dispatch)
def test_look_says_how_a_push_went_and_arrivals_wake_a_waiter(ends):
    arrivals = push_receiver.PushArrivals()
    sender, receiver = ends(capacity=1 << 20, arrivals=arrivals)
    assert receiver.look(KEY) is None
    seen = arrivals.seq
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))
    assert arrivals.wait(seen, 5.0) and wait_for(lambda: receiver.look(KEY) == push_receiver.STAGED)
    seen = arrivals.seq
    sender.notify_pull(KEY)  # e.g. the push failed: served by pull
    assert arrivals.wait(seen, 5.0) and wait_for(lambda: receiver.look(KEY) == push_receiver.PULL)
    assert receiver.take_notice(KEY) == push_receiver.PULL and receiver.look(KEY) is None  # used once
    start = time.monotonic()
    assert not arrivals.wait(arrivals.seq, 0.1) and time.monotonic() - start >= 0.09  # nothing new: waits it out


def test_a_notice_that_came_before_the_load_is_remembered_until_used_or_a_new_push(ends):
    sender, receiver = ends(capacity=1 << 20)
    other = entry_key([4, 5])
    sender.notify_pull(other)  # no room: the producer saved it for pull before any load asked
    sender.notify_pull(KEY)
    assert wait_for(lambda: receiver.look(other) == push_receiver.PULL and receiver.look(KEY) == push_receiver.PULL)
    assert receiver.take(other, timeout=0) is None and receiver.take_notice(other) == push_receiver.PULL
    assert receiver.look(other) is None  # used once
    assert wait_for(lambda: sender.begin(KEY, NBYTES, LAYERS, BLOCKS))  # the same tokens pushed again
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.STAGED)
    push_all(sender)
    assert take_once_begun(receiver) is not None and receiver.look(KEY) is None


def test_a_refused_or_aborted_push_is_remembered_as_dropped(ends):
    pipe, receiver = ends(raw=True, capacity=1 << 20)
    pipe.send_tensor(pw.encode(pw.Hello(5)))
    big = entry_key([6])
    pipe.send_tensor(pw.encode(pw.Begin(big, 2 << 20, LAYERS, BLOCKS)))  # more than the room: refused
    pipe.send_tensor(pw.encode(pw.Begin(KEY, NBYTES, LAYERS, BLOCKS)))
    pipe.send_tensor(pw.encode(pw.Abort(KEY)))
    assert wait_for(lambda: receiver.look(KEY) == push_receiver.DROPPED)
    assert receiver.look(big) == push_receiver.DROPPED and receiver.take_notice(big) == push_receiver.DROPPED


def test_notices_are_bounded_in_number_and_time(ends, monkeypatch):
    monkeypatch.setattr(push_receiver, "MAX_NOTICES", 3)
    sender, receiver = ends(capacity=1 << 20, ttl=0.3)
    keys = [entry_key([i]) for i in range(5)]
    for key in keys:
        sender.notify_pull(key)
    assert wait_for(lambda: receiver.stats["pulled"] == 5)
    assert [receiver.look(k) for k in keys] == [None, None, "pull", "pull", "pull"]  # the oldest forgotten
    assert wait_for(lambda: all(receiver.look(k) is None for k in keys))  # and all after ttl
