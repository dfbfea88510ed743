"""SimpleBuffer's logic over the in-process pipe (``kv_pipe.local_pipe``): matching, roi masks, partial keys, room and
eviction, expiry, malformed requests, timeouts and closing. No engine and no subprocess: the whole file runs in
seconds. test_simple_buffer.py runs the same buffer over the real MooncakePipe between real processes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kv_lookup_buffer import BufferClosed, BufferFull, SimpleBuffer, simple_consumer, simple_producer
from kv_lookup_buffer.simple_wire import (
    ANSWER_MAGIC,
    LOOKED,
    MISS,
    OP_DROP_SELECT,
    OP_LOOKUP,
    answer_frame,
    looked_frame,
    read_answer,
    request_frame,
)
from kv_pipe.local_pipe import local_pipe_pair
from kv_pipe.memory import RECYCLE_MIN, RecyclePool
from tests.kv_lookup_buffer import programs

pytestmark = pytest.mark.pipes

MISSED = [None] * 5


def same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def same_entry(got, entry) -> bool:
    return all(same(a, b) for a, b in zip(got, entry, strict=True))


@pytest.fixture(autouse=True)
def quick_poll(monkeypatch):
    """The serving and receiving threads look at close() and the clock more often: closing takes no half second."""
    monkeypatch.setattr(simple_producer, "_POLL", 0.02)
    monkeypatch.setattr(simple_consumer, "_POLL", 0.02)


@pytest.fixture
def link():
    """A producer buffer and a consumer buffer on the two ends of a local pipe; ``make(**options)`` builds them."""
    made = []

    def make(thresh: float = 1 << 20, timeout: float = 5.0, **options):
        a, b = local_pipe_pair(timeout=timeout)
        producer = SimpleBuffer(a, a, thresh, timeout=timeout, role="producer", **options)
        consumer = SimpleBuffer(b, b, 1 << 30, timeout=timeout, role="consumer")
        made.append((producer, consumer))
        return producer, consumer

    yield make
    for producer, consumer in made:
        consumer.close()
        producer.close()


def test_prefix_and_roi_matching_takes_each_entry_once(link):
    producer, consumer = link()
    entries = programs.prefix_entries()
    for entry in entries:
        producer.insert(*entry)
    assert same_entry(consumer.drop_select(torch.tensor([1, 2]), None), entries[0])  # the query is a prefix
    assert same_entry(consumer.drop_select(torch.tensor([10, 11, 12, 13, 14]), None), entries[1])  # the entry is
    assert same_entry(consumer.drop_select(torch.tensor([20, 55, 21, 66]), torch.tensor([True, False, True, False])),
                      entries[2])  # only the masked tokens take part
    assert same_entry(consumer.drop_select(torch.tensor([30, 31, 32, 7]), torch.tensor([1.0, 1.0, 1.0, 0.0])),
                      entries[3])  # a float roi
    assert consumer.drop_select(torch.tensor([1, 2, 3, 4]), None) == MISSED  # taken already
    assert consumer.drop_select(None, None) == MISSED
    assert len(producer) == 0 and producer.buffer_size == 0
    assert producer.stats["hits"] == 4 and producer.stats["misses"] == 2


def test_any_entry_is_the_oldest(link):
    producer, consumer = link()
    entries = programs.prefix_entries()
    for entry in entries:
        producer.insert(*entry)
    got = [consumer.drop_select(None, None) for _ in range(5)]
    assert all(same_entry(g, e) for g, e in zip(got, entries, strict=False)) and got[4] == MISSED


def test_bad_calls_are_refused_before_anything_is_sent(link):
    producer, consumer = link(thresh=1000)
    with pytest.raises(ValueError, match="can never fit"):
        producer.insert(torch.arange(10), None, torch.zeros(1000), None, None)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        producer.insert(torch.zeros(3), None, None, None, None)
    with pytest.raises(ValueError, match="roi must have the shape"):
        consumer.drop_select(torch.tensor([1, 2]), torch.tensor([True]))
    with pytest.raises(ValueError, match="roi given without input_tokens"):
        consumer.drop_select(None, torch.tensor([True]))
    with pytest.raises(ValueError, match="key_rows"):
        consumer.drop_select(torch.tensor([1]), None, key_rows=(3, 1))
    with pytest.raises(ValueError, match="shares"):
        consumer.drop_select(torch.tensor([1]), None, shares=0)
    with pytest.raises(RuntimeError, match="belongs to the producer"):
        consumer.insert(torch.tensor([1]), None, None, None, None)
    assert len(producer) == 0 and producer.buffer_size == 0 and producer.stats["misses"] == 0


def test_key_rows_parts_and_shares(link):
    producer, consumer = link()
    tokens, _, key, value, _ = programs.parts_entries()[0]
    producer.insert(*programs.parts_entries()[0])
    first = consumer.drop_select(tokens, None, key_rows=(1, 3), key_part=(2, 4), shares=2)
    assert len(producer) == 1  # one of two shares taken: the entry stays for the other
    second = consumer.drop_select(tokens, None, key_part=(0, 99), shares=2)  # clamped: all of it
    assert consumer.drop_select(tokens, None) == MISSED
    assert same(first[2], key[1:3, :, 2:4].contiguous()) and first[2].is_contiguous() and same(first[3], value)
    assert same(second[2], key)
    assert producer.stats["hit_key_bytes"] == (2 * 2 * 2 * 3 + key.numel()) * 4


def test_insert_copies_unless_told_not_to(link):
    producer, consumer = link()
    a_key, b_key = torch.arange(12.0), torch.arange(12.0) * 2
    producer.insert(torch.tensor([1, 2]), None, a_key, None, None)
    a_key.fill_(-1.0)
    producer.insert(torch.tensor([3, 4]), None, b_key, None, None, copy=False)
    assert same(consumer.drop_select(torch.tensor([1, 2]), None)[2], torch.arange(12.0))
    assert same(consumer.drop_select(torch.tensor([3, 4]), None)[2], torch.arange(12.0) * 2)


def test_a_full_buffer_blocks_insert_until_an_entry_is_taken(link):
    entries = programs.stress_entries()
    producer, consumer = link(thresh=programs.STRESS_ENTRY_BYTES, timeout=5.0)
    producer.insert(*entries[0])
    done = threading.Event()

    def second() -> None:
        producer.insert(*entries[1])
        done.set()

    threading.Thread(target=second, daemon=True).start()
    assert not done.wait(0.1)  # no room: it waits
    assert same_entry(consumer.drop_select(entries[0][0], None), entries[0])
    assert done.wait(5)  # the answer freed the room
    assert len(producer) == 1 and producer.buffer_size == programs.STRESS_ENTRY_BYTES


def test_a_full_buffer_times_out_with_a_clear_error(link):
    entries = programs.stress_entries()
    producer, _ = link(thresh=programs.STRESS_ENTRY_BYTES, timeout=0.2)
    producer.insert(*entries[0])
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="the buffer stayed full"):
        producer.insert(*entries[1])
    assert 0.15 < time.monotonic() - start < 3.0 and producer.buffer_size == programs.STRESS_ENTRY_BYTES


def test_evict_drops_the_oldest_to_make_room(link):
    entries = programs.stress_entries()[:5]
    producer, consumer = link(thresh=2 * programs.STRESS_ENTRY_BYTES, evict=True)
    for entry in entries:
        producer.insert(*entry)  # never waits
    assert producer.stats["evicted"] == 3 and len(producer) == 2
    assert producer.buffer_size == 2 * programs.STRESS_ENTRY_BYTES
    assert consumer.drop_select(entries[0][0], entries[0][1]) == MISSED
    assert same_entry(consumer.drop_select(entries[4][0], entries[4][1]), entries[4])


def test_entries_older_than_max_age_expire_without_a_request(link):
    producer, consumer = link(max_age=0.1)
    for entry in programs.prefix_entries():
        producer.insert(*entry)
    deadline = time.monotonic() + 5
    while producer.stats["expired"] < 4 and time.monotonic() < deadline:
        time.sleep(0.02)  # the serving thread expires them between requests
    assert producer.stats["expired"] == 4 and len(producer) == 0 and producer.buffer_size == 0
    assert consumer.drop_select(None, None) == MISSED


def test_malformed_requests_are_answered_or_skipped_and_serving_goes_on():
    a, b = local_pipe_pair(timeout=5.0)
    producer = SimpleBuffer(a, a, 1 << 20, role="producer")
    entry = programs.basic_entries()[0]
    producer.insert(*entry)
    op = OP_DROP_SELECT
    skipped = [torch.tensor([3.0, 1.0, 0.0]), torch.tensor([9, 8, 1]), torch.tensor([1, 8]), None]
    answered = [
        torch.tensor([op, 7, 5, 0, -1, 0, -1, 1, 0, 0, 1, 2]),  # unknown kind
        torch.tensor([op, 8, 0, 0, -1, 0, -1, 1, 0, 0, 1, 2, 3]),  # "take any" with tokens
        torch.tensor([op, 9, 1, 5, 2, 0, -1, 1, 0, 0, 1, 2, 3]),  # rows [5, 2)
        torch.tensor([op, 10, 1, 0, -1, 3, 1, 1, 0, 0, 1, 2, 3]),  # part [3, 1)
        torch.tensor([op, 11, 1, 0, -1, 0, -1, 0, 0, 0, 1, 2, 3]),  # 0 shares
        torch.tensor([op, 12, 1, 0, -1, 0, -1, 1 << 40, 0, 0, 1, 2, 3]),  # 2**40 shares
        torch.tensor([3, 13, 1, 0, -1, 0, -1, 1, 1, 2, 3]),  # an older version's request
        torch.tensor([OP_LOOKUP, 14, 1, 0, -1, 0, -1, 1, 0, 1000, 1, 2, 3]),  # a lookup without a lease
        torch.tensor([OP_LOOKUP, 15, 0, 0, -1, 0, -1, 1, 9, 1000]),  # a lookup without tokens
        torch.tensor([OP_LOOKUP, 16, 1, 0, -1, 0, -1, 1, 9, 0, 1, 2, 3]),  # a lease of no time
    ]
    try:
        for frame in skipped + answered:
            b.send_tensor(frame)
        for seq in range(7, 17):
            assert b.recv_tensor(timeout=5).tolist() == [ANSWER_MAGIC, MISS, seq]
        consumer = SimpleBuffer(b, b, 1 << 30, role="consumer")  # the same link, now spoken properly
        assert same_entry(consumer.drop_select(entry[0], None), entry)
        assert consumer.drop_select(entry[0], None) == MISSED  # answered once the hit before it was counted
        assert producer.healthy and producer.stats["malformed"] == 14 and producer.stats["hits"] == 1
        assert producer.stats["leases"] == 0
        consumer.close()
    finally:
        producer.close()


def test_frames_that_start_no_answer_are_skipped_by_the_consumer():
    a, b = local_pipe_pair(timeout=5.0)
    consumer = SimpleBuffer(b, b, 1 << 30, role="consumer")
    try:
        a.send_tensor(torch.tensor([1, 2, 3]))  # e.g. the rest of an answer that broke off
        a.send_tensor(answer_frame(MISS, 99))  # an answer nobody asked for
        thread_result: list = []
        thread = threading.Thread(target=lambda: thread_result.append(consumer.drop_select(torch.tensor([5]), None)))
        thread.start()
        request = a.recv_tensor(timeout=5)
        assert request.tolist()[:2] == [OP_DROP_SELECT, 1]
        a.send_tensor(answer_frame(MISS, 1))
        thread.join(5)
        assert thread_result == [MISSED] and consumer.stats["stray_frames"] == 1
    finally:
        consumer.close()


def test_a_request_that_times_out_does_not_disturb_later_ones():
    """A producer that starts serving only after the first request gave up: its late answer is dropped, the next
    request gets its own entry."""
    entries = programs.large_entries()
    a, b = local_pipe_pair(timeout=5.0)
    producer = SimpleBuffer(None, None, 1 << 30, role="producer")  # serves only the links it is given
    consumer = SimpleBuffer(b, b, 1 << 30, role="consumer")
    try:
        for entry in entries:
            producer.insert(*entry)
        with pytest.raises(TimeoutError, match="no answer to drop_select request 1"):
            consumer.drop_select(entries[0][0], None, timeout=0.05)
        producer.serve_link(a)
        got = consumer.drop_select(entries[1][0], None)
        assert same_entry(got, entries[1]) and consumer.stats["late_hits_dropped"] == 1
        assert len(producer) == 0  # the late answer took the first entry
    finally:
        consumer.close()
        producer.close()


def test_key_out_receives_the_key_in_place(link):
    producer, consumer = link(thresh=1 << 30)
    entry = programs.large_entries()[0]
    producer.insert(*entry)
    room = torch.empty(16 << 20, dtype=torch.uint8)
    got = consumer.drop_select(entry[0], None, key_out=room)
    assert same(got[2], entry[2]) and got[2].data_ptr() == room.data_ptr()


def test_consumer_close_unblocks_a_blocked_insert(link):
    entries = programs.stress_entries()
    producer, consumer = link(thresh=programs.STRESS_ENTRY_BYTES, timeout=30.0)
    producer.insert(*entries[0])
    errors: list[BaseException] = []

    def blocked_insert() -> None:
        try:
            producer.insert(*entries[1])
        except BaseException as e:  # handed to the test
            errors.append(e)

    thread = threading.Thread(target=blocked_insert)
    thread.start()
    deadline = time.monotonic() + 5
    while not producer.producer._cv._waiters and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.005)  # until the insert waits for room (a goodbye before it began would not concern it)
    consumer.close()  # its goodbye wakes the insert
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], BufferClosed)
    assert "the consumer closed the buffer" in str(errors[0])


def test_producer_close_fails_a_request_in_flight(link):
    producer, consumer = link(timeout=30.0)  # the producer never serves: the request waits for an answer
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            consumer.drop_select(torch.tensor([1]), None)
        except BaseException as e:  # handed to the test
            errors.append(e)

    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.monotonic() + 5
    while not consumer.consumer._pending and time.monotonic() < deadline:
        time.sleep(0.005)
    producer.close()  # answers CLOSED
    thread.join(5)
    assert len(errors) == 1 and isinstance(errors[0], BufferClosed)
    assert "the producer closed the buffer" in str(errors[0])


def test_closed_buffers_refuse_calls():
    a, b = local_pipe_pair()
    producer = SimpleBuffer(a, a, 1 << 20)
    producer.close()
    producer.close()  # idempotent
    with pytest.raises(BufferClosed, match="insert on a closed buffer"):
        producer.insert(torch.tensor([1]), None, None, None, None)
    consumer = SimpleBuffer(b, b, 1 << 20, role="consumer")
    consumer.close()
    assert a.recv_tensor(timeout=0).tolist()[0] == 4  # its goodbye (OP_CLOSE) to the producer
    with pytest.raises(BufferClosed, match="drop_select on a closed buffer"):
        consumer.drop_select(None, None)


def test_a_sent_entry_leaves_its_memory_for_the_next_insert(link):
    """Copies of large entries go back to the recycling pool once sent, and the next insert of that size reuses them."""
    producer, consumer = link(thresh=1 << 30)
    big = torch.arange(RECYCLE_MIN // 4, dtype=torch.float32)
    producer.insert(torch.tensor([1]), None, big, None, None)
    consumer.drop_select(torch.tensor([1]), None)
    deadline = time.monotonic() + 5
    while producer.producer._recycler.held == 0 and time.monotonic() < deadline:
        time.sleep(0.005)  # the producer releases an entry once its last tensor is sent, maybe after it arrived
    assert producer.producer._recycler.held == big.numel() * 4
    producer.insert(torch.tensor([2]), None, big + 1, None, None)
    assert producer.producer._recycler.held == 0
    assert same(consumer.drop_select(torch.tensor([2]), None)[2], big + 1)


def test_recycle_pool_keeps_large_host_buffers_up_to_its_limit():
    pool = RecyclePool(limit=3 * RECYCLE_MIN)
    pool.give(torch.zeros(16))  # small: not kept
    assert pool.held == 0 and pool.take(64) is None
    for _ in range(4):
        pool.give(torch.zeros(RECYCLE_MIN, dtype=torch.uint8))
    assert pool.held == 3 * RECYCLE_MIN  # the oldest went
    got = pool.take(RECYCLE_MIN)
    assert got is not None and got.dtype == torch.uint8 and pool.held == 2 * RECYCLE_MIN
    assert pool.take(RECYCLE_MIN + 1) is None


def test_the_frames_are_as_documented():
    """The frames' bytes, spelled out (docs/wire.md): a peer of another build reads them so."""
    frame = request_frame(OP_DROP_SELECT, 5, torch.tensor([7, 8]), (1, 3), None, 2, lease=9)
    assert frame.dtype == torch.int64 and frame.tolist() == [5, 5, 1, 1, 3, 0, -1, 2, 9, 0, 7, 8]
    assert request_frame(OP_LOOKUP, 6, torch.tensor([7]), lease=-3, lease_ms=250).tolist() == \
        [6, 6, 1, 0, -1, 0, -1, 1, -3, 250, 7]
    assert request_frame(4, -1).tolist() == [4, -1, 0, 0, -1, 0, -1, 1, 0, 0]
    assert answer_frame(0, 5).tolist() == [0x4D4B5641, 0, 5]
    assert looked_frame(5, 300, 400).tolist() == [0x4D4B5641, LOOKED, 5, 300, 400]
    assert read_answer(looked_frame(5, 300, 400), (LOOKED,), "x") == (LOOKED, 5, (300, 400))
    with pytest.raises(ValueError, match="400 tokens agree of 300"):
        read_answer(looked_frame(5, 400, 300), (LOOKED,), "x")


