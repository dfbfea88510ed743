"""One pull load at a time inside vLLM, each next to a bare-pipe transfer of the same bytes, interleaved.

A producer (core 0) and a consumer (core 1) serve the realistic-KV tiny model (``kv32k``: 8 layers, 32 KiB of KV per
token in bfloat16) with our connector in pull mode (``load_concurrency`` 1), after one untimed warm-up round of 4
loads. Each of ``--rounds`` rounds: a fresh ``--tokens``-token prompt is prefilled on the producer, then its decode
request (``max_tokens`` 1) goes to the consumer, where nothing is cached. "in vLLM" is the connector's own timing of
that load, from its load line (its request to the producer, the producer's lookup, the transfer straight into the KV
cache blocks). Then "bare pipe": the same bytes through a ``MooncakePipe`` kept up between two processes (sender on
core 0, receiver on core 1, each pinned with all its threads as the instances' workers; the worker's GIL switch
interval and the vLLM pair's pipe settings), timed from the receiver's request to the bytes being in one contiguous
buffer registered once as a receive region. Interleaved, so the machine's drifts hit both.

Goal (issue #17): a single pull load of 96 MiB (3072 tokens) in vLLM at >= 0.7x the bare pipe's throughput.

Run (from the repository root; ~3 minutes for 20 rounds)::

    .venv/bin/python benchmarks/bench_loads_single.py --rounds 20
    .venv/bin/python benchmarks/bench_loads_single.py --rounds 3 --tokens 1024   # shorter

Prints a markdown table and writes bench_loads_single.json / .md to ``--out-dir`` (default benchmarks/results).
(Before the split of issue #26 this was ``bench_loads.py --single ROUNDS``.)
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
from benchmarks.support.bare_pipe import BarePipe  # noqa: E402
from benchmarks.support.loads_pair import (  # noqa: E402
    BLOCK,
    ROW_BYTES,
    in_vllm_round,
    prepare,
    single_load,
    start,
    stats,
)
from harness.vllm import VllmServer  # noqa: E402

SINGLE_GOAL = 0.7


def single_loads(producer: VllmServer, consumer: VllmServer, cfg: dict[str, Any], tokens: int, rounds: int,
                 rng: random.Random) -> list[dict[str, float]]:
    """``rounds`` single pull loads of a ``tokens``-token prompt in vLLM (the connector's own timing of the load: the
    request to the producer and the transfer into the KV cache blocks), each followed by a bare-pipe transfer of the
    same bytes."""
    bare = BarePipe(cfg, (-(-tokens // BLOCK)) * ROW_BYTES)
    out = []
    try:
        for r in range(rounds):
            prompt = [rng.randrange(10, 7000) for _ in range(tokens)]
            before = stats(consumer)
            ms = single_load(producer, consumer, prompt, f"round {r}", timeout=10)[0]
            nbytes = stats(consumer).get("fetched_bytes", 0) - before.get("fetched_bytes", 0)
            bare_ms = bare.transfer(int(nbytes)) * 1e3
            out.append({"bytes": nbytes, "vllm_ms": ms, "bare_ms": bare_ms, "ratio": bare_ms / ms})
            print(f"single load {r}: {nbytes / 2**20:.0f} MiB, in vLLM {ms:.1f} ms ({nbytes / ms / 1e6:.2f} GB/s), bare "
                  f"pipe {bare_ms:.1f} ms ({nbytes / bare_ms / 1e6:.2f} GB/s), ratio {bare_ms / ms:.2f}", flush=True)
    finally:
        bare.close()
    return out


def single_markdown(rows: list[dict[str, float]], tokens: int, dtype: str) -> str:
    med = {k: statistics.median(r[k] for r in rows) for k in ("bytes", "vllm_ms", "bare_ms", "ratio")}
    ratios = sorted(r["ratio"] for r in rows)
    return "\n".join([
        common.header("One pull load inside vLLM vs the bare pipe, interleaved (bench_loads_single.py)", dtype), "",
        f"Each round: a fresh {tokens}-token prompt prefilled on the producer, then its decode request on the consumer "
        "(nothing cached there): *in vLLM* is the connector's own timing of that load (its request to the producer, "
        "the producer's lookup, the transfer straight into the KV cache blocks); then *bare pipe*: the same bytes "
        "through a MooncakePipe kept up between two processes (sender on core 0, receiver on core 1, as the "
        "instances' workers; GIL switch interval 0.1 ms and the same pipe settings for both), timed from the "
        "receiver's request to the bytes being in one contiguous buffer registered once as a receive region (the "
        "connector's KV cache is too, but its load fills one region per block and layer). "
        "Interleaved, so the machine's drifts hit both.", "",
        "| rounds | MiB per load | in vLLM ms (p50) | GB/s | bare pipe ms (p50) | GB/s | in vLLM / bare pipe "
        "(p50 of the rounds' ratios) | min - max of the ratios |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(rows)} | {med['bytes'] / 2**20:.0f} | {med['vllm_ms']:.1f} | {med['bytes'] / med['vllm_ms'] / 1e6:.2f} | "
        f"{med['bare_ms']:.1f} | {med['bytes'] / med['bare_ms'] / 1e6:.2f} | **{med['ratio']:.2f}** | "
        f"{ratios[0]:.2f} - {ratios[-1]:.2f} |", "",
        f"Goal (issue #17): a single pull load of 96 MiB in vLLM at >= {SINGLE_GOAL}x the bare pipe's throughput for "
        f"the same bytes: **{'met' if med['ratio'] >= SINGLE_GOAL else 'NOT met'}**.", ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="single loads, each next to a bare-pipe transfer")
    parser.add_argument("--tokens", type=int, default=3072, help="tokens of every prompt (default 3072: 96 MiB of KV)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU computes it natively")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    dtype = prepare(args.dtype)
    if dtype is None:
        return 2
    rng = random.Random(1234)
    with tempfile.TemporaryDirectory(prefix="bench-loads-") as tmp:
        producer, consumer = start(Path(tmp), dtype, 1, 4)
        try:
            in_vllm_round(producer, consumer, 4, random.Random(99), longest=True)  # warm-up
            cfg = json.loads((Path(tmp) / "mooncake.json").read_text())
            single = single_loads(producer, consumer, cfg, args.tokens, args.rounds, rng)
        finally:
            producer.stop()
            consumer.stop()
    table = single_markdown(single, args.tokens, dtype)
    print(table)
    common.write("bench_loads_single", {"dtype": dtype, "tokens": args.tokens, "rounds": single, "goal": SINGLE_GOAL},
                 table, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
