"""Producer-side programs run in a child process (the consumer side is the test process)."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from harness.pipes import open_pipe
from kv_lookup_buffer import BufferClosed, SimpleBuffer

Entry = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def basic_entries() -> list[Entry]:
    g = torch.Generator().manual_seed(5)
    return [(torch.tensor([1, 2, 3]), None, torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g), None)]


def prefix_entries() -> list[Entry]:
    kv = lambda i: torch.full((2, 3), float(i))  # noqa: E731
    return [
        (torch.tensor([1, 2, 3, 4]), None, kv(1), kv(-1), torch.ones(4)),
        (torch.tensor([10, 11, 12]), None, kv(2), kv(-2), None),
        (torch.tensor([20, 99, 21, 98]), torch.tensor([True, False, True, False]), kv(3), kv(-3), None),
        (torch.tensor([30, 31, 32]), None, kv(4), None, None),
    ]


STRESS_ENTRY_BYTES = 100 * 8 + 100 * 1 + 3 * 100 * 4  # int64 tokens, bool roi, float32 key/value/hidden


def stress_entries(seed: int = 100) -> list[Entry]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 50_000, (100,), generator=g), torch.ones(100, dtype=torch.bool),
             torch.rand(100, generator=g), torch.rand(100, generator=g), torch.rand(100, generator=g))
            for _ in range(200)]


def shuffled(entries: list[Entry], seed: int) -> list[Entry]:
    order = list(range(len(entries)))
    random.Random(seed).shuffle(order)
    return [entries[i] for i in order]


def rows_entries() -> list[Entry]:
    """Keys of 6 rows (row r holds r); the second is large enough for zero-copy receive (6 x 2 MiB)."""
    return [(torch.tensor([40, 41, i]), None, torch.arange(6, dtype=torch.float32).repeat_interleave(n).view(6, n),
             torch.tensor([i]), None) for i, n in enumerate((8, 1 << 19))]


def large_entries() -> list[Entry]:
    """Keys large enough for the pipe's zero-copy receive (12 MiB each)."""
    return [(torch.tensor([7, 8, i]), None, torch.arange(3 << 20, dtype=torch.float32) + i, torch.ones(2), None)
            for i in range(2)]


def parts_entries() -> list[Entry]:
    """A KV-like key [4 rows, 2 layers, 4 heads, 3]: element (r, l, h, i) holds r * 1000 + l * 100 + h * 10 + i."""
    r, layer, h, i = torch.meshgrid(*(torch.arange(n) for n in (4, 2, 4, 3)), indexing="ij")
    key = (r * 1000 + layer * 100 + h * 10 + i).to(torch.float32)
    return [(torch.tensor([50, 51, 52]), None, key, torch.tensor([9]), None)]


ENTRY_SETS = {"basic": basic_entries, "prefix": prefix_entries, "stress": stress_entries, "large": large_entries,
              "rows": rows_entries, "parts": parts_entries}


def produce(cfg: dict[str, Any], entry_set: str, thresh: float, done: Any, order_seed: int | None = None,
            full: Any = None, linger: float = 120.0, options: dict[str, Any] | None = None,
            all_in: Any = None, answer_delay: float = 0.0) -> dict[str, Any]:
    """Insert the entries (in a shuffled order if order_seed), then wait for ``done`` and report what is left.
    ``full`` is set once the first 100 (or all) are in, ``all_in`` once all are. ``options``: SimpleBuffer keyword
    arguments (max_age, evict); with them the report has ``insert_seconds``, the longest insert. ``answer_delay``:
    seconds the producer waits before it answers each request (a busy producer)."""
    entries = ENTRY_SETS[entry_set]()
    if order_seed is not None:
        entries = shuffled(entries, order_seed)
    longest = 0.0
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, thresh, **(options or {}))
        if answer_delay:
            answer = buf.producer._answer

            def late(request: Any, data_pipe: Any) -> None:
                time.sleep(answer_delay)
                answer(request, data_pipe)

            buf.producer._answer = late
        for i, entry in enumerate(entries):
            start = time.monotonic()
            buf.insert(*entry)
            longest = max(longest, time.monotonic() - start)
            if full is not None and i + 1 == min(100, len(entries)):
                full.set()  # the first 100 (or all) are in
        if all_in is not None:
            all_in.set()
        done.wait(linger)
        left = {"entries": len(buf), "bytes": buf.buffer_size, "stats": dict(buf.stats)}
        if options:
            left["insert_seconds"] = longest
        buf.close()
    return left


