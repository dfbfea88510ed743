"""SimpleBuffer benchmark: lookup cost vs. entries held, and KV-sized throughput vs. the bare pipe.

Two real processes on 127.0.0.1 (the producer is a spawned child, this process the consumer), real MooncakePipe:

1. ``drop_select`` latency with 1, 1 000 and 10 000 entries held (64-token keys, tiny tensors): a miss (the query
   matches nothing: index lookup + one round trip) and a hit (takes one of 100 extra probe entries). The index is
   hashed by token prefix, so both should stay flat as entries grow.
2. Throughput of KV-sized entries (key and value 32 MiB each, 1024 tokens): the producer ``insert``s them (a copy
   each, into a buffer that holds 4) while the consumer ``drop_select``s them, against the bare pipe sending the
   same five tensors per entry when asked. The two run side by side in the same two processes, in alternating
   bursts (see ``kv_throughput``): this VM's speed drifts by up to 2x within minutes, which made separate runs
   disagree (0.4-1.6x) more than the two modes differ. Target: buffer >= 0.9x the bare pipe.

Lookup latencies are pooled over ``--rounds`` rounds. Run::

    .venv/bin/python benchmarks/bench_buffer.py [--rounds 3] [--bursts 12] [--burst 4] [--out-dir benchmarks/results]

Prints markdown tables and writes ``bench_buffer.json``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
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
HOLD = 4  # KV entries the producer's buffer holds in the throughput test
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


def produce_kv(cfg_buffer: dict[str, Any], cfg_pipe: dict[str, Any], entries: int, inserted: Any, insert_end: Any,
               done: Any) -> None:
    """Both producers of the throughput test, in one process.

    Buffer: insert ``entries`` KV entries, one after the other, into a buffer that holds ``HOLD`` of them; each
    insert beyond that waits until the consumer takes one. ``inserted`` counts finished inserts and ``insert_end``
    holds when the last one finished (``time.perf_counter``: CLOCK_MONOTONIC, the same clock in every process).
    Bare pipe (a second pipe pair): a thread sends the same five tensors of one entry whenever the consumer asks."""
    key = torch.full((KV_BYTES // 2,), 1.0, dtype=torch.bfloat16)
    value = key.neg()
    with open_pipe(cfg_buffer, 0) as pipe, open_pipe(cfg_pipe, 0) as bare:
        def serve_bare() -> None:
            while (ask := bare.recv_tensor(timeout=300)) is not None:
                for t in (kv_tokens(int(ask)), None, key, value, None):
                    bare.send_tensor(t)

        server = threading.Thread(target=serve_bare, daemon=True)
        server.start()
        buf = SimpleBuffer(pipe, pipe, HOLD * (2 * KV_BYTES + KV_TOKENS * 8), timeout=300)
        for i in range(entries):
            buf.insert(kv_tokens(i), None, key, value, None)  # a copy each time (insert's contract)
            insert_end.value = time.perf_counter()
            inserted.value = i + 1
        server.join(timeout=300)
        done.wait(300)


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


def kv_throughput(bursts: int, burst: int) -> dict[str, Any]:
    """Buffer and bare pipe measured side by side, in the same two processes, in alternating bursts of ``burst``
    entries (after one untimed burst of each): the host's speed drifts by 2x within minutes here, and
    interleaving makes both modes see the same drift.

    A buffer burst lasts from its first ``drop_select`` until the last entry arrived *and* the producer finished
    the inserts that refill the buffer (they run concurrently, as in real use; their copies are part of the cost).
    A bare-pipe burst: the consumer asks for an entry (one small tensor) and receives the five tensors, ``burst``
    times. Ratio = bare-pipe time / buffer time over all timed bursts (and the median of per-burst ratios)."""
    per_entry = 2 * KV_BYTES + KV_TOKENS * 8
    entries = HOLD + (bursts + 1) * burst
    cfg_buffer, cfg_pipe = make_config(timeout=120.0), make_config(timeout=120.0)
    inserted, insert_end, done = _ctx.Value("i", 0), _ctx.Value("d", 0.0), _ctx.Event()
    child = run_child(produce_kv, cfg_buffer, cfg_pipe, entries, inserted, insert_end, done)
    times: dict[str, list[float]] = {"buffer": [], "pipe": []}
    try:
        with open_pipe(cfg_buffer, 1) as pipe, open_pipe(cfg_pipe, 1) as bare:
            buf = SimpleBuffer(pipe, pipe, 1 << 30, role="consumer")
            taken = 0

            def wait_inserted(n: int) -> None:
                deadline = time.monotonic() + 300
                while inserted.value < n:
                    assert time.monotonic() < deadline and child.is_alive(), "the producer stopped inserting"
                    time.sleep(0.001)

            for b in range(bursts + 1):
                wait_inserted(min(entries, taken + HOLD))  # the buffer is full: nothing of it runs during the pipe burst
                start = time.perf_counter()
                for _ in range(burst):
                    got = bare_entry = None
                    bare.send_tensor(torch.tensor(taken, dtype=torch.int64))
                    bare_entry = [bare.recv_tensor(timeout=120) for _ in range(5)]
                    assert bare_entry[2] is not None and bare_entry[2].numel() * 2 == KV_BYTES, "bare pipe: entry missing"
                pipe_time = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(burst):
                    got = buf.drop_select(kv_tokens(taken), None)
                    assert got[2] is not None and got[2].numel() * 2 == KV_BYTES, f"buffer: entry {taken} missing"
                    taken += 1
                received = time.perf_counter()
                wait_inserted(min(entries, taken + HOLD))
                buffer_time = max(received, insert_end.value) - start
                del got, bare_entry
                if b:  # the first burst of each warms up connections, staging and the allocator
                    times["pipe"].append(pipe_time)
                    times["buffer"].append(buffer_time)
            bare.send_tensor(None)
            done.set()
            child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
    moved = bursts * burst * per_entry
    return {
        "buffer_gbps": moved / sum(times["buffer"]) / 1e9,
        "pipe_gbps": moved / sum(times["pipe"]) / 1e9,
        "ratio": sum(times["pipe"]) / sum(times["buffer"]),
        "ratio_median_burst": statistics.median(p / b for p, b in zip(times["pipe"], times["buffer"], strict=True)),
        "bursts": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="lookup rounds (default 3)")
    parser.add_argument("--bursts", type=int, default=12, help="timed throughput bursts per mode (default 12)")
    parser.add_argument("--burst", type=int, default=4, help="KV entries per burst (default 4)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)

    lat: dict[int, dict[str, list[float]]] = {n: {"miss": [], "hit": []} for n in HELD}
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
    thr = kv_throughput(args.bursts, args.burst)

    def us(samples: list[float], q: float) -> float:
        return statistics.quantiles(samples, n=100)[q - 1] * 1e6 if q != 50 else statistics.median(samples) * 1e6

    print("\n| entries held | miss p50 us | miss p90 us | hit p50 us | hit p90 us |\n|---:|---:|---:|---:|---:|")
    for held in HELD:
        m, h = lat[held]["miss"], lat[held]["hit"]
        print(f"| {held} | {us(m, 50):.0f} | {us(m, 90):.0f} | {us(h, 50):.0f} | {us(h, 90):.0f} |")
    entries = args.bursts * args.burst
    print(f"\n| {entries} KV entries (2 x 32 MiB) each way, in {args.bursts} alternating bursts | GB/s |\n|---|---:|")
    print(f"| buffer: insert (copy) -> drop_select | {thr['buffer_gbps']:.2f} |")
    print(f"| bare pipe: send_tensor -> recv_tensor | {thr['pipe_gbps']:.2f} |")
    print(f"| buffer / bare pipe | {thr['ratio']:.2f} (median of per-burst ratios {thr['ratio_median_burst']:.2f}) |")
    flat = us(lat[HELD[-1]]["miss"], 50) / us(lat[HELD[0]]["miss"], 50)
    print(f"\nTargets: lookup flat (miss p50 at {HELD[-1]} / at {HELD[0]} entries = {flat:.2f}); "
          f"buffer >= {TARGET}x bare pipe: {'MET' if thr['ratio'] >= TARGET else 'NOT MET'} ({thr['ratio']:.2f})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench_buffer.json"
    out.write_text(json.dumps({
        "benchmark": "bench_buffer", "date": datetime.now(UTC).isoformat(timespec="seconds"), "rounds": args.rounds,
        "loadavg_end": os.getloadavg(),
        "lookup_us": {str(n): {k: {"p50": us(v, 50), "p90": us(v, 90), "samples": len(v)} for k, v in d.items()}
                      for n, d in lat.items()},
        "throughput": thr,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
