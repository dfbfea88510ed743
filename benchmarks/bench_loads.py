"""Concurrent loads inside vLLM, next to the bare pipe moving the same bytes, in one run.

A producer (core 0) and a consumer (core 1) serve the realistic-KV tiny model (``kv32k``: 8 layers, 32 KiB of KV per
token in bfloat16) with our connector in pull mode. For each number of requests in flight N (16, 64):

1. N fresh prompts of 1024-3072 tokens (uniform) are prefilled on the producer, which keeps their KV;
2. the N decode requests (``max_tokens`` 1) go to the consumer at once; it claims N loads, which run
   ``load_concurrency`` at a time (each: request to the producer, transfer straight into the KV cache blocks);
3. "in vLLM": the KV bytes the consumer fetched (its ``vllm:mooncake_kv_fetched_bytes`` counter) over the wall time
   from sending the requests until its ``loaded`` counter reached N (polled every 10 ms).

"bare pipe": the same N tensors (the same byte sizes) sent back to back through a ``MooncakePipe`` from one process to
another, each received into a reused buffer (one copy per byte, as the connector's write into its blocks); bytes over
the time from the receiver's "go" to the last tensor received. Both sides with the worker's GIL switch interval (0.1
ms), one sender, the same pipe settings (chunk size, writes in flight) as the vLLM pair's mooncake.json. Like-for-
like, the sender runs on core 0 and the receiver on core 1, as the vLLM instances' workers (and every thread they
start) are pinned; the same transfer with both processes free to use both cores is shown too.

Each load_concurrency setting starts with a warm-up round (not counted) in which the consumer's receive buffers grow
to the largest entry, as they do once in a long-running instance.

Run (from the repository root; ~10 minutes)::

    .venv/bin/python benchmarks/bench_loads.py
    .venv/bin/python benchmarks/bench_loads.py --in-flight 16 --load-concurrency 4 --rounds 1   # shorter

Prints a markdown table and writes bench_loads.json / bench_loads.md to ``--out-dir`` (default benchmarks/results).
Goal (issue #14): in-vLLM aggregate >= 0.5x the bare pipe at 16 and 64 requests in flight.

One load at a time, each next to a bare-pipe transfer of the same bytes: ``benchmarks/bench_loads_single.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from benchmarks.support.bare_pipe import bare_pipe_round  # noqa: E402
from benchmarks.support.loads_pair import in_vllm_round, load_timings, prepare, start  # noqa: E402

GOAL = 0.5


# ----------------------------------------------------------------------------- run
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--load-concurrency", type=int, nargs="+", default=[1, 4],
                        help="the consumer's load_concurrency values to run (1: one load at a time, as before #14)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None, help="every prompt this long (default: 1024-3072)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU computes it natively")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    dtype = prepare(args.dtype)
    if dtype is None:
        return 2
    rng = random.Random(1234)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-loads-") as tmp:
        for concurrency in args.load_concurrency:
            work = Path(tmp) / f"c{concurrency}"
            work.mkdir()
            producer, consumer = start(work, dtype, concurrency, max(args.in_flight))
            try:
                in_vllm_round(producer, consumer, max(concurrency, 4), random.Random(99), longest=True)  # warm-up
                cfg = json.loads((work / "mooncake.json").read_text())
                for n in args.in_flight:
                    for r in range(args.rounds):
                        seen = len(load_timings(consumer.log, 0))
                        result = in_vllm_round(producer, consumer, n, rng, tokens=args.tokens)
                        timings = load_timings(consumer.log, seen)
                        result["load_ms"] = {name: statistics.median(t[i] for t in timings) if timings else None
                                             for i, name in enumerate(("total", "fetch", "copy"))}
                        sizes = result.pop("sizes")
                        bare = bare_pipe_round(cfg, sizes, pinned=True)
                        free = bare_pipe_round(cfg, sizes, pinned=False)
                        row = {"load_concurrency": concurrency, "round": r, "in_vllm": result, "bare_pipe": bare,
                               "bare_pipe_unpinned": free, "ratio": result["GBps"] / bare["GBps"]}
                        rows.append(row)
                        print(f"concurrency {concurrency}, {n} in flight, round {r}: in vLLM {result['GBps']:.2f} GB/s "
                              f"({result['loaded']:.0f} loaded, {result['bytes'] / 2**20:.0f} MiB in "
                              f"{result['seconds']:.2f} s; median load {result['load_ms']}), bare pipe "
                              f"{bare['GBps']:.2f} GB/s pinned, {free['GBps']:.2f} unpinned, ratio {row['ratio']:.2f}",
                              flush=True)
            finally:
                producer.stop()
                consumer.stop()
    table = markdown(rows, args, dtype)
    print(table)
    common.write("bench_loads", {"dtype": dtype, "rows": rows, "goal": GOAL}, table, args.out_dir)
    return 0


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace, dtype: str) -> str:
    lines = [common.header("Concurrent loads inside vLLM vs the bare pipe (bench_loads.py)", dtype), "",
             "In vLLM: KV bytes the consumer fetched / wall time from sending N decode requests at once until its N "
             "loads ended (each: request, transfer into the KV cache blocks). Bare pipe: the same N tensors through a "
             "MooncakePipe between two processes, received into a reused buffer. kv32k model, prompts of 1024-3072 "
             "tokens (32-96 MiB of KV each), nothing cached on the consumer.", "",
             "| load_concurrency | in flight | rounds | MiB per round | median load ms (fetch + copy) | in vLLM GB/s "
             "| bare pipe GB/s, pinned as vLLM (unpinned) | in vLLM / bare pinned |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for concurrency in args.load_concurrency:
        for n in args.in_flight:
            group = [r for r in rows if r["load_concurrency"] == concurrency and r["in_vllm"]["n"] == n]
            if not group:
                continue
            ms = [r["in_vllm"]["load_ms"] for r in group if r["in_vllm"]["load_ms"]["total"] is not None]
            timing = (f"{statistics.median(m['total'] for m in ms):.0f} ({statistics.median(m['fetch'] for m in ms):.0f} "
                      f"+ {statistics.median(m['copy'] for m in ms):.0f})") if ms else "-"
            lines.append(f"| {concurrency} | {n} | {len(group)} | "
                         f"{statistics.mean(r['in_vllm']['bytes'] for r in group) / 2**20:.0f} | {timing} | "
                         f"{statistics.median(r['in_vllm']['GBps'] for r in group):.2f} | "
                         f"{statistics.median(r['bare_pipe']['GBps'] for r in group):.2f} "
                         f"({statistics.median(r['bare_pipe_unpinned']['GBps'] for r in group):.2f}) | "
                         f"**{statistics.median(r['ratio'] for r in group):.2f}** |")
    failed = sum(r["in_vllm"]["failed"] for r in rows)
    wrong = sum(1 for r in rows if r["in_vllm"]["bytes"] != r["in_vllm"]["expected_bytes"])
    lines += ["", f"Goal: in vLLM >= {GOAL}x the bare pipe. Loads failed or missed: {failed:.0f}; rounds whose fetched "
              f"bytes differ from the blocks claimed: {wrong}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