def blocked_insert(cfg: dict[str, Any], thresh: float, timeout: float, blocking: Any = None) -> dict[str, Any]:
    """Insert two stress entries into a buffer that holds one; report how the second insert ended. ``blocking`` (an
    event) is set as the second insert begins."""
    entries = stress_entries()
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, thresh, timeout=timeout)
        buf.insert(*entries[0])
        if blocking is not None:
            blocking.set()
        start = time.monotonic()
        try:
            buf.insert(*entries[1])
            outcome = "inserted"
        except (BufferClosed, TimeoutError) as e:
            outcome = f"{type(e).__name__}: {e}"
        return {"outcome": outcome, "after": time.monotonic() - start}


def close_later(cfg: dict[str, Any], delay: float, told: Any) -> None:
    """A producer that never inserts, and closes after ``delay`` seconds; its pipe stays open until ``told`` is set
    (the consumer has its CLOSED answer)."""
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1 << 20, role="producer")
        time.sleep(delay)
        buf.close()
        told.wait(60)


def stall_mid_answer(cfg: dict[str, Any], stall: float, ready: Any, done: Any) -> dict[str, Any]:
    """A producer that answers the first request with a HIT and the entry's first tensor, then stalls for ``stall``
    seconds (as if frozen) before sending the rest; then it serves the basic entries from a SimpleBuffer on the same
    pipe (``ready`` set once they are in). Reports how sending the rest of the stalled answer ended."""
    from kv_lookup_buffer.simple_wire import HIT, answer_frame, read_request  # the wire, by hand

    entry = basic_entries()[0]
    with open_pipe(cfg, 0) as pipe:
        request = read_request(pipe.recv_tensor(timeout=60))
        pipe.send_tensor(answer_frame(HIT, request.seq))
        pipe.send_tensor(entry[0])
        time.sleep(stall)
        try:
            for t in entry[1:]:
                pipe.send_tensor(t, timeout=5)
            rest = "sent"
        except Exception as e:  # reported to the test
            rest = f"{type(e).__name__}: {e}"
        buf = SimpleBuffer(pipe, pipe, 1 << 30)
        for e in basic_entries():
            buf.insert(*e)
        ready.set()
        done.wait(60)
        buf.close()
        return {"rest": rest}


# ----------------------------------------------------------------------------- push channel producers
PUSH_LAYERS, PUSH_BLOCKS, PUSH_BLOCK = 3, 5, (4, 8)  # an entry: 3 layers x 5 blocks of 4x8 float32


def push_entry(seed: int) -> tuple[list[int], torch.Tensor]:
    """Tokens and the KV of one pushed entry: [layers, blocks, *block]."""
    g = torch.Generator().manual_seed(seed)
    return list(range(seed, seed + 37)), torch.randn(PUSH_LAYERS, PUSH_BLOCKS, *PUSH_BLOCK, generator=g)


