"""SimpleBuffer throughput with KV-sized entries, next to the bare pipe moving the same tensors.

Two real processes on 127.0.0.1 (the producer is a spawned child, this process the consumer), real MooncakePipe.
KV-sized entries (key and value 32 MiB each, 1024 tokens) go through three paths: the producer ``insert``s them into a
buffer that holds 4 (a copy each, insert's contract) while the consumer ``drop_select``s them; the same with
``insert(copy=False)`` (the buffer's own cost, without the copy); and the bare pipe sending the same five tensors per
entry when asked. All three run side by side in the same two processes, in rounds of alternating bursts (see
``kv_throughput``), so that the host's speed drifts hit every path alike. Target: buffer >= 0.9x the bare pipe
(the median of per-round ratios: one stalled burst moves the ratio of sums far more than the median).

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_buffer_throughput.py [--bursts 24] [--burst 4] [--out-dir benchmarks/results]

Prints a markdown table and writes ``bench_buffer_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks.support import common, procs  # noqa: E402
from harness.pipes import make_config, open_pipe  # noqa: E402
from kv_lookup_buffer import SimpleBuffer  # noqa: E402

MiB = 1 << 20
HOLD = 4  # KV entries the producer's buffer holds in the throughput test
KV_BYTES = 32 * MiB
KV_TOKENS = 1024
TARGET = 0.9


def kv_tokens(i: int) -> torch.Tensor:
    return torch.arange(KV_TOKENS, dtype=torch.int64) + i * KV_TOKENS


# ----------------------------------------------------------------------------- producer (child process)
MODES = ("pipe", "copy", "handover")  # bare pipe; buffer with insert's copy; buffer with insert(copy=False)


def produce_kv(cfgs: dict[str, dict[str, Any]], entries: int, inserted: dict[str, Any], insert_end: dict[str, Any],
               done: Any) -> None:
    """The three producers of the throughput test, in one process, each on its own pipe pair.

    Buffers ("copy": ``insert`` copies, its contract; "handover": ``insert(copy=False)`` keeps the tensors, the
    buffer's own cost without that copy): a thread per buffer inserts ``entries`` KV entries into a buffer that
    holds ``HOLD`` of them; each insert beyond that waits until the consumer takes one. ``inserted[mode]`` counts
    finished inserts and ``insert_end[mode]`` holds when the last one finished (``time.perf_counter``:
    CLOCK_MONOTONIC, the same clock in every process). Bare pipe: a thread sends the same five tensors of one entry
    whenever the consumer asks."""
    key = torch.full((KV_BYTES // 2,), 1.0, dtype=torch.bfloat16)
    value = key.neg()
    with open_pipe(cfgs["pipe"], 0) as bare, open_pipe(cfgs["copy"], 0) as p_copy, \
            open_pipe(cfgs["handover"], 0) as p_handover:
        def serve_bare() -> None:
            while (ask := bare.recv_tensor(timeout=300)) is not None:
                for t in (kv_tokens(int(ask)), None, key, value, None):
                    bare.send_tensor(t)

        def fill(mode: str, pipe: Any) -> None:
            buf = SimpleBuffer(pipe, pipe, HOLD * (2 * KV_BYTES + KV_TOKENS * 8), timeout=300)
            for i in range(entries):
                # handover: the same two tensors every time, as if the caller produced each entry in place
                buf.insert(kv_tokens(i), None, key, value, None, copy=mode == "copy")
                insert_end[mode].value = time.perf_counter()
                inserted[mode].value = i + 1
            done.wait(300)

        threads = [threading.Thread(target=serve_bare, daemon=True),
                   threading.Thread(target=fill, args=("copy", p_copy), daemon=True),
                   threading.Thread(target=fill, args=("handover", p_handover), daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)


# ----------------------------------------------------------------------------- consumer (this process)
def kv_throughput(bursts: int, burst: int) -> dict[str, Any]:
    """The bare pipe and the two buffers measured side by side, in the same two processes, in rounds of one burst
    of ``burst`` entries each (after one untimed round): a shared host's speed drifts within minutes, and
    interleaving makes every mode see the same drift (benchmarks/results/NOTES.md).

    A buffer burst lasts from its first ``drop_select`` until the last entry arrived *and* the producer finished
    the inserts that refill the buffer (they run concurrently, as in real use; with "copy" their copies are part
    of the cost). A bare-pipe burst: the consumer asks for an entry (one small tensor) and receives its five
    tensors, ``burst`` times. Every mode drops the entry it received before asking for the next. Ratio = bare-pipe
    time / buffer time over all timed bursts (and the median of per-round ratios)."""
    per_entry = 2 * KV_BYTES + KV_TOKENS * 8
    entries = HOLD + (bursts + 1) * burst
    cfgs = {mode: make_config(timeout=120.0) for mode in MODES}
    inserted = {mode: procs.SPAWN.Value("i", 0) for mode in MODES[1:]}
    insert_end = {mode: procs.SPAWN.Value("d", 0.0) for mode in MODES[1:]}
    done = procs.SPAWN.Event()
    child = procs.SPAWN.Process(target=produce_kv, args=(cfgs, entries, inserted, insert_end, done), daemon=True)
    child.start()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    try:
        with open_pipe(cfgs["pipe"], 1) as bare, open_pipe(cfgs["copy"], 1) as p_copy, \
                open_pipe(cfgs["handover"], 1) as p_handover:
            bufs = {mode: SimpleBuffer(p, p, 1 << 30, role="consumer")
                    for mode, p in (("copy", p_copy), ("handover", p_handover))}

            def wait_inserted(mode: str, n: int) -> None:
                deadline = time.monotonic() + 300
                while inserted[mode].value < min(entries, n):
                    assert time.monotonic() < deadline and child.is_alive(), f"{mode}: the producer stopped inserting"
                    time.sleep(0.001)

            for b in range(bursts + 1):
                taken = b * burst
                for mode in MODES[1:]:  # both buffers full: no insert runs during another mode's burst
                    wait_inserted(mode, taken + HOLD)
                got: list[torch.Tensor | None] | None = None
                start = time.perf_counter()
                for i in range(taken, taken + burst):
                    got = None
                    bare.send_tensor(torch.tensor(i, dtype=torch.int64))
                    got = [bare.recv_tensor(timeout=120) for _ in range(5)]
                    assert got[2] is not None and got[2].numel() * 2 == KV_BYTES, "bare pipe: entry missing"
                took = {"pipe": time.perf_counter() - start}
                for mode, buf in bufs.items():
                    start = time.perf_counter()
                    for i in range(taken, taken + burst):
                        got = None
                        got = buf.drop_select(kv_tokens(i), None)
                        assert got[2] is not None and got[2].numel() * 2 == KV_BYTES, f"{mode}: entry {i} missing"
                    received = time.perf_counter()
                    wait_inserted(mode, taken + burst + HOLD)
                    took[mode] = max(received, insert_end[mode].value) - start
                got = None
                if b:  # the first round warms up connections, staging and the allocator
                    for mode, t in took.items():
                        times[mode].append(t)
            bare.send_tensor(None)
            done.set()
            child.join(timeout=60)
    finally:
        if child.is_alive():
            child.kill()
    moved = bursts * burst * per_entry
    out: dict[str, Any] = {f"{mode}_gbps": moved / sum(times[mode]) / 1e9 for mode in MODES}
    for mode in MODES[1:]:
        out[f"{mode}_ratio"] = sum(times["pipe"]) / sum(times[mode])
        out[f"{mode}_ratio_median"] = statistics.median(p / b for p, b in zip(times["pipe"], times[mode], strict=True))
    out["bursts"] = {k: [round(x, 4) for x in v] for k, v in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=24, help="timed rounds of throughput bursts (default 24)")
    parser.add_argument("--burst", type=int, default=4, help="KV entries per burst (default 4)")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args(argv)

    thr = kv_throughput(args.bursts, args.burst)
    entries = args.bursts * args.burst
    print(f"\n| {entries} KV entries (2 x 32 MiB) per mode, in {args.bursts} rounds of alternating bursts | GB/s "
          "| / bare pipe | median of per-round ratios |\n|---|---:|---:|---:|")
    print(f"| bare pipe: send_tensor -> recv_tensor | {thr['pipe_gbps']:.2f} | 1.00 | 1.00 |")
    for mode, label in (("copy", "buffer: insert (copies) -> drop_select"),
                        ("handover", "buffer: insert(copy=False) -> drop_select")):
        print(f"| {label} | {thr[f'{mode}_gbps']:.2f} | {thr[f'{mode}_ratio']:.2f} | {thr[f'{mode}_ratio_median']:.2f} |")
    print("\nPer-burst seconds: " + json.dumps(thr["bursts"]))
    verdict = {mode: "MET" if thr[f"{mode}_ratio_median"] >= TARGET else "NOT MET" for mode in MODES[1:]}
    print(f"\nTarget: buffer >= {TARGET}x bare pipe (median of per-round ratios): with insert's copy {verdict['copy']} "
          f"({thr['copy_ratio_median']:.2f}), without it {verdict['handover']} ({thr['handover_ratio_median']:.2f})")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench_buffer_throughput.json"
    out.write_text(json.dumps({
        "benchmark": "bench_buffer_throughput", "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": common.commit(), "command": common.command(), "loadavg_end": os.getloadavg(), "throughput": thr,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
