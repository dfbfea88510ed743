"""Push mode's block arithmetic on a real KV cache layout, with stand-ins for the links and the pull fallback: the
producer pushes each block once, when complete, and commits only a whole prompt; the consumer writes exactly the
blocks it lacks from a pushed entry, and takes it from the producer its load source pairs with its rank."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from kv_connector.cache import block_copy
from kv_connector.cache.layout import KVCacheLayout
from kv_connector.metadata import LoadRequest, MooncakeConnectorMetadata, PushStep, SaveRequest
from kv_connector.source import LoadSource
from kv_connector.stats import StatsRecorder
from kv_connector.worker import digest
from kv_connector.worker.digest import Sampler
from kv_connector.worker.push import PushTransfer
from kv_connector.worker.transfer import LoadResult
from kv_lookup_buffer import PushArrivals, PushedEntry, PushReceiver, PushSender, entry_key
from kv_lookup_buffer import push_wire as pw
from kv_pipe.local_pipe import LocalPipe, local_pipe_pair
from tests.polling import wait_for

pytestmark = pytest.mark.usefixtures("quick_poll")

BLOCK, LAYERS, WIDTH, NUM_BLOCKS = 4, 2, 3, 16
PEER, PREFILL = "10.0.0.2:13103", "10.0.0.1:13003"


class FakePush:
    """A push link: records what the transfer asks of it."""

    def __init__(self, room: bool = True) -> None:
        self.room, self.begun, self.pushed, self.committed, self.notices = room, [], [], [], []
        self.failed_keys: set[bytes] = set()
        self.entry: PushedEntry | None = None

    def begin(self, key, nbytes, layers, nblocks):
        self.begun.append(nblocks)
        return self.room

    def push(self, key, layer, first, piece, n, ready=None):
        if ready is not None:
            ready()
        self.pushed.append((layer, first, n, piece.clone()))

    def failed(self, key):
        return key in self.failed_keys

    def commit(self, key, tokens, meta, hidden=None, ready=None):
        if ready is not None:
            ready()
        self.committed.append(tokens)
        self.hidden = hidden

    def abort(self, key):
        self.aborted = [*getattr(self, "aborted", []), key]

    def notify_pull(self, key):
        self.notices.append(key)

    def take(self, key, timeout):
        return self.entry

    def take_notice(self, key):
        self.notices_taken = getattr(self, "notices_taken", 0) + 1


class FakeLinks:
    def __init__(self, push: FakePush) -> None:
        self.push, self.asked = push, []

    def push_buffer(self, peer):
        self.asked.append(peer)
        return self.push


class FakePull:
    def __init__(self, checks: str = "off") -> None:
        self.saved, self.loaded, self.verified = [], [], []
        self.checks, self.secret, self.digest_groups = Sampler(checks, 1), b"", 1
        self.tamper = None  # as PullTransfer's in service

    def verify(self, req, sums, usable, tokens, descriptor):
        self.verified.append((req.req_id, sums, usable))

    def finish_prompt(self, save):
        self.saved.append(save.req_id)

    def load(self, req, deadline):
        self.loaded.append(req.req_id)
        return LoadResult(len(req.block_ids), 0, 0, "pulled", "")

    def close(self):
        pass


def transfer(push: FakePush | None = None, rank: int = 0, checks: str = "off"):
    caches = {f"layer.{i}": torch.zeros(NUM_BLOCKS, BLOCK, WIDTH) for i in range(LAYERS)}
    for i, t in enumerate(caches.values()):  # every block of every layer tells where it is
        t += (torch.arange(NUM_BLOCKS) * 10 + i * 1000).view(-1, 1, 1)
    layout = KVCacheLayout.from_caches(caches, NUM_BLOCKS, "model", block_size=BLOCK)
    links, pull = FakeLinks(push or FakePush()), FakePull(checks)
    return PushTransfer(layout, links, pull, StatsRecorder(), BLOCK, rank, PEER, push_wait=1.0), links, pull


def run_steps(t: PushTransfer, steps: list[PushStep]) -> None:
    for s in steps:
        meta = MooncakeConnectorMetadata(pushes=[s])
        t.begin_step(meta)
        for layer in range(LAYERS):
            t.save_layer(layer, meta)


def chunked(prompt_len: int, chunk: int, ids: list[int], push_to: list[str] | None = None) -> list[PushStep]:
    steps, end = [], 0
    while end < prompt_len:
        end = min(end + chunk, prompt_len)
        first = not steps
        steps.append(PushStep("r", ids, end, prompt_len, list(range(prompt_len)) if first else None,
                              push_to if first else None))
    return steps


@pytest.mark.parametrize("prompt_len, chunk", [(10, 10), (10, 3), (12, 4), (12, 5), (1, 1), (17, 16)])
def test_each_block_is_pushed_once_per_layer_when_complete_then_committed(prompt_len, chunk):
    t, links, _ = transfer()
    nblocks = -(-prompt_len // BLOCK)
    ids = [5 + i for i in range(nblocks)]
    run_steps(t, chunked(prompt_len, chunk, ids))
    push = links.push
    assert push.begun == [nblocks] and links.asked == [PEER]  # no params: mooncake.json's consumer
    for layer in range(LAYERS):
        got = [(first, n) for lay, first, n, _ in push.pushed if lay == layer]
        assert sum(n for _, n in got) == nblocks and [f for f, _ in got] == sorted({f for f, _ in got})
        for lay, first, n, piece in push.pushed:
            if lay == layer:  # the piece holds exactly the blocks it says, of the right layer
                assert piece[:, 0, 0, 0].tolist() == [(5 + first + i) * 10 + layer * 1000 for i in range(n)]
    t.finish_prompt(SaveRequest("r", list(range(prompt_len)), ids))
    assert push.committed == [prompt_len] and t.stats.take().data["pushed"] == 1


def test_the_commit_carries_the_digests_of_every_block_pushed_and_the_consumer_checks_them():
    """``kv_digest`` on: the pieces hash as they are sent (here at once), the commit carries the packed digests of
    the whole prompt, equal to those of its blocks gathered; a consumer's write of a pushed entry is then checked."""
    t, links, _ = transfer(checks="always")
    ids = [5, 6, 7]
    run_steps(t, chunked(12, 5, ids))
    t.finish_prompt(SaveRequest("r", list(range(12)), ids))
    gathered = block_copy.gather(t.layout.layers, t.layout.block_dim, ids)
    assert torch.equal(digest.unpack(links.push.hidden, b"", b""), digest.block_digests(gathered))