# ---------------------------------------------------------------- lookups and leases (find before you claim)
def test_a_lookup_says_how_much_of_the_query_is_held_and_takes_nothing(link):
    producer, consumer = link()
    tokens = torch.arange(100, 140)
    producer.insert(tokens, None, torch.ones(5, 2), None, None)
    assert consumer.lookup(tokens, lease=7, lease_seconds=5) == (40, 40)  # the whole prompt
    assert consumer.lookup(torch.arange(100, 160), lease=8, lease_seconds=5) == (0, 0)  # held under lease 7 now
    got = consumer.drop_select(torch.arange(100, 160), None, lease=7)  # a longer prompt: the entry is its prefix
    assert same(got[2], torch.ones(5, 2)) and len(producer) == 0
    assert consumer.lookup(tokens, lease=9, lease_seconds=5) == (0, 0)  # taken: nothing held
    producer.insert(torch.arange(100, 200), None, torch.ones(3), None, None)
    assert consumer.lookup(tokens, lease=10, lease_seconds=5) == (40, 100)  # the query is a prefix of the entry
    assert producer.stats["lookups"] == 4 and producer.stats["leases"] == 2 and producer.stats["hits"] == 1


def test_a_leased_entry_is_kept_from_other_requests_expiry_and_eviction_until_taken(link):
    """What was found stays found: no other request, no max_age, no eviction takes it while the lease lasts; the
    request under the lease does."""
    producer, consumer = link(thresh=2000, max_age=0.3, evict=True)
    held = torch.arange(10, 20)
    producer.insert(held, None, torch.zeros(100, dtype=torch.float64), None, None)  # 800 bytes + 80 of tokens
    assert consumer.lookup(held, lease=42, lease_seconds=10) == (10, 10)
    assert consumer.drop_select(held, None) == MISSED  # no lease: not for it
    assert consumer.drop_select(held, None, lease=41) == MISSED  # another lease
    time.sleep(0.5)  # past max_age
    producer.insert(torch.arange(30, 40), None, torch.zeros(100, dtype=torch.float64), None, None)  # fits beside
    assert producer.stats["expired"] == 0 and len(producer) == 2
    with pytest.raises(BufferFull, match="held for consumers"):  # room only by evicting the held entry: refused
        producer.insert(torch.arange(50, 60), None, torch.zeros(150, dtype=torch.float64), None, None)
    assert producer.stats["evicted"] == 1  # the unheld one made way first
    got = consumer.drop_select(held, None, lease=42)
    assert same(got[0], held) and len(producer) == 0 and producer.stats["leases_expired"] == 0


