"""SimpleBuffer between two real processes over the real MooncakePipe: the producer is a child, the test the consumer."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from harness.pipes import make_config, open_pipe
from harness.ports import free_port
from kv_lookup_buffer import BufferClosed, SimpleBuffer
from kv_lookup_buffer.simple_wire import ANSWER_MAGIC, OP_DROP_SELECT
from kv_pipe import PipeError
from tests.kv_lookup_buffer import programs
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer, same

pytestmark = pytest.mark.pipes

ctx = peers.ctx()


@pytest.fixture
def cfg():
    return make_config()


def consumer(cfg):
    pipe = open_pipe(cfg, 1)
    return pipe, SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")


def settle(buf: SimpleBuffer) -> None:
    """A request that misses: answered only after the producer finished accounting for every earlier answer."""
    assert buf.drop_select(torch.tensor([-7, -7]), None) == [None] * 5


def test_exact_round_trip(cfg):
    done = ctx.Event()
    full = ctx.Event()
    producer = Peer(programs.produce, cfg, "basic", 1 << 20, done, None, full)
    assert full.wait(60)  # every entry is in: a query cannot race its insert
    pipe, buf = consumer(cfg)
    with pipe:
        got = buf.drop_select(torch.tensor([1, 2, 3]), None)
        settle(buf)
        done.set()
        left = producer.result()
    tokens, roi, key, value, hidden = programs.basic_entries()[0]
    assert same(got[0], tokens) and got[1] is None and same(got[2], key) and same(got[3], value) and got[4] is None
    assert left["entries"] == 0 and left["bytes"] == 0
    assert {k: left["stats"][k] for k in ("hits", "misses", "malformed", "expired", "evicted")} == {
        "hits": 1, "misses": 1, "malformed": 0, "expired": 0, "evicted": 0}


def test_key_out_receives_the_key_in_place(cfg):
    done = ctx.Event()
    full = ctx.Event()
    producer = Peer(programs.produce, cfg, "large", 1 << 30, done, None, full)
    assert full.wait(60)  # every entry is in: a query cannot race its insert
    pipe, buf = consumer(cfg)
    expected = programs.large_entries()
    with pipe:
        room = torch.empty(16 << 20, dtype=torch.uint8)
        got = buf.drop_select(torch.tensor([7, 8, 0]), None, key_out=room)
        assert same(got[2], expected[0][2]) and got[2].data_ptr() == room.data_ptr()  # a view of key_out
        small = torch.empty(1 << 20, dtype=torch.uint8)  # too small: the key gets memory of its own
        got = buf.drop_select(torch.tensor([7, 8, 1]), None, key_out=small)
        assert same(got[2], expected[1][2]) and got[2].data_ptr() != small.data_ptr()
        assert same(got[3], expected[1][3])
        settle(buf)
        done.set()
        left = producer.result()
    assert left["entries"] == 0 and left["stats"]["hits"] == 2


def test_insert_copies_unless_told_not_to(cfg):
    done = ctx.Event()
    producer = Peer(programs.insert_then_overwrite, cfg, done)
    pipe, buf = consumer(cfg)
    with pipe:
        def take(tokens: list[int]) -> list:
            deadline = time.monotonic() + 60
            while (got := buf.drop_select(torch.tensor(tokens), None))[2] is None and time.monotonic() < deadline:
                time.sleep(0.05)  # not inserted yet
            return got
        got_a, got_b = take([1, 2]), take([3, 4])
        done.set()
        producer.result()
    assert torch.equal(got_a[2], torch.arange(12.0)), "the entry changed when the caller reused its tensor"
    assert torch.equal(got_b[2], torch.arange(12.0) * 2)


@contextlib.contextmanager
def prefix_producer(cfg) -> Iterator[tuple[SimpleBuffer, list[dict]]]:
    """A producer child holding the four prefix entries, and our consumer buffer; on exit the producer's report
    (what it still holds) is appended to the yielded list."""
    done, full = ctx.Event(), ctx.Event()
    producer = Peer(programs.produce, cfg, "prefix", 1 << 20, done, None, full)
    pipe, buf = consumer(cfg)
    report: list[dict] = []
    with pipe:
        assert full.wait(60)
        yield buf, report
        settle(buf)
        done.set()
        report.append(producer.result())


def test_prefix_and_roi_matching(cfg):
    entries = programs.prefix_entries()
    with prefix_producer(cfg) as (buf, report):
        shorter = buf.drop_select(torch.tensor([1, 2]), None)
        longer = buf.drop_select(torch.tensor([10, 11, 12, 13, 14]), None)
        masked = buf.drop_select(torch.tensor([20, 55, 21, 66]), torch.tensor([True, False, True, False]))
        float_roi = buf.drop_select(torch.tensor([30, 31, 32, 7]), torch.tensor([1.0, 1.0, 1.0, 0.0]))
        differs = buf.drop_select(torch.tensor([1, 2, 5]), None)
        taken = buf.drop_select(torch.tensor([1, 2, 3, 4]), None)
        empty = buf.drop_select(None, None)
    left = report[0]
    assert all(same(a, b) for a, b in zip(shorter, entries[0], strict=True))
    assert all(same(a, b) for a, b in zip(longer, entries[1], strict=True))
    assert all(same(a, b) for a, b in zip(masked, entries[2], strict=True))
    assert all(same(a, b) for a, b in zip(float_roi, entries[3], strict=True))
    assert differs == [None] * 5 and taken == [None] * 5 and empty == [None] * 5
    assert left["entries"] == 0 and left["stats"]["hits"] == 4 and left["stats"]["misses"] == 3 + 1


def test_drop_select_none_takes_the_oldest(cfg):
    entries = programs.prefix_entries()
    with prefix_producer(cfg) as (buf, _):
        got = [buf.drop_select(None, None) for _ in range(5)]
    for i in range(4):
        assert all(same(a, b) for a, b in zip(got[i], entries[i], strict=True))
    assert got[4] == [None] * 5


def test_stress_200_requests_with_a_100_entry_buffer(cfg):
    done, full = ctx.Event(), ctx.Event()
    thresh = 100 * programs.STRESS_ENTRY_BYTES
    producer = Peer(programs.produce, cfg, "stress", thresh, done, 0, full)
    queries = programs.shuffled(programs.stress_entries(), seed=1)
    pipe, buf = consumer(cfg)
    misses = 0
    with pipe:
        assert full.wait(60), "the producer did not fill its buffer"
        for entry in queries:
            got = buf.drop_select(entry[0], entry[1])
            if got[0] is None:
                assert got == [None] * 5
                misses += 1
            else:
                assert all(same(a, b) for a, b in zip(got, entry, strict=True))
        settle(buf)
        done.set()
        left = producer.result(timeout=120)
    assert 0 < misses < 100  # some entries were not inserted yet when asked for: they stay with the producer
    assert left["entries"] == misses
    assert left["bytes"] == misses * programs.STRESS_ENTRY_BYTES
    assert left["stats"]["hits"] == 200 - misses


def test_concurrent_consumers_get_their_own_entries(cfg):
    done, full, all_in = ctx.Event(), ctx.Event(), ctx.Event()
    producer = Peer(programs.produce, cfg, "stress", 1 << 30, done, None, full, 120.0, None, all_in)
    entries = programs.stress_entries()
    pipe, buf = consumer(cfg)
    errors: list[str] = []

    def worker(k: int) -> None:
        for entry in entries[k::4][:25]:
            got = buf.drop_select(entry[0], entry[1])
            if not all(same(a, b) for a, b in zip(got, entry, strict=True)):
                errors.append(f"thread {k}: wrong or missing entry")

    with pipe:
        assert all_in.wait(60)  # all 200 are in (the buffer has room for all)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        settle(buf)
        done.set()
        left = producer.result()
    assert not errors
    assert left["entries"] == 100 and left["stats"]["hits"] == 100


def test_consumer_close_unblocks_a_blocked_insert(cfg):
    blocking = ctx.Event()
    producer = Peer(programs.blocked_insert, cfg, programs.STRESS_ENTRY_BYTES, 60.0, blocking)
    pipe, buf = consumer(cfg)
    with pipe:
        assert blocking.wait(120), "the producer never inserted its first entry"
        time.sleep(1.0)  # its second insert is waiting for room (a loaded machine may start a peer slowly)
        buf.close()
        result = producer.result()
    assert result["outcome"].startswith("BufferClosed: the consumer closed the buffer")
    assert result["after"] < 10.0


def test_producer_close_unblocks_a_blocked_drop_select(cfg):
    told = ctx.Event()
    producer = Peer(programs.close_later, cfg, 3.0, told)
    pipe, buf = consumer(cfg)
    with pipe:
        start = time.monotonic()
        try:
            with pytest.raises(BufferClosed, match="the producer closed the buffer"):
                buf.drop_select(torch.tensor([1, 2, 3]), None)
        finally:
            told.set()
        assert time.monotonic() - start < 10.0
        producer.result()


def test_insert_times_out_with_a_clear_error(cfg):
    sink = Peer(peers.sink, cfg, 1, 30)  # a consumer that never asks
    result = programs.blocked_insert(cfg, programs.STRESS_ENTRY_BYTES, 1.5)
    sink.kill()
    assert result["outcome"].startswith("TimeoutError: the buffer stayed full")
    assert 1.4 < result["after"] < 5.0


def test_entry_larger_than_the_buffer_is_refused_at_once(cfg):
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1000)
        with pytest.raises(ValueError, match="can never fit"):
            buf.insert(torch.arange(10), None, torch.zeros(1000), None, None)
        with pytest.raises(ValueError, match="1-D integer tensor"):
            buf.insert(torch.zeros(3), None, None, None, None)
        assert len(buf) == 0 and buf.buffer_size == 0


def test_malformed_requests_do_not_kill_the_producer(cfg):
    done = ctx.Event()
    full = ctx.Event()
    producer = Peer(programs.produce, cfg, "basic", 1 << 20, done, None, full)
    assert full.wait(60)  # every entry is in: a query cannot race its insert
    pipe, buf = consumer(cfg)
    with pipe:
        pipe.send_tensor(torch.tensor([3.0, 1.0, 0.0]))  # wrong dtype: skipped
        pipe.send_tensor(torch.tensor([9, 8, 1], dtype=torch.int64))  # unknown op: skipped
        pipe.send_tensor(torch.tensor([1, 8], dtype=torch.int64))  # too short to be a request: skipped
        pipe.send_tensor(None)  # not a request at all: skipped
        # [op, seq, kind, row_start, row_stop, part_start, part_stop, shares, lease, lease_ms, *tokens]
        op = OP_DROP_SELECT
        pipe.send_tensor(torch.tensor([op, 7, 5, 0, -1, 0, -1, 1, 0, 0, 1, 2], dtype=torch.int64))  # unknown kind
        pipe.send_tensor(torch.tensor([op, 8, 0, 0, -1, 0, -1, 1, 0, 0, 1, 2, 3], dtype=torch.int64))  # "take any" with tokens
        pipe.send_tensor(torch.tensor([op, 9, 1, 5, 2, 0, -1, 1, 0, 0, 1, 2, 3], dtype=torch.int64))  # rows [5, 2)
        pipe.send_tensor(torch.tensor([op, 10, 1, 0, -1, 3, 1, 1, 0, 0, 1, 2, 3], dtype=torch.int64))  # part [3, 1)
        pipe.send_tensor(torch.tensor([op, 11, 1, 0, -1, 0, -1, 0, 0, 0, 1, 2, 3], dtype=torch.int64))  # 0 shares
        pipe.send_tensor(torch.tensor([op, 12, 1, 0, -1, 0, -1, 1 << 40, 0, 0, 1, 2, 3], dtype=torch.int64))  # 2**40 shares
        pipe.send_tensor(torch.tensor([3, 13, 1, 0, -1, 0, -1, 1, 1, 2, 3], dtype=torch.int64))  # an older version's request
        for seq in range(7, 14):
            assert pipe.recv_tensor().tolist() == [ANSWER_MAGIC, 1, seq]  # MISS for each
        got = buf.drop_select(torch.tensor([1, 2, 3]), None)
        settle(buf)
        done.set()
        left = producer.result()
    assert got[0] is not None and same(got[2], programs.basic_entries()[0][2])
    assert left["stats"]["malformed"] == 11 and left["stats"]["hits"] == 1 and left["stats"]["misses"] == 1  # settle()'s


def test_key_part_and_shares_let_two_ranks_each_take_their_heads(cfg):
    """Two requests with shares=2 (the two TP ranks of a consumer) each take a range of the key's third dimension
    (their KV heads) of one entry; it leaves the buffer with the second."""
    done, full = ctx.Event(), ctx.Event()
    producer = Peer(programs.produce, cfg, "parts", 1 << 20, done, None, full)
    key = programs.parts_entries()[0][2]
    pipe, buf = consumer(cfg)
    with pipe:
        assert full.wait(60)
        query = torch.tensor([50, 51, 52])
        first = buf.drop_select(query, None, key_rows=(1, 3), key_part=(2, 4), shares=2)
        second = buf.drop_select(query, None, key_part=(0, 2), shares=2)
        third = buf.drop_select(query, None)
        with pytest.raises(ValueError, match="shares"):
            buf.drop_select(query, None, shares=0)
        done.set()
        left = producer.result()
    assert same(first[2], key[1:3, :, 2:4].contiguous()) and first[2].is_contiguous() and same(first[3], torch.tensor([9]))
    assert same(second[2], key[:, :, 0:2].contiguous())
    assert third == [None] * 5
    assert left["stats"]["hits"] == 2 and left["stats"]["misses"] == 1


def test_key_rows_sends_only_those_rows(cfg):
    done, full = ctx.Event(), ctx.Event()
    producer = Peer(programs.produce, cfg, "rows", 1 << 30, done, None, full)
    entries = programs.rows_entries()
    pipe, buf = consumer(cfg)
    with pipe:
        assert full.wait(60)
        small = buf.drop_select(torch.tensor([40, 41, 0]), None, key_rows=(2, 4))
        room = torch.empty(16 << 20, dtype=torch.uint8)
        large = buf.drop_select(torch.tensor([40, 41, 1]), None, key_rows=(3, 99), key_out=room)  # clamped to 6
        settle(buf)
        done.set()
        left = producer.result()
    assert same(small[2], entries[0][2][2:4]) and same(small[0], entries[0][0]) and same(small[3], entries[0][3])
    assert same(large[2], entries[1][2][3:]) and large[2].data_ptr() == room.data_ptr()
    rows_bytes = (2 * 8 + 3 * (1 << 19)) * 4
    assert left["stats"]["hits"] == 2 and left["stats"]["hit_bytes"] == rows_bytes + 2 * (3 * 8 + 8)


def test_entries_older_than_max_age_expire(cfg):
    done, full = ctx.Event(), ctx.Event()
    producer = Peer(programs.produce, cfg, "prefix", 1 << 20, done, None, full, 120.0, {"max_age": 1.0})
    pipe, buf = consumer(cfg)
    with pipe:
        assert full.wait(60)
        time.sleep(2.0)  # the serving thread expires them on its own, without a request
        assert buf.drop_select(None, None) == [None] * 5
        done.set()
        left = producer.result()
    assert left["entries"] == 0 and left["bytes"] == 0 and left["stats"]["expired"] == 4


def test_evict_makes_room_without_waiting(cfg):
    """A buffer with room for 100 of 200 entries and no consumer asking: every insert returns at once, and the
    oldest entries make room (the newest are the likeliest to be asked for)."""
    done, full, all_in = ctx.Event(), ctx.Event(), ctx.Event()
    thresh = 100 * programs.STRESS_ENTRY_BYTES
    producer = Peer(programs.produce, cfg, "stress", thresh, done, None, full, 120.0, {"evict": True}, all_in)
    entries = programs.stress_entries()
    pipe, buf = consumer(cfg)
    with pipe:
        assert all_in.wait(60)  # all 200 inserted
        newest, oldest = buf.drop_select(*entries[-1][:2]), buf.drop_select(*entries[0][:2])
        settle(buf)
        done.set()
        left = producer.result()
    assert all(same(a, b) for a, b in zip(newest, entries[-1], strict=True)) and oldest == [None] * 5
    assert left["stats"]["evicted"] == 100 and left["entries"] == 99
    assert left["insert_seconds"] < cfg["timeout"] / 2  # none waited for room (that wait ends at the timeout)


def test_a_request_that_times_out_does_not_disturb_later_ones(cfg):
    """drop_select's own timeout: the late answer is recognised and dropped; the next request gets its own entry.
    The producer answers every request after 0.3 s (an answer that has begun to arrive is waited for, by design:
    with a prompt producer a short timeout races it)."""
    done, full = ctx.Event(), ctx.Event()
    producer = Peer(programs.produce, cfg, "large", 1 << 30, done, None, full, 120.0, None, None, 0.3)
    entries = programs.large_entries()
    pipe, buf = consumer(cfg)
    with pipe:
        assert full.wait(60)
        assert buf.drop_select(torch.tensor([1, 2, 3]), None) == [None] * 5  # the links up: the next send is quick
        with pytest.raises(TimeoutError, match="no answer to drop_select request"):
            buf.drop_select(entries[0][0], None, timeout=0.05)
        got = buf.drop_select(entries[1][0], None)
        settle(buf)
        done.set()
        producer.result()
    assert same(got[2], entries[1][2])
    assert buf.stats["late_hits_dropped"] == 1


def test_a_producer_stalled_mid_answer_fails_the_request_and_the_link_recovers():
    """The producer sends the first tensor of an answer and stalls: drop_select fails after the pipe's timeout (it
    does not wait forever) and the connection is dropped. Once the producer sends again it reconnects; what it still
    sends of the broken answer is skipped (it starts no answer), and the next request is answered in full."""
    cfg = make_config(timeout=2.0)
    ready, done = ctx.Event(), ctx.Event()
    producer = Peer(programs.stall_mid_answer, cfg, 4.0, ready, done)
    entry = programs.basic_entries()[0]
    pipe, buf = consumer(cfg)
    with pipe:
        start = time.monotonic()
        with pytest.raises(PipeError, match="the answer to drop_select request 1 broke off"):
            buf.drop_select(entry[0], None, timeout=30)
        assert time.monotonic() - start < 15.0  # the pipe's timeout ended it, not drop_select's 30 s
        assert ready.wait(30)
        got = buf.drop_select(entry[0], None, timeout=30)
        assert same(got[0], entry[0]) and same(got[2], entry[2])
        done.set()
        producer.result()
    # what the producer sent of the stalled answer after the drop (if anything) arrived as frames that start no answer
    print("stray frames skipped:", buf.stats["stray_frames"])


# ----------------------------------------------------------------------------- hardening finding 4: dead threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # SystemExit, on purpose
def test_a_dead_receiving_thread_fails_requests_at_once_and_a_new_buffer_is_served(cfg, monkeypatch):
    """Hardening finding 4: no thread dies silently. The consumer's receiving thread catches every error of an
    answer, so only something like SystemExit ends it (injected here): the request in flight and every later one
    fail at once with a clear error instead of waiting for their timeout, ``healthy`` says so, and a new buffer on
    the same link is served (what was left of the broken answer is skipped)."""
    done = ctx.Event()
    full = ctx.Event()
    producer = Peer(programs.produce, cfg, "prefix", 1 << 20, done, None, full)
    assert full.wait(60)  # every entry is in: a query cannot race its insert
    entries = programs.prefix_entries()
    pipe, buf = consumer(cfg)
    with pipe:
        def dies(key_out: object) -> list:
            raise SystemExit("test: the receiving thread ends")

        monkeypatch.setattr(buf.consumer, "_receive_entry", dies)
        start = time.monotonic()
        with pytest.raises(BufferClosed, match="receiving thread died"):
            buf.drop_select(entries[0][0], None, timeout=30)
        assert time.monotonic() - start < 5.0 and not buf.healthy
        with pytest.raises(BufferClosed, match="receiving thread died"):
            buf.drop_select(entries[1][0], None, timeout=30)
        fresh = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
        got = fresh.drop_select(entries[1][0], None, timeout=30)
        assert same(got[2], entries[1][2]) and fresh.healthy
        settle(fresh)
        done.set()
        left = producer.result()
    assert left["entries"] == 2  # the two not asked for (the first left with the broken answer)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # SystemExit, on purpose
def test_a_dead_serving_thread_closes_its_link_and_the_consumer_is_told_at_once(cfg, monkeypatch):
    """Hardening finding 4, producer side: if the thread serving a link ever ends (SystemExit injected while it
    answers), the link is closed, so the consumer's request fails at once rather than after its 30 s timeout; the
    buffer says it is unhealthy and refuses inserts with a clear error."""
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1 << 20)

        def dies(frame: object, data_pipe: object) -> None:
            raise SystemExit("test: the serving thread ends")

        monkeypatch.setattr(buf.producer, "_handle", dies)
        buf.insert(*programs.basic_entries()[0])
        asking = Peer(programs.ask, cfg, [[1, 2, 3]], 30.0)
        [(what, seconds)] = asking.result()
        assert what.startswith(("PeerDisconnected", "BufferClosed", "PipeClosed")) and seconds < 10.0, (what, seconds)
        assert not buf.healthy and pipe.closed
        with pytest.raises(BufferClosed, match="serving thread died"):
            buf.insert(*programs.basic_entries()[0])


def test_a_consumer_killed_mid_answer_leaves_the_entry_and_the_producer_serving(cfg):
    """Fault: a consumer asks for a 12 MiB entry and is killed while the producer sends it (into the consumer's ring:
    the answer is gone with it). The producer frees that entry (or keeps it, had the send failed) and keeps serving:
    another consumer gets that entry exactly or a miss, never wrong bytes, and the other entry exactly; nothing is
    left in the producer's buffer at the end."""
    producer_at, hanger_at, consumer_at = (f"127.0.0.1:{free_port()}" for _ in range(3))
    done, ready, asked = ctx.Event(), ctx.Event(), ctx.Event()
    producer = Peer(programs.produce_for_links, cfg, producer_at, "large", done, ready)
    assert ready.wait(60)
    hanger = Peer(programs.request_then_hang, cfg, hanger_at, producer_at, "large", asked)
    assert asked.wait(60)
    time.sleep(1.0)  # the producer is sending the answer, which nobody reads
    hanger.kill()
    entries = programs.large_entries()
    with peers.open_endpoint(cfg, 1, consumer_at) as endpoint:
        pipe = endpoint.link(producer_at, "kv")
        buf = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
        first = buf.drop_select(entries[0][0], None, timeout=30)
        assert first == [None] * 5 or (same(first[2], entries[0][2]) and same(first[3], entries[0][3]))
        second = buf.drop_select(entries[1][0], None, timeout=30)
        assert same(second[2], entries[1][2]) and same(second[3], entries[1][3])
        buf.close()
    done.set()
    left = producer.result()
    assert left["entries"] == 0, left


