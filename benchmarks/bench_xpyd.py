"""XpYd at the pipe/buffer layer (no vLLM): P producer processes x C consumer processes on 127.0.0.1.

Every process is a real, separate process (multiprocessing "spawn") with its own Transfer Engine, laid out as the
connector does it (``kv_connector/worker/links.py``):

- producer: one ``PipeEndpoint`` on its own address and one ``SimpleBuffer(None, None, size, role="producer")`` that
  serves every consumer link (``endpoint.on_link`` -> ``buffer.serve_link`` for channel "kv", set before
  ``endpoint.start()``). It inserts ``per pair`` entries for each consumer (distinct token ids per (producer,
  consumer, i); key and value int32 tensors filled with an arange pattern derived from those ids, handed over with
  ``insert(copy=False)``), reports ready, and keeps serving until every entry was taken.
- consumer: one ``PipeEndpoint``, and per producer ``SimpleBuffer(pipe, pipe, size, role="consumer")`` on
  ``pipe = endpoint.link(producer, "kv")``. It sets up its links (one thread per producer, concurrently), waits for the
  harness's "go", then ``drop_select``s every entry it expects from every producer with ``--threads`` worker threads
  (default 4, the connector's ``load_concurrency``) that take (producer, i) items round-robin over the producers, so
  up to 4 requests are in flight per consumer whatever the shape.

The same harness, process layout, entries, threads and checks run two baselines ("ours vs raw TE vs a plain
socket"):

- ``te``: raw ``mooncake.engine.TransferEngine`` (P2PHANDSHAKE, TCP). Each producer holds all its entries in one
  registered region and publishes its session and base address; a consumer reads each entry (key and value, adjacent)
  with one ``batch_transfer_async_read`` into its own registered, never-touched region (fresh pages, as ours receives
  into fresh tensors), polled with ``transfer_check_status`` and 50 us naps (as ``kv_pipe`` polls its writes; the
  engine's blocking wait spins a core). No request protocol, nothing is taken: the lower bound of a pull.
- ``socket``: each producer listens on a plain TCP socket; each consumer opens ``--threads`` connections to each
  producer; a request is 16 bytes (op, entry id), the answer a 24-byte header then tokens, key and value bytes
  (``sendall`` of the tensors' memory -> ``recv_into`` fresh tensors). The producer pops the entry (taken once).

Timing (``time.monotonic``: CLOCK_MONOTONIC, one clock for every process on Linux):

- link set-up: per (consumer, producer) link, the time to make the link and get the answer to a first request that
  matches nothing (ours: ``endpoint.link`` + ``SimpleBuffer`` + ``drop_select([-1])``, i.e. both side-channel
  connections, both handshakes, the rings; te: the first 4 KiB read from the producer, i.e. the engine's handshake
  and segment lookup; socket: ``--threads`` connects + one round trip). All links of a run are set up at once (every
  consumer, every producer), once every process is up, before the timed phase. "later RTT": the median of 5 more such
  requests on the open link, 1 s later (ours makes spare staging rings again in the background after a link set-up;
  the timed phase starts after that second too).
- per-consumer GB/s: the key+value bytes it received / (its last answer - its first request).
- aggregate GB/s: the key+value bytes all consumers received / (last answer of any consumer - first request of any).
- fetch ms: median time of one request (request sent -> entry received), over every request of the run.
- nothing lost: every consumer verifies, after the timed phase, that each entry it received carries the token ids
  it asked for and the exact key and value pattern of (producer, consumer, i); it counts misses, wrong bytes, entries
  received twice and failed requests; each producer then reports the entries it still holds and how many it served.

Same bytes in every shape: ``--entries`` is the number of entries per (producer, consumer) pair in the largest shape;
smaller shapes move the same total with more entries per pair (1x1 with ``--entries 8`` next to 4x4: 128 entries on
one pair). Settings are identical in every column: mooncake.json defaults (staging 64 MiB, chunk 4 MiB, 8 chunks in
flight, timeout ``--pipe-timeout``), ``--threads`` fetch threads per consumer, one torch thread, the connector's Python
thread switch interval (0.1 ms), no CPU pinning (on this 2-core box 8 processes share 2 cores).

Every wait has a deadline: a child that dies fails the run at once with its exit code (and its traceback, if it
could send one), a phase that overruns ``--timeout`` fails it naming who is late (fetch threads stuck in a call dump
their stacks to stderr first), leftover children are killed, and children exit by themselves if the harness dies.

``--staging-mib`` and ``--no-huge-pages`` change those two mooncake.json keys for ours (e.g. to see what link set-up
and fresh result memory cost here).

Run (from the repository root; the default takes ~1.5-2 minutes)::

    .venv/bin/python benchmarks/bench_xpyd.py
    .venv/bin/python benchmarks/bench_xpyd.py --entries 2 --entry-mib 4 --shapes 1x1,4x4 --stacks ours   # quick
    .venv/bin/python benchmarks/bench_xpyd.py --shapes 1x1,1x4,4x1,4x4 --out benchmarks/results/bench_xpyd.md

Prints a markdown table and writes ``--out`` (markdown) and the figures next to it (same name, ``.json``). Exits
with 1 if any run lost, duplicated or corrupted an entry, or if a process died or hung (it is killed).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

# Read by the Transfer Engine when it starts, in this process and in every spawned child (which re-imports this file).
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from benchmarks.support.xpyd_run import run_once  # noqa: E402
from benchmarks.support.xpyd_stacks import HOST, STACKS, TOKENS, BenchError, MiB, Spec  # noqa: E402
from harness.ports import free_port  # noqa: E402

logger = logging.getLogger("bench_xpyd")


# ----------------------------------------------------------------------------- the report
COLUMNS = """\
What each column times (CLOCK_MONOTONIC, shared by all processes; every run is a fresh set of processes):