def test_a_lease_that_ends_unused_is_counted_and_the_entry_is_open_again(link):
    producer, consumer = link()
    tokens = torch.arange(5, 25)
    producer.insert(tokens, None, torch.ones(4), None, None)
    assert consumer.lookup(tokens, lease=1, lease_seconds=0.2) == (20, 20)
    assert consumer.drop_select(tokens, None) == MISSED
    time.sleep(0.4)
    got = consumer.drop_select(tokens, None)  # the lease ended: anyone's again
    assert same(got[0], tokens) and producer.stats["leases_expired"] == 1


def test_a_released_lease_frees_its_entry_at_once(link):
    producer, consumer = link()
    tokens = torch.arange(5, 25)
    producer.insert(tokens, None, torch.ones(4), None, None)
    assert consumer.lookup(tokens, lease=3, lease_seconds=60) == (20, 20)
    assert consumer.drop_select(tokens, None) == MISSED
    consumer.release(3)
    got = consumer.drop_select(tokens, None)  # the lease's release came before it on the same link
    assert same(got[0], tokens) and producer.stats["leases_released"] == 1 and producer.stats["leases_expired"] == 0


def test_a_load_under_a_lease_takes_the_entry_its_lookup_found(link):
    """Even when a better match for its query came in between (here a shorter entry that is a prefix of the query,
    which the index ranks above a longer entry the query is a prefix of)."""
    producer, consumer = link()
    producer.insert(torch.arange(80), None, torch.full((5,), 80.0), None, None)
    assert consumer.lookup(torch.arange(64), lease=7, lease_seconds=60) == (64, 80)
    producer.insert(torch.arange(16), None, torch.full((1,), 16.0), None, None)
    got = consumer.drop_select(torch.arange(64), None, lease=7)
    assert same(got[2], torch.full((5,), 80.0))