def test_producers_serve_many_consumers_each_on_its_own_link(cfg):
    """XpYd at the buffer layer: 2 producer processes, 3 consumer processes each linked to both, two threads each.
    Every entry is taken once, by the consumer that asked, bit-exact; an entry two consumers ask for goes to one of
    them (the other misses); nothing is lost or mixed up between links."""
    servers = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    done, ready = ctx.Event(), [ctx.Event(), ctx.Event()]
    producers = [Peer(programs.produce_for_links, cfg, s, "stress", done, r) for s, r in zip(servers, ready, strict=True)]
    assert all(r.wait(60) for r in ready)
    # consumer c takes entries c, c+3, ... (< 60) from producer 0 and the same from producer 1; all three also ask
    # producer 1 for entry 199
    wanted = [[(p, i) for i in range(c, 60, 3) for p in (0, 1)] + [(1, 199)] for c in range(3)]
    consumers = [Peer(programs.consume_from, cfg, f"127.0.0.1:{free_port()}", servers, "stress", w)
                 for w in wanted]
    counts = [c.result() for c in consumers]
    done.set()
    left = [p.result() for p in producers]
    assert sum(c["wrong"] for c in counts) == 0
    assert sum(c["hits"] for c in counts) == 120 + 1 and sum(c["misses"] for c in counts) == 2
    assert [x["stats"]["hits"] for x in left] == [60, 61]
    assert [x["entries"] for x in left] == [140, 139]