def wait_begin(buf: Any, key: bytes, nbytes: int, timeout: float = 30.0) -> bool:
    """``begin`` once the consumer's first credit has arrived (False if it never allows it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if buf.begin(key, nbytes, PUSH_LAYERS, PUSH_BLOCKS):
            return True
        time.sleep(0.05)
    return False


def push_entries(cfg: dict[str, Any], seeds: list[int], done: Any, stop_after_pieces: int | None = None,
                 pause: float = 0.0) -> dict:
    """Push each entry in two "steps" (blocks 0-2, then 3-4, layer by layer), commit it with a small meta tensor;
    an entry whose ``begin`` is refused goes by pull (``notify_pull``). With ``stop_after_pieces``, hang (for a
    kill) after that many pieces of the first entry, without committing. ``pause``: seconds between entries (as
    between the prefills of two requests)."""
    from kv_lookup_buffer.push_buffer import PushSender, entry_key

    outcome: dict[str, Any] = {"pushed": [], "pulled": []}
    with open_pipe(cfg, 0) as pipe:
        buf = PushSender(pipe)
        for seed in seeds:
            tokens, kv = push_entry(seed)
            key = entry_key(tokens)
            if not wait_begin(buf, key, kv.numel() * kv.element_size(), timeout=5.0 if outcome["pushed"] else 30.0):
                buf.notify_pull(key)
                outcome["pulled"].append(seed)
                continue
            pieces = 0
            for lo, hi in ((0, 3), (3, PUSH_BLOCKS)):
                for layer in range(PUSH_LAYERS):
                    buf.push(key, layer, lo, kv[layer, lo:hi].clone(), hi - lo)
                    pieces += 1
                    if stop_after_pieces is not None and pieces >= stop_after_pieces:
                        time.sleep(600)
            buf.commit(key, len(tokens), torch.tensor([seed, 7], dtype=torch.int64))
            outcome["pushed"].append(seed)
            time.sleep(pause)
        done.wait(120)
        outcome["stats"] = dict(buf.stats)
        buf.close()
    return outcome


def push_garbage_then_entry(cfg: dict[str, Any], seed: int, done: Any) -> None:
    """Speak the push protocol badly (wrong types, bad magic, unknown kind, a DATA bigger than its BEGIN), then push
    one good entry by hand."""
    from kv_lookup_buffer import entry_key
    from kv_lookup_buffer import push_wire as pw

    tokens, kv = push_entry(seed)
    key = entry_key(tokens)
    nbytes = kv.numel() * kv.element_size()
    with open_pipe(cfg, 0) as pipe:
        pipe.send_tensor(pw.encode(pw.Hello(12345)))
        pipe.send_tensor(torch.zeros(3))                                    # not a header
        bad = pw.encode(pw.Begin(key, nbytes, 3, 5))
        bad[0] = 7
        pipe.send_tensor(bad)                                               # bad magic
        unknown = pw.encode(pw.Begin(pw.NO_KEY, 0, 0, 0))
        unknown[2] = 99
        pipe.send_tensor(unknown)                                           # unknown kind
        other = entry_key([1, 2, 3])
        pipe.send_tensor(pw.encode(pw.Begin(other, 64, 3, 5)))
        pipe.send_tensor(pw.encode(pw.Data(other, 0, 0, 1)))
        pipe.send_tensor(torch.zeros(1000))                                 # 4000 bytes > the 64 announced
        pipe.send_tensor(pw.encode(pw.Begin(key, nbytes, PUSH_LAYERS, PUSH_BLOCKS)))
        for layer in range(PUSH_LAYERS):
            pipe.send_tensor(pw.encode(pw.Data(key, layer, 0, PUSH_BLOCKS)))
            pipe.send_tensor(kv[layer].clone())
        pipe.send_tensor(pw.encode(pw.Commit(key, len(tokens))))
        pipe.send_tensor(None)
        done.wait(120)


def insert_then_overwrite(cfg: dict[str, Any], done: Any) -> None:
    """Insert entry A with the default copy, then scribble over A's tensors; insert entry B with copy=False."""
    a_key, b_key = torch.arange(12.0), torch.arange(12.0) * 2
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1 << 20)
        buf.insert(torch.tensor([1, 2]), None, a_key, None, None)
        a_key.fill_(-1.0)  # the caller may reuse its tensors at once
        buf.insert(torch.tensor([3, 4]), None, b_key, None, None, copy=False)
        done.wait(120)
        buf.close()


