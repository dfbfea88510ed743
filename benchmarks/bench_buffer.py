"""SimpleBuffer benchmark: lookup cost vs. entries held, and KV-sized throughput vs. the bare pipe.

Two real processes on 127.0.0.1 (the producer is a spawned child, this process the consumer), real MooncakePipe:

1. ``drop_select`` latency with 1, 1 000 and 10 000 entries held (64-token keys, tiny tensors): a miss (the query
   matches nothing: index lookup + one round trip) and a hit (takes one of 100 extra probe entries). The index is
   hashed by token prefix, so both should stay flat as entries grow.
2. Throughput of KV-sized entries (key and value 32 MiB each, 1024 tokens): the producer ``insert``s them in a
   thread (buffer threshold: 4 entries) while the consumer ``drop_select``s them, against the bare pipe sending
   the same five tensors per entry, after one untimed warm-up entry each. Target: buffer >= 0.9x the bare pipe.

Every measurement is repeated in ``--rounds`` rounds (samples pooled; throughput: median of rounds, the two modes
in alternating order; the ratio is the median of the per-round ratios). Run::

    .venv/bin/python benchmarks/bench_buffer.py [--rounds 3] [--entries 16] [--out-dir benchmarks/results]

Prints markdown tables and writes ``bench_buffer.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from kv_lookup_buffer import SimpleBuffer  # noqa: E402
from tests.kv_pipe.peers import make_config, open_pipe  # noqa: E402

MiB = 1 << 20
HELD = (1, 1000, 10_000)
PROBES = 100
KV_BYTES = 32 * MiB
KV_TOKENS = 1024
TARGET = 0.9
_ctx = mp.get_context("spawn")


def small_entry(i: int, probe: bool) -> tuple[torch.Tensor, ...]:
    tokens = torch.arange(64, dtype=torch.int64) + (i * 64 + (10_000_000 if probe else 0))
    return tokens, None, torch.full((16,), float(i)), torch.full((16,), -float(i)), None


def kv_tokens(i: int) -> torch.Tensor:
    return torch.arange(KV_TOKENS, dtype=torch.int64) + i * KV_TOKENS


def kv_entry(i: int) -> tuple[Any, ...]:
    key = torch.full((KV_BYTES // 2,), float(i), dtype=torch.bfloat16)
    return kv_tokens(i), None, key, key.neg(), None


# ----------------------------------------------------------------------------- producers (child processes)
def produce_lookup(cfg: dict[str, Any], commands: Any, replies: Any) -> None:
    """Hold 1, 1000, ... fillers (never asked for) plus PROBES probe entries, on command."""
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 64 << 30)
        buf.start_serving()
        fillers = 0
        while (held := commands.get()) is not None:
            while fillers < held:
                buf.insert(*small_entry(fillers, probe=False))
                fillers += 1
            for i in range(PROBES):
                buf.insert(*small_entry(i, probe=True))
            replies.put(len(buf))


def produce_kv(cfg: dict[str, Any], entries: int, ready: Any, done: Any) -> None:
    """Insert KV entries into a buffer that holds 4 of them (made beforehand, untimed): once it is full (``ready``),
    each further insert waits until the consumer takes one."""
    kv = [kv_entry(i) for i in range(entries)]
    with open_pipe(cfg, 0) as pipe:
        buf = SimpleBuffer(pipe, pipe, 4 * (2 * KV_BYTES + KV_TOKENS * 8), timeout=120)
        for i, entry in enumerate(kv):
            buf.insert(*entry)
            if i + 1 == min(4, entries):
                ready.set()
        done.wait(120)


def produce_pipe(cfg: dict[str, Any], entries: int, ready: Any, done: Any) -> None:
    """The same five tensors per entry over the bare pipe (made beforehand, untimed)."""
    kv = [kv_entry(i) for i in range(entries)]
    with open_pipe(cfg, 0) as pipe:
        ready.set()
        for entry in kv:
            for t in entry:
                pipe.send_tensor(t)
        done.wait(120)


def run_child(target: Any, *args: Any) -> mp.Process:
    child = _ctx.Process(target=target, args=args, daemon=True)
    child.start()
    return child


# ----------------------------------------------------------------------------- consumer (this process)
def lookup_latencies(buf: SimpleBuffer, held: int) -> dict[str, list[float]]:
    miss, hit = [], []
    for i in range(PROBES):
        query = small_entry(10 * held + i + 123_456, probe=False)[0] + 5_000_000  # matches nothing
        start = time.perf_counter()
        got = buf.drop_select(query, None)
        miss.append(time.perf_counter() - start)
        assert got[0] is None
    for i in range(PROBES):
        start = time.perf_counter()
        got = buf.drop_select(small_entry(i, probe=True)[0], None)
        hit.append(time.perf_counter() - start)
        assert got[2] is not None and float(got[2][0]) == float(i)
    return {"miss": miss, "hit": hit}


def kv_throughput(entries: int, order: tuple[str, ...] = ("buffer", "pipe")) -> dict[str, float]:
    """Both modes move ``entries`` KV entries after one untimed warm-up entry (connections, staging, allocator)."""
    per_entry = 2 * KV_BYTES + KV_TOKENS * 8
    seconds = {}
    for mode in order:
        cfg, ready, done = make_config(timeout=120.0), _ctx.Event(), _ctx.Event()
        child = run_child(produce_kv if mode == "buffer" else produce_pipe, cfg, entries + 1, ready, done)
        try:
            with open_pipe(cfg, 1) as pipe:
                buf = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
                assert ready.wait(300), f"{mode}: the producer did not get ready"
                for i in range(entries + 1):
                    if i == 1:
                        start = time.perf_counter()
                    if mode == "buffer":
                        got = buf.drop_select(kv_tokens(i), None)
                    else:
                        got = [pipe.recv_tensor(timeout=120) for _ in range(5)]
                    assert got[2] is not None and got[2].numel() * 2 == KV_BYTES, f"{mode}: entry {i} missing"
                seconds[mode] = time.perf_counter() - start
                done.set()
                child.join(timeout=60)
        finally:
            if child.is_alive():
                child.kill()
    return {f"{mode}_gbps": entries * per_entry / s / 1e9 for mode, s in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--entries", type=int, default=16, help="KV entries per throughput round (default 16)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    lat: dict[int, dict[str, list[float]]] = {n: {"miss": [], "hit": []} for n in HELD}
    thr: list[dict[str, float]] = []
    for rnd in range(args.rounds):
        cfg = make_config(timeout=120.0)
        commands, replies = _ctx.Queue(), _ctx.Queue()
        child = run_child(produce_lookup, cfg, commands, replies)
        try:
            with open_pipe(cfg, 1) as pipe:
                buf = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
                for held in HELD:
                    commands.put(held)
                    print(f"round {rnd + 1}: {replies.get(timeout=300)} entries held", flush=True)
                    for kind, samples in lookup_latencies(buf, held).items():
                        lat[held][kind] += samples
                commands.put(None)
                child.join(timeout=60)
        finally:
            if child.is_alive():
                child.kill()
        thr.append(kv_throughput(args.entries, ("buffer", "pipe") if rnd % 2 == 0 else ("pipe", "buffer")))
        print(f"round {rnd + 1}: buffer {thr[-1]['buffer_gbps']:.2f} GB/s, pipe {thr[-1]['pipe_gbps']:.2f} GB/s", flush=True)

    def us(samples: list[float], q: float) -> float:
        return statistics.quantiles(samples, n=100)[q - 1] * 1e6 if q != 50 else statistics.median(samples) * 1e6

    print("\n| entries held | miss p50 us | miss p90 us | hit p50 us | hit p90 us |\n|---:|---:|---:|---:|---:|")
    for held in HELD:
        m, h = lat[held]["miss"], lat[held]["hit"]
        print(f"| {held} | {us(m, 50):.0f} | {us(m, 90):.0f} | {us(h, 50):.0f} | {us(h, 90):.0f} |")
    buffer_gbps = statistics.median(t["buffer_gbps"] for t in thr)
    pipe_gbps = statistics.median(t["pipe_gbps"] for t in thr)
    ratio = statistics.median(t["buffer_gbps"] / t["pipe_gbps"] for t in thr)  # each round compares like with like
    print("\n| round | buffer insert->drop_select GB/s | bare pipe GB/s | buffer/pipe |\n|---|---:|---:|---:|")
    for rnd, t in enumerate(thr, 1):
        print(f"| {rnd} | {t['buffer_gbps']:.2f} | {t['pipe_gbps']:.2f} | {t['buffer_gbps'] / t['pipe_gbps']:.2f} |")
    print(f"| median ({args.entries} KV entries of 2 x 32 MiB per round) | {buffer_gbps:.2f} | {pipe_gbps:.2f} | {ratio:.2f} |")
    flat = us(lat[HELD[-1]]["miss"], 50) / us(lat[HELD[0]]["miss"], 50)
    print(f"\nTargets: lookup flat (miss p50 at {HELD[-1]} / at {HELD[0]} entries = {flat:.2f}); "
          f"buffer >= {TARGET}x bare pipe: {'MET' if ratio >= TARGET else 'NOT MET'} ({ratio:.2f})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench_buffer.json"
    out.write_text(json.dumps({
        "benchmark": "bench_buffer", "date": datetime.now(UTC).isoformat(timespec="seconds"), "rounds": args.rounds,
        "loadavg_end": os.getloadavg(),
        "lookup_us": {str(n): {k: {"p50": us(v, 50), "p90": us(v, 90), "samples": len(v)} for k, v in d.items()}
                      for n, d in lat.items()},
        "throughput": {"rounds": thr, "buffer_gbps": buffer_gbps, "pipe_gbps": pipe_gbps, "ratio": ratio},
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