def test_an_evicting_insert_overcommits_for_entries_being_sent_not_for_leases(link):
    """Room taken by entries being sent is overcommitted as before (they leave in a moment); only room a lease holds
    refuses a save."""
    producer, consumer = link(thresh=2000, evict=True)
    small = torch.arange(1, 3)
    producer.insert(small, None, torch.zeros(10, dtype=torch.float64), None, None)  # 96 bytes
    assert consumer.lookup(small, lease=9, lease_seconds=60) == (2, 2)
    with producer.producer._cv:
        producer.producer.buffer_size += 1800  # as if 1800 bytes were being sent (no index entry holds them)
    producer.insert(torch.arange(10, 20), None, torch.zeros(100, dtype=torch.float64), None, None)  # 880: no refusal
    assert len(producer) == 2
    with pytest.raises(BufferFull):  # 96 + 880 bytes held by leases, plus 1120 new: 2096 > 2000
        assert consumer.lookup(torch.arange(10, 20), lease=10, lease_seconds=60) == (10, 10)
        producer.insert(torch.arange(30, 40), None, torch.zeros(130, dtype=torch.float64), None, None)


def test_shares_of_a_leased_entry_go_to_requests_under_its_lease(link):
    """TP: every consumer rank takes its part of one entry under the lease its instance's lookup got."""
    producer, consumer = link()
    tokens = torch.arange(64)
    producer.insert(tokens, None, torch.arange(24.0).view(2, 3, 4), None, None)
    assert consumer.lookup(tokens, lease=5, lease_seconds=5) == (64, 64)
    assert consumer.lookup(tokens, lease=5, lease_seconds=5) == (64, 64)  # the other rank, the same lease
    first = consumer.drop_select(tokens, None, key_part=(0, 2), shares=2, lease=5)
    second = consumer.drop_select(tokens, None, key_part=(2, 4), shares=2, lease=5)
    assert first[2].shape == (2, 3, 2) and second[2].shape == (2, 3, 2) and len(producer) == 0


