"""MooncakeStore, the KV pool's buffer, against a real ``mooncake_master`` and a second real client process (whose
segment holds what it put): objects come back exact and checked; a stranger's forged object, a fleet object put under
another key and an unchecked one are refused and removed; a master that is down answers at once, a frozen one within
the caller's timeout, a restarted one serves again; a dead holder's objects are missing, never hung on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.store import MooncakeMaster
from kv_lookup_buffer.mooncake_store import TAG, StoreError, StoreTimeout, block_keys
from tests.kv_lookup_buffer import programs
from tests.kv_pipe import peers
from tests.kv_pipe.peers import Peer

pytestmark = pytest.mark.pipes

ctx = peers.ctx()
SECRET = b"s" * 40
MiB = 1 << 20


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    with MooncakeMaster(tmp_path) as m:
        yield m


class Holder:
    """A second process in the pool that put ``n`` rows and holds its segment until ``release``."""

    def __init__(self, master: MooncakeMaster, seed: int, n: int, size: int, secret: bytes = SECRET,
                 segment: int = 64 * MiB) -> None:
        self.ready, self.done = ctx.Event(), ctx.Event()
        self.peer = Peer(programs.pool_put, master.address, seed, n, size, segment, secret, self.ready, self.done)
        assert self.ready.wait(60), "the holder did not join the pool"

    def release(self) -> int:
        self.done.set()
        return self.peer.result()


def reader(master: MooncakeMaster, secret: bytes = SECRET, segment: int = 16 * MiB, **kwargs):
    """This process's client (what the holder put lies in the holder's segment: its puts go to its own first)."""
    return programs.open_pool(master.address, segment, secret, **kwargs)


def wait_joined(pool, within: float, why: str) -> None:
    deadline = time.monotonic() + within
    while not pool.joined:
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def test_block_keys_name_prefixes():
    tokens = list(range(100))
    keys = block_keys("ns", tokens, 16)
    assert len(keys) == 6  # full blocks only
    assert block_keys("ns", tokens[:40], 16) == keys[:2]  # a prefix's keys are the longer prompt's first keys
    assert block_keys("ns", tokens, 16, first=2, count=3) == keys[2:5]
    other = block_keys("ns", [7] + tokens[1:], 16)
    assert not set(other) & set(keys)  # a block's key depends on every token before it
    assert not set(block_keys("other", tokens, 16)) & set(keys)  # and on the namespace (model, layout, heads)


def test_rows_put_by_another_process_come_back_exact(master):
    holder = Holder(master, seed=1, n=16, size=256 << 10)
    pool = reader(master)
    try:
        keys = programs.pool_keys(1, 16)
        assert pool.contains(keys, timeout=5) == 16
        assert pool.contains(keys[:3] + programs.pool_keys(2, 1) + keys[3:], timeout=5) == 3  # the leading run
        out = torch.zeros(16, 256 << 10, dtype=torch.uint8)
        pool.register(out)
        assert pool.get_into(keys, out, timeout=10) == 16
        assert torch.equal(out, programs.pool_rows(1, 16, 256 << 10))
        assert pool.stats["got_objects"] == 16 and pool.stats["got_bytes"] == 16 * (256 << 10)
        assert pool.stats["rejected"] == pool.stats["missing"] == 0
    finally:
        pool.close()
        assert holder.release() == 16


def test_a_missing_object_ends_the_run(master):
    holder = Holder(master, seed=3, n=4, size=64 << 10)
    pool = reader(master)
    try:
        keys = programs.pool_keys(3, 4)
        out = torch.zeros(5, 64 << 10, dtype=torch.uint8)
        pool.register(out)
        assert pool.get_into(keys[:2] + programs.pool_keys(4, 1) + keys[2:], out, timeout=10) == 2
        assert pool.stats["missing"] == 1
    finally:
        pool.close()
        holder.release()


@pytest.mark.parametrize("forgery", ["stranger", "other key", "other nonce", "other secret", "no secret"])
def test_objects_the_fleet_did_not_put_under_their_key_are_refused_and_removed(master, forgery):
    """With a secret a get checks each object's MAC over its key and bytes: a stranger's object (its own tag), a
    fleet object copied under another key, one whose MAC is the fleet's but whose nonce is not (the MAC key is the
    nonce's), one tagged with another secret or with none fail, are counted, removed from the pool, and each ends
    the run there (every one that arrived is checked, and removed if it fails)."""
    size = 64 << 10
    holder = Holder(master, seed=5, n=2, size=size, secret={"other secret": b"o" * 40, "no secret": b""}.get(
        forgery, SECRET))
    pool = reader(master)
    forger = None
    try:
        keys = programs.pool_keys(5, 2)
        if forgery in ("stranger", "other key", "other nonce"):
            row = programs.pool_rows(9, 1, size)[0]
            target = programs.pool_keys(6, 1)[0]  # the next block of the fleet's prompt
            fleets = programs.pool_rows(5, 1, size)[0]
            # "other key": the row and tag a fleet member put under its own key (anyone may read the pool), copied
            tag = {"other key": lambda: pool._tag(keys[0], fleets),
                   "other nonce": lambda: bytes(16) + pool._tag(target, fleets)[16:]}.get(forgery, lambda: bytes(TAG))()
            payload = bytes(fleets.numpy()) if forgery != "stranger" else bytes(row.numpy())
            ready, done = ctx.Event(), ctx.Event()
            forger = (Peer(programs.pool_forge, master.address, target, payload, tag, ready, done), done)
            assert ready.wait(60)
            asked = [keys[0], target]
            want = 1
        else:
            asked, want = keys, 0
        out = torch.zeros(2, size, dtype=torch.uint8)
        pool.register(out)
        assert pool.get_into(asked, out, timeout=10) == want
        assert pool.stats["rejected"] == len(asked) - want  # every object that arrived is checked
        deadline = time.monotonic() + 10
        while any(pool.present(asked[want:], timeout=5)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(pool.present(asked[want:], timeout=5))  # removed: the fleet can put them again
    finally:
        pool.close()
        if forger is not None:
            forger[1].set()
            forger[0].result()
        holder.release()


def test_a_dead_master_answers_at_once_and_a_restarted_one_serves_again(master):
    pool = reader(master, segment=16 * MiB)
    try:
        rows = programs.with_tags(programs.pool_rows(7, 2, 64 << 10))
        pool.register(rows)
        keys = programs.pool_keys(7, 2)
        master.kill()
        start = time.monotonic()
        with pytest.raises(StoreError):  # refused at once (at the latest by its timeout)
            pool.contains(keys, timeout=1)
        assert time.monotonic() - start < 3  # margins for a loaded machine: the engine's own wait is 30 s
        try:  # a put retries the master for a few seconds: it ends by its timeout
            assert pool.put(keys, rows, timeout=1) == 0
        except StoreTimeout:
            pass
        assert time.monotonic() - start < 6
        master.start()  # the same ports; the new master knows no object and no segment yet
        deadline = time.monotonic() + 30
        while pool.put(keys, rows, timeout=5) < 2:
            assert time.monotonic() < deadline, "the client never rejoined the restarted master"
            time.sleep(0.5)
        out = torch.zeros(2, 64 << 10, dtype=torch.uint8)
        pool.register(out)
        assert pool.get_into(keys, out, timeout=5) == 2 and torch.equal(out, programs.pool_rows(7, 2, 64 << 10))
    finally:
        pool.close()


def test_a_frozen_master_costs_a_caller_its_timeout_only(master):
    holder = Holder(master, seed=8, n=2, size=64 << 10)
    pool = reader(master)
    try:
        out, room = torch.zeros(2, 64 << 10, dtype=torch.uint8), torch.zeros(2, (64 << 10) + TAG, dtype=torch.uint8)
        pool.register(out)
        pool.register(room)
        master.freeze()
        stuck = []
        for call in (lambda: pool.get_into(programs.pool_keys(8, 2), out, timeout=1.0),
                     lambda: pool.put(programs.pool_keys(9, 2), room, timeout=1.0)):
            start = time.monotonic()
            try:
                call()
            except StoreTimeout as e:
                stuck.append(e.done)
            assert time.monotonic() - start < 4  # its timeout, with a margin for a loaded machine (not the 30 s)
        assert stuck and pool.stats["timeouts"] == len(stuck)  # the put at least needs the master
        master.thaw()
        for done in stuck:
            done.result(timeout=60)  # the calls themselves end once the master answers again
    finally:
        master.thaw()
        pool.close()
        holder.release()


def test_rows_outside_registered_memory_are_refused(master):
    pool = reader(master)
    try:
        with pytest.raises(ValueError, match="registered"):
            pool.get_into(programs.pool_keys(11, 1), torch.zeros(1, 64, dtype=torch.uint8), timeout=1)
    finally:
        pool.close()


def test_a_dead_holders_objects_are_missing_not_hung_on(master):
    holder = Holder(master, seed=10, n=4, size=2 * MiB)
    pool = reader(master)
    try:
        keys = programs.pool_keys(10, 4)
        out = torch.zeros(4, 2 * MiB, dtype=torch.uint8)
        pool.register(out)
        holder.peer.kill()
        start = time.monotonic()
        try:
            got = pool.get_into(keys, out, timeout=10)
        except StoreTimeout:
            got = -1
        assert got in (0, -1) and time.monotonic() - start < 11
    finally:
        pool.close()


def test_a_client_started_before_its_master_refuses_at_once_and_joins_once_it_is_up(tmp_path):
    """An instance may start before the pool's master (a fleet restarted in any order): it starts at once, its calls
    are refused without waiting, and it joins the pool in the background once the master answers."""
    from harness.ports import free_port

    master = MooncakeMaster(tmp_path)
    master.rpc_port, master.metrics_port = free_port(), free_port()
    start = time.monotonic()
    pool = reader(master, join_wait=0.5)
    try:
        assert time.monotonic() - start < 5 and not pool.joined
        with pytest.raises(StoreError, match="not in the KV pool yet"):
            pool.contains(programs.pool_keys(12, 1), timeout=5)
        master.start()
        wait_joined(pool, 30, "the client never joined the master that came up")
        rows = programs.with_tags(programs.pool_rows(12, 1, 64 << 10))
        pool.register(rows)  # registered after joining, as before
        assert pool.put(programs.pool_keys(12, 1), rows, timeout=5) == 1
        assert pool.contains(programs.pool_keys(12, 1), timeout=5) == 1
    finally:
        pool.close()
        master.stop()


@pytest.mark.parametrize("size", [1000, (64 << 10) + TAG + 1000])
def test_an_object_of_another_size_is_refused_and_removed(master, size):
    """A stranger's object under a fleet key, shorter or longer than a block and its tag: refused and removed (left
    in the pool, it would keep the fleet's saves of that key away and fail every load of its prefix)."""
    pool = reader(master)
    ready, done = ctx.Event(), ctx.Event()
    key = programs.pool_keys(13, 1)[0]
    forger = Peer(programs.pool_forge, master.address, key, bytes(size), b"", ready, done)
    try:
        assert ready.wait(60)
        out = torch.zeros(1, 64 << 10, dtype=torch.uint8)
        pool.register(out)
        assert pool.get_into([key], out, timeout=10) == 0
        assert pool.stats["rejected"] == 1
        deadline = time.monotonic() + 10
        while pool.contains([key], timeout=5) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.contains([key], timeout=5) == 0
    finally:
        pool.close()
        done.set()
        forger.result()