def test_a_request_aborted_mid_prefill_ends_its_push():
    """The scheduler says a request ended before its prompt was complete: its push state goes and the consumer is
    told to drop what it staged."""
    t, links, _ = transfer(checks="always")
    run_steps(t, chunked(12, 5, [5, 6, 7])[:1])
    key = t.pushing["r"].key
    t.abandon(["r", "never-pushed"])
    assert t.pushing == {} and t.targets == {} and links.push.aborted == [key]


def test_the_request_goes_to_the_consumer_its_params_name_at_this_rank():
    t, links, _ = transfer(rank=1)
    run_steps(t, chunked(8, 8, [1, 2], push_to=["10.0.0.9:1", "10.0.0.9:2"]))
    assert links.asked == ["10.0.0.9:2"]


def test_without_room_the_prompt_is_saved_for_pull_and_the_consumer_told():
    t, links, pull = transfer(FakePush(room=False))
    run_steps(t, chunked(8, 8, [1, 2]))
    assert links.push.pushed == []
    t.finish_prompt(SaveRequest("r", list(range(8)), [1, 2]))
    assert pull.saved == ["r"] and len(links.push.notices) == 1 and links.push.committed == []


def test_a_failed_push_falls_back_to_pull():
    t, links, pull = transfer()
    run_steps(t, chunked(8, 8, [1, 2]))
    links.push.failed_keys.add(t.pushing["r"].key)
    t.finish_prompt(SaveRequest("r", list(range(8)), [1, 2]))
    assert pull.saved == ["r"] and links.push.committed == [] and links.push.notices


def test_a_request_the_params_keep_for_pull_is_not_pushed():
    t, links, pull = transfer()
    run_steps(t, chunked(8, 8, [1, 2], push_to=[]))
    assert links.asked == [] and links.push.begun == []
    t.finish_prompt(SaveRequest("r", list(range(8)), [1, 2]))
    assert pull.saved == ["r"] and links.push.notices == []


def pushed_entry(t: PushTransfer, nblocks: int, pieces_of: int) -> PushedEntry:
    """What a producer pushed for a prompt of ``nblocks`` blocks, in pieces of ``pieces_of`` blocks per layer: row r
    of layer l holds ``-(r * 10 + l * 1000) - 1``."""
    entry = PushedEntry(0, LAYERS, nblocks, meta=t.layout.descriptor_tensor(), committed=True)
    for layer in range(LAYERS):
        for first in range(0, nblocks, pieces_of):
            n = min(pieces_of, nblocks - first)
            rows = -(torch.arange(first, first + n) * 10 + layer * 1000).float() - 1
            entry.pieces.append((layer, first, rows.view(-1, 1, 1, 1).expand(n, 1, BLOCK, WIDTH).clone()))
    return entry