def test_lookup_arguments_are_checked_before_anything_is_sent(link):
    _, consumer = link()
    for kwargs, what in (({"lease": 0, "lease_seconds": 1}, "non-zero lease"),
                         ({"lease": 1, "lease_seconds": 0}, "lease_seconds"),
                         ({"lease": 1, "lease_seconds": 601}, "lease_seconds"),
                         ({"lease": 1 << 70, "lease_seconds": 1}, "int64")):
        with pytest.raises(ValueError, match=what):
            consumer.lookup(torch.tensor([1, 2]), **kwargs)
    with pytest.raises(ValueError, match="at least one token"):
        consumer.lookup(torch.tensor([], dtype=torch.int64), lease=1, lease_seconds=1)


def test_malformed_lookup_answers_are_refused():
    """A producer of another version (a MISS to a lookup) or one claiming more tokens agree than were asked: the
    lookup raises (its caller computes the prompt), and the link goes on serving."""
    a, b = local_pipe_pair(timeout=5.0)
    consumer = SimpleBuffer(b, b, 1 << 30, role="consumer")
    try:
        for answer, what in ((lambda seq: answer_frame(MISS, seq), "another version"),
                             (lambda seq: looked_frame(seq, 3, 3), "says 3 agree")):
            result: list = []

            def ask(result: list = result) -> None:
                try:
                    consumer.lookup(torch.tensor([1, 2]), lease=4, lease_seconds=1)
                except ValueError as e:
                    result.append(str(e))

            thread = threading.Thread(target=ask)
            thread.start()
            seq = a.recv_tensor(timeout=5).tolist()[1]
            a.send_tensor(answer(seq))
            thread.join(5)
            assert len(result) == 1 and what in result[0], result
        assert consumer.healthy
    finally:
        consumer.close()