- **link set-up ms**: per (consumer, producer) link, from making the link to the answer of a first request that
  matches nothing (ours: `endpoint.link` + `SimpleBuffer` + `drop_select([-1])`: both side-channel connections and
  handshakes, the staging rings; te: the engine's first 4 KiB read from that producer: handshake and segment lookup;
  socket: `--threads` TCP connects + one round trip). All links of a run are set up at the same time, once every
  process is up. Median / max over the run's links. Ours allocates, prefaults and registers a staging ring
  (`staging_buffer_size`, `--staging-mib`) for the inbound direction on each side of each link, and a spare one
  again in the background. **later RTT ms**: the same request on the open link 1 s later (median of 5 per link,
  median over links); the timed phase starts after that second too.
- **fetch ms p50**: one request, from sending it to having the whole entry (key + value), median over the run.
- **per-consumer GB/s**: key+value bytes a consumer received / (its last answer - its first request), one figure per
  consumer. **aggregate GB/s**: key+value bytes all consumers received / (the last answer of any consumer - the first
  request of any); link set-up and the producers' inserts are not in it. **x 1x1**: aggregate / the same stack's 1x1.
- **nothing lost**: every entry was received exactly once with the exact token ids, key and value bytes of its
  (producer, consumer, i) pattern, no request missed or failed, and (ours, socket) each producer served exactly its
  entries and holds none at the end. te reads one-sidedly: nothing is taken, so nothing can be left.