@pytest.mark.parametrize("first, n, pieces_of", [(0, 4, 4), (1, 3, 2), (2, 1, 1), (3, 1, 3)])
def test_a_consumer_writes_exactly_the_blocks_it_lacks_from_the_pushed_entry(first, n, pieces_of):
    t, links, pull = transfer()
    links.push.entry = pushed_entry(t, 4, pieces_of)
    ids = [9, 3, 12, 7][first:first + n]
    req = LoadRequest("r", list(range(15)), first, ids, 15 - first * BLOCK, LoadSource([PREFILL], False, True))
    before = [layer.clone() for layer in t.layout.layers]
    result = t.load(req, time.monotonic() + 1)
    assert (result.written, result.source) == (n, "pushed") and pull.loaded == []
    for layer, (now, old) in enumerate(zip(t.layout.layers, before, strict=True)):
        for block in range(NUM_BLOCKS):
            if block in ids:  # prompt row first + i went into block ids[i]
                row = first + ids.index(block)
                assert torch.all(now[block] == -(row * 10 + layer * 1000) - 1)
            else:
                assert torch.equal(now[block], old[block])


def test_an_entry_missing_blocks_is_refused():
    t, links, _ = transfer()
    entry = pushed_entry(t, 4, 2)
    entry.pieces = [p for p in entry.pieces if not (p[0] == 1 and p[1] == 2)]  # layer 1 lacks blocks 2-3
    links.push.entry = entry
    req = LoadRequest("r", list(range(15)), 0, [1, 2, 3, 4], 15, LoadSource([PREFILL], False, True))
    with pytest.raises(ValueError, match="covers 2 of the 4 blocks"):
        t.load(req, time.monotonic() + 1)


def test_a_producer_of_another_tp_size_or_no_push_means_pull():
    t, links, pull = transfer()
    req = LoadRequest("r", list(range(15)), 0, [1, 2, 3, 4], 15, LoadSource([PREFILL, PREFILL], True, False))
    assert t.load(req, time.monotonic() + 1).source == "pulled" and links.asked == []  # no push link pairs with us
    same = LoadRequest("s", list(range(15)), 0, [1, 2, 3, 4], 15, LoadSource(["10.0.0.7:1"], True, True))
    assert t.load(same, time.monotonic() + 1).source == "pulled"  # nothing was pushed
    assert links.asked == ["10.0.0.7:1"] and pull.loaded == ["r", "s"]



# ---------------------------------------------------------------- a decode sent together with its prefill
# Real receivers over in-process pipes stand in for the consumer's push links (two producers linked); the wait is
# woken by their shared PushArrivals.
PEER_B = "10.0.0.3:13003"
AWAIT = LoadSource([], from_params=False, same_tp=True, await_push=True)


class AwaitLinks:
    """A consumer's push links: one receiver per linked producer, sharing one PushArrivals."""

    def __init__(self, peers: list[str]) -> None:
        self.arrivals = PushArrivals()
        self.ends: dict[str, tuple[PushSender, PushReceiver, LocalPipe]] = {}
        for peer in peers:
            a, b = local_pipe_pair(timeout=5.0)
            self.ends[peer] = (PushSender(a), PushReceiver(b, capacity=1 << 20, ttl=30, arrivals=self.arrivals), a)

    def push_receivers(self):
        return [(peer, receiver) for peer, (_, receiver, _) in self.ends.items()]

    def push_buffer(self, peer):
        raise AssertionError("an awaited push is looked for on every link, not on a named one")

    def close(self) -> None:
        for sender, receiver, _ in self.ends.values():
            sender.close()
            receiver.close()


@pytest.fixture
def awaiting():
    """``make(push_wait, rank)``: a consumer's PushTransfer over ``AwaitLinks`` to producers PREFILL and PEER_B."""
    made: list[AwaitLinks] = []

    def make(push_wait: float = 5.0, rank: int = 0):
        links = AwaitLinks([PREFILL, PEER_B])
        made.append(links)
        t, _, pull = transfer(rank=rank)
        t.links, t.push_wait = links, push_wait
        return t, links, pull

    yield make
    for links in made:
        links.close()