def test_a_lookup_nobody_answers_times_out():
    a, b = local_pipe_pair(timeout=5.0)
    consumer = SimpleBuffer(b, b, 1 << 30, role="consumer")
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            consumer.lookup(torch.tensor([1, 2]), lease=3, lease_seconds=1, timeout=0.3)
        assert time.monotonic() - start < 2
    finally:
        consumer.close()


def test_device_tensors_are_inserted_and_selected_exactly(device):
    """Entries of ``device`` tensors, kept as copies (the caller may reuse its own) or handed over, come back bit for
    bit, rows and parts of the key as asked."""
    a, b = local_pipe_pair(timeout=5.0, device=device)
    producer = SimpleBuffer(a, a, 1 << 24, timeout=5.0, role="producer")
    consumer = SimpleBuffer(b, b, 1 << 30, timeout=5.0, role="consumer")
    try:
        key = torch.randn(6, 2, 4, 8).to(torch.bfloat16).to(device)
        value = torch.randn(6, 3, device=device)
        producer.insert(torch.tensor([1, 2, 3]), None, key, value, None)
        producer.insert(torch.tensor([4, 5]), None, key.clone(), None, None, copy=False)
        key_kept = key.clone()
        key.zero_()  # the buffer holds its own copy
        got = consumer.drop_select(torch.tensor([1, 2, 3]), None)
        assert same(got[2].cpu(), key_kept.cpu()) and same(got[3].cpu(), value.cpu())
        rows = consumer.drop_select(torch.tensor([4, 5]), None, key_rows=(2, 5), key_part=(1, 2))
        assert same(rows[2].cpu(), key_kept[2:5, :, 1:2].cpu())
    finally:
        consumer.close()
        producer.close()