def test_what_is_checked_is_a_copy_out_of_the_registered_memory(master):
    """``copy_to``: each object is copied out of the memory the store's engine may write into, and the copy is the
    one checked and handed back."""
    holder = Holder(master, seed=14, n=3, size=64 << 10)
    pool = reader(master)
    try:
        landing = torch.zeros(3, 64 << 10, dtype=torch.uint8)
        pool.register(landing)
        private = torch.zeros(3, 64 << 10, dtype=torch.uint8)  # not registered
        assert pool.get_into(programs.pool_keys(14, 3), landing, timeout=10, copy_to=private) == 3
        assert torch.equal(private, programs.pool_rows(14, 3, 64 << 10))
    finally:
        pool.close()
        holder.release()


def test_a_frozen_master_at_start_up_stops_nothing(master):
    """A master that takes connections and answers nothing (frozen): the engine's own setup would hold the GIL, and
    so the whole process, as long as it waits; the client tries it in a process of its own first, so the instance
    goes on, and joins once the master answers."""
    master.freeze()
    start = time.monotonic()
    pool = reader(master, join_wait=1.0)
    try:
        ticks = 0
        while time.monotonic() - start < 3:  # this process's Python runs on meanwhile
            ticks += 1
            time.sleep(0.1)
        assert ticks >= 10 and not pool.joined  # (a held GIL would have allowed one)
        with pytest.raises(StoreError, match="not in the KV pool yet"):
            pool.contains(programs.pool_keys(15, 1), timeout=1)
        master.thaw()
        wait_joined(pool, 60, "the client never joined the master once it answered")
        assert pool.contains(programs.pool_keys(15, 1), timeout=5) == 0
    finally:
        master.thaw()
        pool.close()