# ----------------------------------------------------------------------------- XpYd: one producer, many consumers
def produce_for_links(cfg: dict[str, Any], address: str, entry_set: str, done: Any, ready: Any) -> dict[str, Any]:
    """A producer buffer without pipes of its own: each consumer that links to the endpoint at ``address`` is served
    (``serve_link``). Inserts the entries, sets ``ready``, waits for ``done``, reports what is left."""
    from tests.kv_pipe.peers import open_endpoint

    with open_endpoint(cfg, 0, address, start=False) as endpoint:
        buf = SimpleBuffer(None, None, 1 << 30, role="producer")
        endpoint.on_link(buf.serve_link)
        endpoint.start()
        for entry in ENTRY_SETS[entry_set]():
            buf.insert(*entry)
        ready.set()
        done.wait(120)
        left = {"entries": len(buf), "stats": dict(buf.stats), "links": len(endpoint.links())}
        buf.close()
    return left


def consume_from(cfg: dict[str, Any], address: str, producers: list[str], entry_set: str,
                 wanted: list[tuple[int, int]]) -> dict[str, int]:
    """A consumer endpoint at ``address`` with a buffer per producer link; takes entry ``i`` from producer ``p`` for
    each (p, i) in ``wanted`` from two threads at once; counts exact hits, misses and wrong answers."""
    import threading

    from tests.kv_pipe.peers import open_endpoint, same

    entries = ENTRY_SETS[entry_set]()
    counts = {"hits": 0, "misses": 0, "wrong": 0}
    lock = threading.Lock()
    with open_endpoint(cfg, 1, address) as endpoint:
        bufs = [SimpleBuffer(endpoint.link(p), endpoint.link(p), 1 << 30, role="consumer") for p in producers]

        def take(items: list[tuple[int, int]]) -> None:
            for p, i in items:
                got = bufs[p].drop_select(entries[i][0], entries[i][1])
                kind = ("misses" if got[2] is None else
                        "hits" if all(same(a, b) for a, b in zip(got, entries[i], strict=True)) else "wrong")
                with lock:
                    counts[kind] += 1

        threads = [threading.Thread(target=take, args=(wanted[k::2],)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for buf in bufs:
            buf.close()
    return counts


def request_then_hang(cfg: dict[str, Any], address: str, producer: str, entry_set: str, asked: Any) -> None:
    """A consumer at ``address`` that asks ``producer`` for the first entry of ``entry_set`` and never reads the
    answer (it is killed meanwhile)."""
    from kv_lookup_buffer.simple_wire import OP_DROP_SELECT, request_frame  # the wire, by hand
    from tests.kv_pipe.peers import open_endpoint

    with open_endpoint(cfg, 1, address) as endpoint:
        pipe = endpoint.link(producer, "kv")
        pipe.send_tensor(request_frame(OP_DROP_SELECT, 1, ENTRY_SETS[entry_set]()[0][0]))
        asked.set()
        time.sleep(120)


def ask(cfg: dict[str, Any], queries: list[list[int]], timeout: float) -> list[tuple[str, float]]:
    """Consumer: one drop_select per query, one after the other; how each ended ("hit", "miss" or the error) and
    how long it took."""
    out = []
    with open_pipe(cfg, 1) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
        for query in queries:
            start = time.monotonic()
            try:
                got = buf.drop_select(torch.tensor(query), None, timeout=timeout)
                what = "miss" if got[2] is None else "hit"
            except Exception as e:  # reported to the test
                what = f"{type(e).__name__}: {e}"
            out.append((what, time.monotonic() - start))
    return out


# ----------------------------------------------------------------------------- long prompts (issue #24)
LONG_TOKENS = 12_000  # int64: 96000 bytes, more than inline_max (64 KiB): a request's bytes follow its header


def long_entry() -> Entry:
    """An entry keyed by a 12k-token prompt."""
    tokens = torch.arange(LONG_TOKENS, dtype=torch.int64) * 7 % 50_000
    return tokens, None, torch.arange(4096, dtype=torch.float32).view(8, 512), torch.tensor([LONG_TOKENS]), None


def ask_long(cfg: dict[str, Any], pause: float, paused: Any = None) -> tuple[str, float]:
    """Consumer: drop_select ``long_entry``'s tokens, its request's bytes coming ``pause`` s after the request's
    header (``pause_after_frames``; ``paused`` set then). How it ended ("hit" with the right entry, "miss", "wrong"
    or the error) and how long it took."""
    from tests.kv_pipe.peers import pause_after_frames, same

    expected = long_entry()
    with open_pipe(cfg, 1) as pipe:
        buf = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
        if pause:
            pause_after_frames({"TENSOR"}, pause, times=1, paused=paused)
        start = time.monotonic()
        try:
            got = buf.drop_select(expected[0], None, timeout=20)
            what = ("miss" if got[2] is None else
                    "hit" if all(same(a, b) for a, b in zip(got, expected, strict=True)) else "wrong")
        except Exception as e:  # reported to the test
            what = f"{type(e).__name__}: {e}"
        took = time.monotonic() - start
        buf.close()
    return what, took


def produce_slowly(cfg: dict[str, Any], pause: float, done: Any) -> dict[str, Any]:
    """Producer holding ``long_entry``; the bytes of the first tensor it sends (the header of its first answer: run
    with ``inline_max`` 0, so that it goes through the ring) come ``pause`` s after that tensor's header. Reports its
    stats."""
    from tests.kv_pipe.peers import pause_after_frames

    with open_pipe(cfg, 0) as pipe:
        pause_after_frames({"TENSOR"}, pause, times=1)
        buf = SimpleBuffer(pipe, pipe, 1 << 30)
        buf.insert(*long_entry())
        done.wait(60)
        deadline = time.monotonic() + 10  # the consumer may have it all before the serving thread counts it
        while not (buf.stats["hits"] or buf.stats["requests_lost"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = dict(buf.stats)
        buf.close()
    return stats


# ---------------------------------------------------------------- the KV pool (Mooncake Store)
def pool_rows(seed: int, n: int, size: int) -> torch.Tensor:
    """``n`` rows of ``size`` random bytes, the same for the same seed in any process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g)


def pool_keys(seed: int, n: int) -> list[str]:
    from kv_lookup_buffer.mooncake_store import block_keys

    return block_keys(f"test-{seed}", list(range(seed, seed + 4 * n)), 4)


def open_pool(master: str, segment: int, secret: bytes = b"", **kwargs: Any):
    """A client of the pool at ``master`` (``kwargs``: ``MooncakeStore``'s own, such as ``join_wait``)."""
    from kv_lookup_buffer.mooncake_store import MooncakeStore
    from kv_lookup_buffer.store_config import StoreConfig

    config = StoreConfig(master, global_segment_size=segment, local_buffer_size=16 << 20)
    return MooncakeStore(config, "127.0.0.1", "P2PHANDSHAKE", secret=secret, **kwargs)


def with_tags(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` with room for their tags after each (what ``MooncakeStore.put`` takes)."""
    from kv_lookup_buffer.mooncake_store import TAG

    out = torch.zeros(rows.shape[0], rows.shape[1] + TAG, dtype=torch.uint8)
    out[:, :rows.shape[1]] = rows
    return out


def pool_put(master: str, seed: int, n: int, size: int, segment: int, secret: bytes, ready: Any, done: Any) -> int:
    """Join the pool, put ``n`` rows under ``pool_keys(seed, n)``, say ``ready``, hold the segment until ``done``."""
    pool = open_pool(master, segment, secret, local_first=True)  # a holder: what it put lies in its segment
    rows = with_tags(pool_rows(seed, n, size))
    pool.register(rows)
    stored = pool.put(pool_keys(seed, n), rows, timeout=30.0)
    ready.set()
    done.wait(120)
    pool.close()
    return stored


def open_raw_client(master: str) -> Any:
    """A stranger's bare Mooncake Store client (it knows no tags) in this process, with a 64 MiB segment."""
    import os

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master) == 0
    return client


def pool_forge(master: str, key: str, payload: bytes, tag: bytes, ready: Any, done: Any) -> int:
    """A stranger with a bare store client (no tag of its own making): puts ``payload`` + ``tag`` under ``key``."""
    client = open_raw_client(master)
    data = torch.frombuffer(bytearray(payload + tag), dtype=torch.uint8)
    assert client.register_buffer(data.data_ptr(), data.numel()) == 0
    rc = client.put_from(key, data.data_ptr(), data.numel())
    ready.set()
    done.wait(120)
    return rc
