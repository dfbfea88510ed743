"""The consumer's loads in flight (``Loads``) with a stand-in for the transfer: whatever a load does, it ends as done
or failed for vLLM, never raises, and is counted in the stats; its deadline runs from the claim."""

from __future__ import annotations

import threading
import time

import pytest

from kv_connector.cache.layout import LayoutMismatch
from kv_connector.metadata import LoadRequest
from kv_connector.source import LoadSource
from kv_connector.stats import StatsRecorder
from kv_connector.worker.loads import Loads
from kv_connector.worker.transfer import KVMiss, LoadResult
from kv_lookup_buffer import BufferClosed
from kv_pipe import PipeError

CONFIGURED = LoadSource(["127.0.0.1:1"], from_params=False, same_tp=True)
NAMED = LoadSource(["127.0.0.1:2"], from_params=True, same_tp=True)


def load_request(req_id: str, nblocks: int = 3, source: LoadSource = CONFIGURED) -> LoadRequest:
    return LoadRequest(req_id, list(range(nblocks * 16)), 0, list(range(10, 10 + nblocks)), nblocks * 16 - 1, source)


def result(written: int, source: str = "pulled") -> LoadResult:
    return LoadResult(written, written * 100, written * 100 if source == "pulled" else 0, source, "")


def finish(loads: Loads, n: int, timeout: float = 5.0):
    """Collect until ``n`` loads have finished."""
    done, failed, bad = set(), set(), set()
    deadline = time.monotonic() + timeout
    while len(done) < n and time.monotonic() < deadline:
        out = loads.collect(0.05)
        done |= out.done
        failed |= out.failed
        bad |= out.bad_blocks
    assert len(done) == n, f"only {done} finished"
    return done, failed, bad


def run(outcome, *requests: LoadRequest, timeout: float = 5.0, concurrency: int = 2):
    """Run ``requests`` through a Loads whose transfer does ``outcome(req, deadline)``; the stats and what finished."""
    stats = StatsRecorder()
    loads = Loads(outcome, concurrency, timeout, stats)
    try:
        for req in requests:
            loads.start(req)
        finished = finish(loads, len(requests), timeout + 5)
    finally:
        loads.close()
    taken = stats.take()
    return (taken.data if taken is not None else {}), finished


def test_a_load_that_writes_every_block_is_done_and_counted():
    data, (done, failed, bad) = run(lambda req, deadline: result(3), load_request("a"))
    assert (done, failed, bad) == ({"a"}, set(), set())
    assert data["loaded"] == 1 and data["loaded_bytes"] == 300 and data["fetched_bytes"] == 300
    assert data["param_loads"] == 0 and data["partial_loads"] == 0
    assert len(data["loads"]) == 1 and data["loads"][0][:2] == [47, 300]
    assert data["loads_in_flight"] == 0


def test_a_load_from_the_params_producer_is_counted_as_such():
    data, _ = run(lambda req, deadline: result(3), load_request("a", source=NAMED))
    assert data["param_loads"] == 1


def test_a_pushed_load_is_sampled_apart():
    data, _ = run(lambda req, deadline: result(3, "pushed"), load_request("a"))
    assert len(data["push_loads"]) == 1 and data["loads"] == [] and data["fetched_bytes"] == 0


def test_a_partial_load_reports_the_blocks_it_did_not_write():
    data, (done, failed, bad) = run(lambda req, deadline: result(1), load_request("a"))
    assert (done, failed, bad) == ({"a"}, set(), {11, 12})
    assert data["partial_loads"] == 1


def test_a_load_that_wrote_nothing_is_failed():
    _, (done, failed, bad) = run(lambda req, deadline: result(0), load_request("a"))
    assert (done, failed, bad) == ({"a"}, {"a"}, set())


@pytest.mark.parametrize("error, counter", [
    (KVMiss(), "load_misses"),
    (LayoutMismatch("another model"), "load_failures"),
    (PipeError("peer gone"), "load_failures"),
    (BufferClosed("closed"), "load_failures"),
    (TimeoutError("slow"), "load_failures"),
    (ValueError("bad entry"), "load_failures"),
    (RuntimeError("a bug"), "load_failures"),
    (KeyError("a bug"), "load_failures"),
    (SystemExit(3), "load_failures"),
])
def test_whatever_goes_wrong_the_load_is_reported_failed_never_raised(error, counter):
    def fail(req, deadline):
        raise error

    data, (done, failed, bad) = run(fail, load_request("a"), load_request("b"))
    assert (done, failed, bad) == ({"a", "b"}, {"a", "b"}, set())
    assert data[counter] == 2 and data["loaded"] == 0 and data["loads_in_flight"] == 0


def test_the_deadline_runs_from_the_claim_and_a_load_queued_past_it_is_failed_unstarted():
    release = threading.Event()
    started = []

    def slow(req, deadline):
        started.append(req.req_id)
        if req.req_id == "a":
            release.wait(5)
        return result(3)

    stats = StatsRecorder()
    # one at a time: "b" waits behind "a" past its 1 s deadline ("a" must start within it, also beside the vLLM tier)
    loads = Loads(slow, 1, 1.0, stats)
    try:
        loads.start(load_request("a"))
        loads.start(load_request("b"))
        time.sleep(2.0)
        release.set()
        done, failed, _ = finish(loads, 2)
    finally:
        loads.close()
    assert started == ["a"] and done == {"a", "b"} and failed == {"b"}
    assert stats.take().data["load_failures"] == 1


def test_the_transfer_gets_the_deadline():
    seen = []

    def record(req, deadline):
        seen.append(deadline - time.monotonic())
        return result(3)

    run(record, load_request("a"), timeout=3.0)
    assert 2.0 < seen[0] <= 3.0


def test_collect_waits_for_a_load_only_when_asked():
    release = threading.Event()
    loads = Loads(lambda req, deadline: release.wait(5) and result(3), 1, 5.0, StatsRecorder())
    try:
        loads.start(load_request("a"))
        assert loads.collect().done == set()
        start = time.monotonic()
        assert loads.collect(0.1).done == set()
        assert time.monotonic() - start >= 0.09
        release.set()
        assert finish(loads, 1)[0] == {"a"}
    finally:
        loads.close()


def test_loads_awaiting_a_push_hold_no_slot_of_the_others():
    """Decodes sent with their prefills wait for the producer: meanwhile a plain load still runs at once."""
    release = threading.Event()
    awaited = LoadSource([], from_params=False, same_tp=True, await_push=True)

    def outcome(req, deadline):
        if req.source.await_push:
            release.wait(5)
        return result(3)

    stats = StatsRecorder()
    loads = Loads(outcome, 1, 10.0, stats)
    try:
        for i in range(3):
            loads.start(load_request(f"await-{i}", source=awaited))
        loads.start(load_request("plain"))
        done, _, _ = finish(loads, 1)
        assert done == {"plain"}
        release.set()
        done, failed, _ = finish(loads, 3)
        assert done == {"await-0", "await-1", "await-2"} and not failed
    finally:
        loads.close()


def test_drain_waits_for_the_loads_in_flight_and_leaves_them_to_collect():
    release = threading.Event()
    loads = Loads(lambda req, deadline: release.wait(5) and result(3), 2, 5.0, StatsRecorder())
    try:
        loads.start(load_request("a"))
        assert loads.drain(0.1) == 1  # still running
        threading.Timer(0.2, release.set).start()
        assert loads.drain(5.0) == 0
        assert loads.collect().done == {"a"}
    finally:
        loads.close()