def push_prompt(t: PushTransfer, sender: PushSender, tokens: list[int], nblocks: int, commit: bool = True) -> None:
    """What a producer's push of ``tokens`` sends: BEGIN (once its credit came), every layer's blocks, COMMIT."""
    key = entry_key(tokens)
    assert wait_for(lambda: sender.begin(key, t.layout.kv_bytes(nblocks), LAYERS, nblocks))
    if commit:
        commit_prompt(t, sender, tokens, nblocks)


def commit_prompt(t: PushTransfer, sender: PushSender, tokens: list[int], nblocks: int) -> None:
    key = entry_key(tokens)
    for layer in range(LAYERS):
        rows = -(torch.arange(nblocks) * 10 + layer * 1000).float() - 1
        sender.push(key, layer, 0, rows.view(-1, 1, 1, 1).expand(nblocks, 1, BLOCK, WIDTH).clone(), nblocks)
    sender.commit(key, len(tokens), t.layout.descriptor_tensor())


def awaited(req_id: str = "r", tokens: int = 15, first: int = 0) -> LoadRequest:
    nblocks = -(-tokens // BLOCK)
    return LoadRequest(req_id, list(range(tokens)), first, [9, 3, 12, 7][first:nblocks], tokens - 1 - first * BLOCK,
                       AWAIT)


def assert_written(t: PushTransfer, req: LoadRequest) -> None:
    for layer, cache in enumerate(t.layout.layers):
        for i, block in enumerate(req.block_ids):
            assert torch.all(cache[block] == -((req.first_block + i) * 10 + layer * 1000) - 1)


def test_an_entry_pushed_and_committed_before_the_load_starts_is_taken_at_once(awaiting):
    t, links, pull = awaiting()
    sender, receiver, _ = links.ends[PEER_B]
    push_prompt(t, sender, list(range(15)), 4)
    key = entry_key(list(range(15)))
    assert wait_for(lambda: receiver.look(key) == "staged" and receiver._entries[key].committed)
    start = time.monotonic()
    req = awaited(first=1)
    result = t.load(req, time.monotonic() + 5)
    assert time.monotonic() - start < 0.5 and (result.written, result.source) == (3, "pushed") and pull.loaded == []
    assert_written(t, req)
    stats = t.stats.take().data
    assert stats["await_push_loads"] == 1 and stats["push_loaded"] == 1 and stats["await_push_timeouts"] == 0


@pytest.mark.parametrize("begun_before", [False, True])
def test_a_push_that_begins_or_commits_after_the_load_started_is_awaited(awaiting, begun_before):
    t, links, pull = awaiting(push_wait=5.0)
    sender = links.ends[PREFILL][0]
    tokens = list(range(15))
    if begun_before:
        push_prompt(t, sender, tokens, 4, commit=False)

    def producer() -> None:
        time.sleep(0.3)
        if begun_before:
            commit_prompt(t, sender, tokens, 4)
        else:
            push_prompt(t, sender, tokens, 4)

    thread = threading.Thread(target=producer)
    start = time.monotonic()
    thread.start()
    result = t.load(awaited(), time.monotonic() + 5)
    thread.join()
    assert 0.25 < time.monotonic() - start < 2.0  # woken by the arrival: neither at once nor after push_wait
    assert result.source == "pushed" and result.written == 4 and pull.loaded == []
    assert_written(t, awaited())


@pytest.mark.parametrize("rank, notice_first, begun", [(0, False, False), (0, True, False), (1, False, False),
                                                       (0, False, True)])
def test_a_pull_notice_loads_from_that_links_producer_at_this_rank(awaiting, rank, notice_first, begun):
    t, links, pull = awaiting(rank=rank)
    sender = links.ends[PEER_B][0]
    key = entry_key(list(range(15)))
    asked = []
    pull.load = lambda req, deadline: asked.append(req.source) or LoadResult(len(req.block_ids), 7, 7, "pulled", "")
    if begun:  # the push began, then failed: the load, waiting for its commit, hears "pull"
        push_prompt(t, sender, list(range(15)), 4, commit=False)
    if notice_first:  # no room: the producer saved it for pull before this load started
        sender.notify_pull(key)
        assert wait_for(lambda: links.ends[PEER_B][1].look(key) == "pull")
    else:
        threading.Timer(0.2, sender.notify_pull, (key,)).start()
    result = t.load(awaited(), time.monotonic() + 5)
    assert result.source == "pulled" and len(asked) == 1
    assert asked[0].peer(rank) == PEER_B and not asked[0].await_push  # the link's peer, nobody's params
    assert links.ends[PEER_B][1].look(key) is None  # the notice was used
    assert t.stats.take().data["await_push_loads"] == 1


def test_nothing_pushed_within_push_wait_fails_the_load(awaiting):
    t, links, pull = awaiting(push_wait=0.3)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no producer began pushing"):
        t.load(awaited(), time.monotonic() + 5)
    assert 0.29 < time.monotonic() - start < 3.0 and pull.loaded == []  # push_wait, not the 5 s deadline
    assert t.stats.take().data["await_push_timeouts"] == 1
    with pytest.raises(TimeoutError):  # the load's own deadline comes first
        t.load(awaited("s"), time.monotonic() + 0.1)
    assert time.monotonic() - start < 1.5


def test_a_begun_push_not_committed_by_the_deadline_fails_the_load(awaiting):
    t, links, _ = awaiting(push_wait=5.0)
    push_prompt(t, links.ends[PREFILL][0], list(range(15)), 4, commit=False)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="not committed by the load's deadline"):
        t.load(awaited(), time.monotonic() + 0.4)
    assert time.monotonic() - start < 1.0