Stacks: **ours** = `PipeEndpoint` + `SimpleBuffer` (`serve_link` on the producer, a buffer per producer link on the
consumer); **te** = raw Transfer Engine reads (`batch_transfer_async_read`, polled), no request protocol, the lower
bound of a pull; **socket** = a plain TCP request/response per entry into fresh tensors, `--threads` connections per
producer. Identical in every run: `--threads` fetch threads per consumer taking (producer, i) round-robin over the
producers, mooncake.json defaults, one torch thread, a 0.1 ms Python switch interval, no CPU pinning.
"""


def fmt_row(r: dict[str, Any], base: dict[str, Any] | None) -> str:
    setup, rtt = r["setup_ms"], r["rtt_ms"]
    lost = r["lost"]
    intact = (f"yes ({r['exact']}/{r['entries']} exact)" if r["intact"] else
              "NO: " + ", ".join(f"{k} {v}" for k, v in lost.items() if v) + f"; exact {r['exact']}/{r['entries']}"
              + (f"; served {r['served']}" if r["served"] is not None else ""))
    scale = f"{r['aggregate_gbps'] / base['aggregate_gbps']:.2f}" if base else "-"
    return (f"| {r['stack']} | {r['shape']} | {r['per_pair']} | {r['bytes'] / MiB:.0f} | "
            f"{statistics.median(setup):.1f} / {max(setup):.1f} | {statistics.median(rtt):.2f} | "
            f"{r['fetch_ms_p50']:.1f} | {' '.join(f'{g:.2f}' for g in r['per_consumer_gbps'])} | "
            f"**{r['aggregate_gbps']:.2f}** | {scale} | {intact} |")


def comparison(results: list[dict[str, Any]], stacks: list[str], shapes: list[str]) -> list[str]:
    if "ours" not in stacks or len(stacks) < 2:
        return []
    by = {(r["stack"], r["shape"]): r for r in results}
    others = [s for s in stacks if s != "ours"]
    lines = ["", "| shape | " + " | ".join(f"{s} GB/s" for s in stacks) + " | "
             + " | ".join(f"ours / {s}" for s in others) + " |",
             "|---|" + "---:|" * (len(stacks) + len(others))]
    for shape in shapes:
        row = [by[(s, shape)]["aggregate_gbps"] for s in stacks]
        ours = by[("ours", shape)]["aggregate_gbps"]
        ratios = [ours / by[(s, shape)]["aggregate_gbps"] for s in others]
        lines.append(f"| {shape} | " + " | ".join(f"{g:.2f}" for g in row) + " | "
                     + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    return lines


def script_state() -> str:
    """Whether this script and its modules are committed as they are (the commit names the rest of the tree)."""
    files = ["benchmarks/bench_xpyd.py",
             *[f"benchmarks/support/{name}.py" for name in ("xpyd_run", "xpyd_stacks", "baselines", "procs")]]
    out = subprocess.run(["git", "status", "--porcelain", "--", *files], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return "untracked" if out.startswith("??") else "modified" if out else "as committed"


def report(args: argparse.Namespace, results: list[dict[str, Any]], load: tuple[list[float], list[float]]) -> str:
    import mooncake  # only for its version

    try:
        from importlib.metadata import version

        te_version = version("mooncake-transfer-engine-non-cuda")
    except Exception:
        te_version = getattr(mooncake, "__version__", "unknown")
    lines = [common.header("XpYd at the pipe/buffer layer: P producers x C consumers on 127.0.0.1 (bench_xpyd.py)"),
             f"Python {sys.version.split()[0]}, torch {torch.__version__}, Mooncake Transfer Engine {te_version}; "
             f"bench_xpyd.py {script_state()}. Load average (1/5/15 min) before {load[0][0]:.2f}/{load[0][1]:.2f}/"
             f"{load[0][2]:.2f}, after {load[1][0]:.2f}/{load[1][1]:.2f}/{load[1][2]:.2f}. {os.cpu_count()} cores "
             f"shared by all {max(int(s.split('x')[0]) + int(s.split('x')[1]) for s in args.shapes)} processes of the "
             "largest shape (no pinning): expect the aggregate to be bounded by the CPU, not the links.", "",
             f"Entries of {args.entry_bytes / MiB:g} MiB (key + value, int32) and {TOKENS} token ids each; "
             f"{args.total} entries ({args.total * args.entry_bytes / MiB:.0f} MiB) per run in every shape; "
             f"{args.threads} fetch threads per consumer; ours with staging_buffer_size {args.staging_mib} MiB, "
             f"huge_pages {str(args.huge_pages).lower()}, the other "
             "mooncake.json keys at their defaults.", "",
             "| stack | shape PxC | entries / pair | MiB moved | link set-up ms p50 / max | later RTT ms | fetch ms p50 "
             "| per-consumer GB/s | aggregate GB/s | x 1x1 | nothing lost |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    base = {r["stack"]: r for r in results if r["shape"] == "1x1"}
    for r in results:
        lines.append(fmt_row(r, base.get(r["stack"])))
    lines += comparison(results, args.stacks, args.shapes)
    errors = [f"- {r['stack']} {r['shape']}: {e}" for r in results for e in r["errors"]]
    if errors:
        lines += ["", "Request errors (first 5 per run):", *errors]
    lines += ["", COLUMNS]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            p, c = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r}: write PxC, e.g. 4x4") from None
        if p < 1 or c < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r}: at least one producer and one consumer")
        shapes.append((p, c))
    return shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=8,
                        help="entries per (producer, consumer) pair in the largest shape; every shape moves the same "
                             "total (default 8)")
    parser.add_argument("--entry-mib", type=float, default=16.0, help="key + value MiB per entry (default 16)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x1,4x4"),
                        help="comma-separated PxC (default 1x1,4x4; e.g. 1x1,1x4,4x1,4x4)")
    parser.add_argument("--stacks", default=",".join(STACKS),
                        help=f"comma-separated, run in this order for each shape (default {','.join(STACKS)})")
    parser.add_argument("--threads", type=int, default=4, help="fetch threads per consumer (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds each phase of a run may take before the run fails (default 120)")
    parser.add_argument("--pipe-timeout", type=float, default=30.0, help="mooncake.json timeout (default 30)")
    parser.add_argument("--staging-mib", type=int, default=64,
                        help="ours: mooncake.json staging_buffer_size in MiB (default 64, the default of mooncake.json)")
    parser.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                        help="ours: mooncake.json huge_pages false (default true, the default of mooncake.json)")
    parser.add_argument("--out", type=Path, default=common.RESULTS / "bench_xpyd.md",
                        help="markdown results; the figures go next to it as .json (default benchmarks/results/bench_xpyd.md)")
    parser.add_argument("--verbose", action="store_true", help="INFO logs from the children too")
    args = parser.parse_args(argv)
    args.stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    if not args.stacks or set(args.stacks) - set(STACKS):
        parser.error(f"--stacks: choose from {', '.join(STACKS)}")
    args.entry_bytes = int(args.entry_mib * MiB) // 8 * 8
    if args.entry_bytes < 8 or args.entries < 1 or args.threads < 1:
        parser.error("--entry-mib, --entries and --threads must be positive")
    if args.staging_mib < 8:
        parser.error("--staging-mib: at least 8 (twice mooncake.json's 4 MiB chunk_size)")
    largest = max(p * c for p, c in args.shapes)
    args.total = args.entries * largest
    for p, c in args.shapes:
        if args.total % (p * c):
            parser.error(f"shape {p}x{c}: {args.total} entries do not split evenly over {p * c} pairs")
    args.shapes = [f"{p}x{c}" for p, c in args.shapes]
    return args


def make_spec(args: argparse.Namespace, stack: str, shape: str) -> Spec:
    p, c = (int(x) for x in shape.split("x"))
    return Spec(stack=stack, producers=[f"{HOST}:{free_port()}" for _ in range(p)],
                consumers=[f"{HOST}:{free_port()}" for _ in range(c)], per_pair=args.total // (p * c),
                entry_bytes=args.entry_bytes, threads=args.threads, timeout=args.timeout,
                pipe_timeout=args.pipe_timeout, staging_bytes=args.staging_mib * MiB, huge_pages=args.huge_pages,
                log_level="INFO" if args.verbose else "WARNING")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    load_before = list(os.getloadavg())
    results: list[dict[str, Any]] = []
    try:
        for shape in args.shapes:
            for stack in args.stacks:
                result = run_once(make_spec(args, stack, shape))
                logger.info("%s %s: %.2f GB/s aggregate, nothing lost: %s (%.1f s)", stack, shape,
                            result["aggregate_gbps"], result["intact"], result["seconds"])
                results.append(result)
    except BenchError as e:
        logger.error("the benchmark failed: %s", e)
        return 1
    table = report(args, results, (load_before, list(os.getloadavg())))
    print(table)
    common.write(args.out.stem, {"args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results},
                 table, args.out.parent)
    logger.info("wrote %s and %s", args.out, args.out.with_suffix(".json"))
    return 0 if all(r["intact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
