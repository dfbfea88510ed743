"""The KV pool (#49) on the traffic it is for: what a fleet recomputes and how soon a follow-up turn answers.

Fleets (``benchmarks/support/pool_fleet.py``), started one at a time on this box, each instance pinned to a core of
its own, the kv32k model: two colocated instances without a pool (``colocated``), two ``kv_both`` instances sharing
this project's pool (``pool``), two sharing a pool through vLLM's own ``MooncakeStoreConnector`` (``vllm-store``),
and a disaggregated producer/consumer pair without and with the pool (``1p1d``, ``1p1d-pool``, and
``1p1d-pool-store-only`` whose producer stores in the pool but does not look there: ``pool_lookups`` false; each request
prefilled on the producer, then decoded on the consumer with the producer's params: the seed's flow). Our fleets run
with a secret, as deployed (every pooled block's tag is a MAC, checked on every load); vLLM's has no such check.

Workloads, the same requests for every fleet, one request at a time, streamed:

- *chat*: ``--conversations`` conversations of ``--turns`` turns behind one shared system prompt (``--system``
  tokens); each turn adds a user message (``--user`` tokens) to the history (every earlier message and answer),
  answers ``--answer`` tokens; turn t of conversation c goes to instance (c + t) mod 2 (round robin: a
  conversation's next turn is on the other instance).
- *document*: ``--documents`` documents (``--document`` tokens each) and ``--questions`` questions about each (64
  tokens each), round robin.

Columns: prompt tokens sent, tokens the fleet computed (prompt tokens less its instances' prefix-cache hits and
connector hits, vLLM's counters; a disaggregated request's prompt counts once, on the producer), those hits as a
share of what the workload makes reusable (the whole blocks of each prompt that an earlier request of the run had
computed, its answer included: counted by this script), TTFT by turn (the client's: a disaggregated request's
prefill included), requests per second (one at a time), KV moved (bytes the connectors loaded and stored), and our
pool's load rate against the bare engine: Mooncake Store's own ``batch_get_into`` of the same loads (as many
objects of one block each per call as each of the pool's loads had), between two processes pinned as the instances
are.

Also: each document's second question, the first on the other instance: a follow-up with its 2,048-token history
(the document) on an instance that never saw it.

Run (from the repository root; ~8 minutes)::

    .venv/bin/python benchmarks/bench_pool.py
    .venv/bin/python benchmarks/bench_pool.py --fleets colocated pool --conversations 4

Prints a markdown table and writes bench_pool.json / bench_pool.md to ``--out-dir`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from benchmarks.support.metrics import scrape  # noqa: E402
from benchmarks.support.pool_fleet import FLEETS, Fleet, ask, start  # noqa: E402
from benchmarks.support.stacks import serve_args_for  # noqa: E402
from harness.store import MooncakeMaster  # noqa: E402
from harness.vllm import build_model  # noqa: E402

BLOCK = 128  # vLLM's CPU block size
KV_PER_TOKEN = 32 << 10  # kv32k in bf16 (float32: twice)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 7000) for _ in range(n)]


class Reuse:
    """The blocks computed so far in the run (chained hashes of whole blocks), to count what a prompt could reuse."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()

    @staticmethod
    def chain(tokens: list[int]) -> list[bytes]:
        out, h = [], b""
        for i in range(len(tokens) // BLOCK):
            h = hashlib.sha256(h + str(tokens[i * BLOCK:(i + 1) * BLOCK]).encode()).digest()
            out.append(h)
        return out

    def reusable(self, tokens: list[int]) -> int:
        """Prompt tokens an earlier request computed (whole blocks, and never the last token, which vLLM computes)."""
        held = 0
        for h in self.chain(tokens[:-1]):
            if h not in self.seen:
                break
            held += BLOCK
        return held

    def computed(self, tokens: list[int]) -> None:
        self.seen.update(self.chain(tokens))


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


COUNTED = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
MOVED = ("vllm:mooncake_kv_pool_loaded_bytes_total", "vllm:mooncake_kv_pool_saved_bytes_total",
         "vllm:mooncake_kv_fetched_bytes_total", "vllm:mooncake_store_operation_bytes_total")


def run_workloads(fleet: Fleet, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    reuse = Reuse()
    ttft: dict[str, list[float]] = {}
    reusable = 0
    answer_len = args.answer
    for warm in range(2):  # untimed: each instance serves one unrelated request first
        ask(fleet, warm, prompt(random.Random(1000 + warm), 300), 4)
    time.sleep(1.0)
    before = [scrape(s.url) for s in fleet.instances]
    start = time.perf_counter()
    requests = 0
    system = prompt(rng, args.system)
    history = [list(system) for _ in range(args.conversations)]
    for turn in range(args.turns):
        for conv in range(args.conversations):
            tokens = history[conv] + prompt(rng, args.user)
            reusable += reuse.reusable(tokens)
            seconds, answer = ask(fleet, conv + turn, tokens, answer_len)
            ttft.setdefault(f"chat turn {turn + 1}", []).append(seconds)
            history[conv] = tokens + answer
            reuse.computed(tokens + answer[:-1])  # every token's KV but the last answer token's
            requests += 1
    for _ in range(args.documents):
        document = prompt(rng, args.document)
        for question in range(args.questions):
            tokens = document + prompt(rng, 64)
            reusable += reuse.reusable(tokens)
            seconds, answer = ask(fleet, question, tokens, 8)
            ttft.setdefault("document question", []).append(seconds)
            if question == 1:  # the first on the other instance
                ttft.setdefault("document, other instance's first question", []).append(seconds)
            reuse.computed(tokens + answer[:-1])
            requests += 1
    wall = time.perf_counter() - start
    time.sleep(1.5)  # the last pool saves, and stats that reach /metrics with a later step
    for server in fleet.instances:
        try:
            server.complete([1, 2, 3], 1)
        except Exception:  # a step only (its stats reach /metrics)
            pass
    time.sleep(0.5)
    after = [scrape(s.url) for s in fleet.instances]
    counts = {name: sum(delta(a, b, name) for a, b in zip(after, before, strict=True)) for name in COUNTED + MOVED}
    counts["load_failures"] = sum(delta(a, b, "vllm:mooncake_kv_load_failures_total")
                                  for a, b in zip(after, before, strict=True))
    # a disaggregated request's prompt is sent twice (prefill, decode): count the producer's only, and the decode's
    # loads as transfers, not as reuse
    sent = counts["vllm:prompt_tokens_total"]
    hits = counts["vllm:prefix_cache_hits_total"] + counts["vllm:external_prefix_cache_hits_total"]
    if fleet.disaggregated:
        producer_before, producer_after = before[0], after[0]
        sent = delta(producer_after, producer_before, "vllm:prompt_tokens_total")
        hits = delta(producer_after, producer_before, "vllm:prefix_cache_hits_total") + \
            delta(producer_after, producer_before, "vllm:external_prefix_cache_hits_total")
    pool_seconds = sum(delta(a, b, "vllm:mooncake_kv_pool_load_seconds_sum") for a, b in zip(after, before,
                                                                                            strict=True))
    pool_bytes = sum(delta(a, b, "vllm:mooncake_kv_pool_load_bytes_sum") for a, b in zip(after, before, strict=True))
    return {"ttft_s": ttft, "requests": requests, "wall_s": wall, "prompt_tokens": sent, "cache_hits": hits,
            "computed": sent - hits, "reusable": reusable, "counts": counts,
            "pool_load_gbps": pool_bytes / pool_seconds / 1e9 if pool_seconds else None,
            "pool_load_bytes": pool_bytes}


def _store(master: str, segment: int) -> Any:
    """This project's layer 2 (``MooncakeStore``, the fleet's secret) in a process of the bare measurement: its own
    client is the bare engine's too, so both columns use one client and one placement: the master's, as the instances'
    (both processes give the pool a segment of ``segment`` bytes)."""
    from benchmarks.support.pool_fleet import SECRET
    from kv_lookup_buffer import MooncakeStore
    from kv_lookup_buffer.store_config import StoreConfig

    return MooncakeStore(StoreConfig(master, global_segment_size=segment, local_buffer_size=16 << 20), "127.0.0.1",
                         "P2PHANDSHAKE", secret=SECRET.encode())


def _bare_holder(master: str, sizes: list[int], size: int, ready: Any, done: Any) -> None:
    """The holder (core 0, as the instance that stored the blocks): puts each load's blocks twice, one object per
    block: bare (the engine's own batch_put_from) and through MooncakeStore (with its tag)."""
    os.sched_setaffinity(0, {0})
    import torch

    from kv_lookup_buffer import TAG

    store = _store(master, 2 * (sum(sizes) + 16) * (size + TAG))
    client = store._client
    src = torch.randint(0, 255, (max(sizes), size + TAG), dtype=torch.uint8)
    store.register(src)
    where = () if store._placement is None else (store._placement,)
    for r, n in enumerate(sizes):
        keys = [f"bare-{r}-{i}" for i in range(n)]
        assert client.batch_put_from(keys, [src[i].data_ptr() for i in range(n)], [size] * n, *where) == [0] * n
        assert store.put([f"ours-{r}-{i}" for i in range(n)], src, timeout=60) == n
    ready.set()
    done.wait(900)
    store.close()


def _bare_getter(master: str, sizes: list[int], size: int, ready: Any, out: Any) -> None:
    """The getter (core 1, as the loading instance), each load in turn: the engine's batch_get_into of its objects,
    then MooncakeStore's get of the same blocks, copied out of the registered memory and checked (what a pool load
    does before the copy into the KV cache: both copies and the check in one)."""
    os.sched_setaffinity(0, {1})
    import torch

    from kv_lookup_buffer import TAG

    store = _store(master, 2 * (sum(sizes) + 16) * (size + TAG))
    client = store._client
    dst = torch.zeros(max(sizes), size, dtype=torch.uint8)
    private = torch.ones(max(sizes), size, dtype=torch.uint8)
    store.register(dst)
    assert ready.wait(600)
    bare = ours = 0.0
    for r, n in enumerate(sizes):
        keys = [f"bare-{r}-{i}" for i in range(n)]
        t = time.perf_counter()
        assert client.batch_get_into(keys, [dst[i].data_ptr() for i in range(n)], [size] * n) == [size] * n
        bare += time.perf_counter() - t
        t = time.perf_counter()
        assert store.get_into([f"ours-{r}-{i}" for i in range(n)], dst, timeout=60, copy_to=private) == n
        ours += time.perf_counter() - t
    store.close()
    out.put((bare, ours))


def bare_store_rate(sizes: list[int], size: int) -> tuple[float, float]:
    """Mooncake Store's own batch_get_into of the same loads (``sizes``: blocks per load, objects of ``size``
    bytes), and MooncakeStore's checked get of them, between two processes pinned as the instances are: GB/s of
    each over all of them."""
    import multiprocessing

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench-pool-bare-") as tmp, MooncakeMaster(Path(tmp)) as master:
        ready, done, out = ctx.Event(), ctx.Event(), ctx.Queue()
        holder = ctx.Process(target=_bare_holder, args=(master.address, sizes, size, ready, done))
        getter = ctx.Process(target=_bare_getter, args=(master.address, sizes, size, ready, out))
        holder.start()
        getter.start()
        try:
            bare, ours = out.get(timeout=900)
        finally:
            done.set()
            for proc in (getter, holder):
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    total = sum(sizes) * size / 1e9
    return total / bare, total / ours


POOL_LOADED = re.compile(r"loaded request \S+ \(pool\): .* from the pool: (\d+) of \d+ blocks")


def pool_loads(work: Path) -> list[int]:
    """Blocks per pool load, read off the instances' logs under ``work``."""
    return [int(m.group(1)) for log in sorted(work.glob("*.log")) for m in POOL_LOADED.finditer(log.read_text())]


def ms(values: list[float] | None, q: float) -> str:
    return "-" if not values else common.fmt(common.percentile(values, q) * 1e3, 0)


TITLE = "The KV pool: multi-turn chat and a shared document on two instances"


def report(results: dict[str, Any], bare: float | None, args: argparse.Namespace, dtype: str,
           header: str | None = None, layer2: float | None = None) -> str:
    turns = [f"chat turn {t + 1}" for t in range(args.turns)]
    lines = [header or common.header(TITLE, dtype),
             f"\nkv32k model ({dtype}), block {BLOCK}; chat: {args.conversations} conversations x {args.turns} turns, "
             f"{args.system}-token system prompt, {args.user}-token user messages, {args.answer}-token answers, turn "
             f"t of conversation c on instance (c + t) mod 2 (turn {args.turns}'s history: "
             f"{args.system + (args.turns - 1) * (args.user + args.answer)} tokens); {args.documents} documents of "
             f"{args.document} tokens, {args.questions} questions of 64 tokens each, round robin. One request at a "
             "time, streamed. Each fleet "
             "started alone, instances on cores 0 and 1.\n",
             "| fleet | prompt tokens | computed | cache hits / reusable | follow-up turns TTFT p50 / p99 (ms) | "
             f"turn {args.turns} TTFT p50 (ms) | document: the other instance's first question TTFT p50 (ms) | document "
             "question TTFT p50 / p99 (ms) | req/s | KV loaded / stored (MiB) | pool load GB/s (x bare) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        follow = [s for t in turns[1:] for s in r["ttft_s"].get(t, [])]
        c = r["counts"]
        loaded = (c["vllm:mooncake_kv_pool_loaded_bytes_total"] + c["vllm:mooncake_kv_fetched_bytes_total"]) / 2**20
        stored = c["vllm:mooncake_kv_pool_saved_bytes_total"] / 2**20
        if c["vllm:mooncake_store_operation_bytes_total"]:  # vLLM's store connector: its puts and gets together
            loaded, stored = c["vllm:mooncake_store_operation_bytes_total"] / 2**20, float("nan")
        moved = f"{loaded:.0f} / {'-' if stored != stored else f'{stored:.0f}'}"
        rate = "-" if r["pool_load_gbps"] is None else \
            f"{r['pool_load_gbps']:.2f} ({r['pool_load_gbps'] / bare:.2f}x)" if bare else f"{r['pool_load_gbps']:.2f}"
        share = r["cache_hits"] / r["reusable"] if r["reusable"] else 0.0
        second = ms(r["ttft_s"].get("document, other instance's first question"), 50)
        lines.append(f"| {name} | {r['prompt_tokens']:.0f} | {r['computed']:.0f} | {share:.0%} | {ms(follow, 50)} / "
                     f"{ms(follow, 99)} | {ms(r['ttft_s'].get(turns[-1]), 50)} | {second} | "
                     f"{ms(r['ttft_s'].get('document question'), 50)} / {ms(r['ttft_s'].get('document question'), 99)} "
                     f"| {r['requests'] / r['wall_s']:.2f} | {moved} | {rate} |")
    lines += ["", "TTFT p50 by turn (ms):", "", "| fleet | " + " | ".join(turns) + " |",
              "|---|" + "---:|" * len(turns)]
    for name, r in results.items():
        lines.append(f"| {name} | " + " | ".join(ms(r["ttft_s"].get(t), 50) for t in turns) + " |")
    if bare:
        sizes = [n for r in results.values() for n in r["pool_load_blocks"]]
        lines.append(f"\nBare engine: Mooncake Store's own batch_get_into of the same loads ({len(sizes)} loads, "
                     f"{sum(sizes)} objects of one block each), from a process on core 1 of objects a process on core "
                     f"0 put, placed by the master as the instances' are: {bare:.2f} GB/s. Pool load GB/s: the "
                     "connector's pool load histogram (get, check, copy into the KV cache), all loads together.")
        if layer2:
            lines.append(f"\nLike for like, in the same two processes and with the same client, each load in turn: "
                         f"this project's MooncakeStore (the same get, a copy out of the registered memory and the "
                         f"tag check) {layer2:.2f} GB/s, **{layer2 / bare:.2f}x** the bare engine's "
                         f"{bare:.2f} GB/s. Inside vLLM a load shares the box's two cores with vLLM's own busy-waiting "
                         "engine loop (its EngineCore spends ~65% of a core while a request waits for its KV, with "
                         "vLLM's store connector as with ours) and the holder's sending, which the bare processes do "
                         "not.")
    if any(r["counts"]["load_failures"] for r in results.values()):
        lines.append("\nLoad failures: " + ", ".join(f"{n} {r['counts']['load_failures']:.0f}"
                                                   for n, r in results.items() if r["counts"]["load_failures"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleets", nargs="+", default=list(FLEETS), choices=FLEETS)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=512)
    parser.add_argument("--user", type=int, default=512)
    parser.add_argument("--answer", type=int, default=48)
    parser.add_argument("--document", type=int, default=2048)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--questions", type=int, default=4, help="per document")
    parser.add_argument("--seed", type=int, default=49)
    parser.add_argument("--model", default="kv32k")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU computes it natively")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the instances' logs there (default: a "
                        "temporary directory)")
    parser.add_argument("--table-of", type=Path, default=None, help="print the table of a result file written "
                        "before (its own run's settings), and write nothing")
    args = parser.parse_args()
    if args.table_of is not None:
        kept = json.loads(args.table_of.read_text())
        cpu = kept["cpu"]
        header = (f"# {TITLE}\n\ncommit {kept['commit']}, {kept['when']}; `{kept['command']}` (table: "
                  f"`bench_pool.py --table-of {args.table_of.name}` at {common.commit()})\n\nCPU: {cpu['model']}, "
                  f"{cpu['cores']} cores, flags {' '.join(cpu['flags'])}; dtype {kept['dtype']}\n")
        print(report(kept["results"], kept["bare_store_gbps"], argparse.Namespace(**kept["args"]), kept["dtype"],
                     header, kept.get("layer2_gbps")))
        return
    dtype = args.dtype or common.native_dtype()
    model = build_model(args.model, quiet=True)
    serve_args = serve_args_for(dtype)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-pool-") as tmp:
        for name in args.fleets:
            print(f"{name}: starting ...", flush=True)
            fleet = start(name, model, (args.work_dir or Path(tmp)) / name, serve_args)
            try:
                results[name] = run_workloads(fleet, args)
            finally:
                fleet.stop()
            results[name]["pool_load_blocks"] = pool_loads((args.work_dir or Path(tmp)) / name)
            print(f"{name}: {results[name]['computed']:.0f} tokens computed of {results[name]['prompt_tokens']:.0f}",
                  flush=True)
    sizes = [n for r in results.values() for n in r["pool_load_blocks"]]
    row = BLOCK * KV_PER_TOKEN * (2 if dtype == "float32" else 1)
    bare, layer2 = bare_store_rate(sizes, row) if sizes else (None, None)
    table = report(results, bare, args, dtype, layer2=layer2)
    print(table)
    common.write("bench_pool", {"dtype": dtype, "args": {k: v for k, v in vars(args).items()
                                                          if k not in ("out_dir", "work_dir")},
                                "bare_store_gbps": bare, "layer2_gbps": layer2, "results": results}, table,
                 args.out_dir)


if __name__ == "__main__":
    socket.setdefaulttimeout(300)
    main()