def test_an_aborted_push_fails_the_load_at_once(awaiting):
    t, links, pull = awaiting(push_wait=5.0)
    _, receiver, raw = links.ends[PEER_B]
    key = entry_key(list(range(15)))
    raw.send_tensor(pw.encode(pw.Hello(7)))  # a producer speaking on the raw pipe
    raw.send_tensor(pw.encode(pw.Begin(key, t.layout.kv_bytes(4), LAYERS, 4)))
    threading.Timer(0.2, raw.send_tensor, (pw.encode(pw.Abort(key)),)).start()
    start = time.monotonic()
    with pytest.raises(ValueError, match="refused, aborted, dropped"):
        t.load(awaited(), time.monotonic() + 5)
    assert time.monotonic() - start < 1.0 and pull.loaded == []
    assert receiver.look(key) is None  # acted on: a later push of the same tokens starts afresh


# ---------------------------------------------------------------- a producer's answer said it pushes the prompt here
def told(source_peer: str = PEER_B, req_id: str = "r") -> LoadRequest:
    """A decode whose producer's params say ``mooncake_pushed``: from ``source_peer``, this rank's pair."""
    return dataclasses.replace(awaited(req_id), source=LoadSource([source_peer], from_params=True, same_tp=True,
                                                                  pushed=True))


def test_a_load_told_of_a_push_waits_for_its_begin_from_that_producer(awaiting):
    """The producer's answer reached the consumer before its BEGIN did (its sender thread was slow): the load waits
    for it, longer than push_wait allows an unannounced push, and takes the push; the same prompt pushed by another
    producer meanwhile is not taken."""
    t, links, pull = awaiting(push_wait=0.05)
    tokens = list(range(15))
    other = links.ends[PREFILL][1]
    push_prompt(t, links.ends[PREFILL][0], tokens, 4)
    assert wait_for(lambda: other.look(entry_key(tokens)) == "staged" and other._entries[entry_key(tokens)].committed)
    threading.Timer(0.4, push_prompt, (t, links.ends[PEER_B][0], tokens, 4)).start()
    start = time.monotonic()
    result = t.load(told(), time.monotonic() + 5)
    assert 0.35 < time.monotonic() - start < 2.0
    assert other.look(entry_key(tokens)) == "staged"  # the other producer's push is still there
    assert result.source == "pushed" and result.written == 4 and pull.loaded == []
    assert_written(t, told())
    assert t.stats.take().data.get("await_push_loads", 0) == 0  # not a decode sent with its prefill


def test_a_load_told_of_a_push_pulls_from_that_producer_when_it_says_so(awaiting):
    t, links, pull = awaiting(push_wait=0.05)
    key = entry_key(list(range(15)))
    asked = []
    pull.load = lambda req, deadline: asked.append(req.source) or LoadResult(len(req.block_ids), 7, 7, "pulled", "")
    links.ends[PREFILL][0].notify_pull(key)  # another producer's notice of the same prompt: not this load's
    threading.Timer(0.3, links.ends[PEER_B][0].notify_pull, (key,)).start()
    result = t.load(told(), time.monotonic() + 5)
    assert result.source == "pulled" and asked[0].pipes == [PEER_B] and asked[0].from_params


def test_a_load_told_of_a_push_that_never_comes_fails_at_its_deadline(awaiting):
    t, _, pull = awaiting(push_wait=0.05)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="said it pushes its prompt here, but neither the push nor a notice"):
        t.load(told(), time.monotonic() + 0.5)
    assert 0.45 < time.monotonic() - start < 1.5 and pull.loaded == []