def test_an_entry_still_being_filled_is_served_once_ready(link):
    """``insert(ready=...)``: the tensors are handed over while an asynchronous copy still fills them (a device's
    blocks on their way to pinned memory); a request for the entry is answered only after ``ready()`` returned."""
    producer, consumer = link()
    filled = threading.Event()
    key = torch.zeros(4, 8)

    def ready():
        filled.wait(5)

    producer.insert(torch.tensor([7, 8, 9]), None, key, None, None, ready=ready)
    answers = []
    asking = threading.Thread(target=lambda: answers.append(consumer.drop_select(torch.tensor([7, 8, 9]), None)))
    asking.start()
    time.sleep(0.2)
    assert not answers, "answered before the entry was ready"
    key.fill_(3.0)  # the copy lands, then says so
    filled.set()
    asking.join(5)
    assert answers and torch.equal(answers[0][2], torch.full((4, 8), 3.0))


def test_make_room_drops_the_oldest_unleased_entries_adding_up_to_what_is_asked(link):
    """Where the entries live in memory of their own (a GPU cache's pinned arena), a save that finds no room there
    asks the buffer to let the oldest entries go first; a leased one stays."""
    producer, consumer = link(thresh=1 << 20, evict=True)
    for i in range(4):
        producer.insert(torch.arange(i * 10, i * 10 + 10), None, torch.zeros(100, dtype=torch.float64), None, None)
    assert consumer.lookup(torch.arange(0, 10), lease=3, lease_seconds=60) == (10, 10)  # the oldest, leased
    assert producer.make_room(900)  # two entries of 880 bytes: the 2nd and 3rd oldest
    assert len(producer) == 2 and producer.stats["evicted"] == 2
    assert same(consumer.drop_select(torch.arange(0, 10), None, lease=3)[0], torch.arange(0, 10))
    assert same(consumer.drop_select(torch.arange(30, 40), None)[0], torch.arange(30, 40))
    assert not producer.make_room(1)  # nothing left
    assert not link(evict=False)[0].make_room(1)  # a buffer that never evicts lets nothing go
