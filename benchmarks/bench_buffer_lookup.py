"""SimpleBuffer lookup cost vs entries held: ``drop_select`` latency with 1, 1 000 and 10 000 entries.

Two real processes on 127.0.0.1 (the producer is a spawned child, this process the consumer), real MooncakePipe. The
producer's buffer holds 1, then 1 000, then 10 000 filler entries (64-token keys, tiny tensors, never asked for) plus
100 probe entries; the consumer times ``drop_select``: a miss (the query matches nothing: index lookup + one round
trip) and a hit (takes one of the probe entries). Latencies are pooled over ``--rounds`` rounds, each with a fresh
pair of processes. Target: the index is hashed by token prefix, so both stay flat as entries grow (miss p50 at
10 000 entries / at 1 entry close to 1).

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_buffer_lookup.py [--rounds 3] [--out-dir benchmarks/results]

Prints a markdown table and writes ``bench_buffer_lookup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.support import common, procs  # noqa: E402
from harness.pipes import make_config, open_pipe  # noqa: E402
from kv_lookup_buffer import SimpleBuffer  # noqa: E402

HELD = (1, 1000, 10_000)
PROBES = 100


def small_entry(i: int, probe: bool) -> tuple[torch.Tensor, ...]:
    tokens = torch.arange(64, dtype=torch.int64) + (i * 64 + (10_000_000 if probe else 0))
    return tokens, None, torch.full((16,), float(i)), torch.full((16,), -float(i)), None


# ----------------------------------------------------------------------------- producer (child process)
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


def us(samples: list[float], q: float) -> float:
    return common.percentile(samples, q) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each with a fresh pair of processes (default 3)")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args(argv)

    lat: dict[int, dict[str, list[float]]] = {n: {"miss": [], "hit": []} for n in HELD}
    for rnd in range(args.rounds):
        cfg = make_config(timeout=120.0)
        commands, replies = procs.SPAWN.Queue(), procs.SPAWN.Queue()
        child = procs.SPAWN.Process(target=produce_lookup, args=(cfg, commands, replies), daemon=True)
        child.start()
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

    print("\n| entries held | miss p50 us | miss p90 us | hit p50 us | hit p90 us |\n|---:|---:|---:|---:|---:|")
    for held in HELD:
        m, h = lat[held]["miss"], lat[held]["hit"]
        print(f"| {held} | {us(m, 50):.0f} | {us(m, 90):.0f} | {us(h, 50):.0f} | {us(h, 90):.0f} |")
    flat = us(lat[HELD[-1]]["miss"], 50) / us(lat[HELD[0]]["miss"], 50)
    print(f"\nTarget: lookup flat (miss p50 at {HELD[-1]} / at {HELD[0]} entries = {flat:.2f})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench_buffer_lookup.json"
    out.write_text(json.dumps({
        "benchmark": "bench_buffer_lookup", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": common.commit(), "command": common.command(), "rounds": args.rounds, "loadavg_end": os.getloadavg(),
        "lookup_us": {str(n): {k: {"p50": us(v, 50), "p90": us(v, 90), "samples": len(v)} for k, v in d.items()}
                      for n, d in lat.items()},
        "miss_p50_ratio": flat,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