def long_producer(pipe) -> SimpleBuffer:
    buf = SimpleBuffer(pipe, pipe, 1 << 30)
    buf.insert(*programs.long_entry())
    return buf


def test_a_long_query_whose_bytes_come_late_is_answered(cfg):
    """Issue #24: a drop_select of 12k tokens (more than inline_max: its bytes follow the request's header) whose
    bytes come 0.7 s after that header, longer than the serving thread's poll: the producer (this process) waits
    for them and answers a hit with the right entry."""
    with open_pipe(cfg, 0) as pipe:
        buf = long_producer(pipe)
        what, took = Peer(programs.ask_long, cfg, 0.7).result()
        assert what == "hit" and took > 0.7, (what, took)
        assert buf.stats["hits"] == 1 and buf.stats["requests_lost"] == 0 and len(buf) == 0
        buf.close()


def test_a_request_that_breaks_off_is_counted_and_serving_goes_on(caplog):
    """A consumer freezes after the header of a long request (then it is killed): after the pipe's timeout the
    producer logs a WARNING, counts the request as lost, and serves the next consumer's request (a hit)."""
    cfg = make_config(timeout=1.5)
    with open_pipe(cfg, 0) as pipe:
        buf = long_producer(pipe)
        frozen = ctx.Event()
        stuck = Peer(programs.ask_long, cfg, 600.0, frozen)
        try:
            assert frozen.wait(60)
            deadline = time.monotonic() + 10
            while buf.stats["requests_lost"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert buf.stats["requests_lost"] == 1 and len(buf) == 1
        finally:
            stuck.kill()
        assert any(r.levelname == "WARNING" and "broke off" in r.getMessage() for r in caplog.records), caplog.text
        what, _ = Peer(programs.ask_long, cfg, 0.0).result()
        assert what == "hit" and buf.stats["hits"] == 1 and buf.stats["requests_lost"] == 1
        buf.close()


def test_an_answer_whose_bytes_come_late_reaches_the_consumer():
    """The consumer's side of issue #24: with inline_max 0 the answer's header itself goes through the ring, and its
    bytes come 0.7 s after it, longer than the receiving thread's poll: the consumer (this process) still gets the
    hit."""
    cfg = make_config(inline_max=0)
    done = ctx.Event()
    producer = Peer(programs.produce_slowly, cfg, 0.7, done)
    pipe, buf = consumer(cfg)
    with pipe:
        entry = programs.long_entry()
        deadline = time.monotonic() + 60
        while (got := buf.drop_select(entry[0], None))[2] is None and time.monotonic() < deadline:
            time.sleep(0.05)  # not inserted yet
        assert all(same(a, b) for a, b in zip(got, entry, strict=True))
        assert buf.stats["answers_lost"] == 0
        done.set()
        stats = producer.result()
        buf.close()
    assert stats["hits"] == 1 and stats["requests_lost"] == 0
