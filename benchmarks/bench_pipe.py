"""One-way transfer benchmark: MooncakePipe vs. the raw Transfer Engine vs. a plain loopback TCP socket.

For each tensor size, the same bytes go from a *sender* process (a child started with multiprocessing "spawn") to
a *receiver* process (this one), on 127.0.0.1, CPU only, in four ways:

- ``ours``:   ``MooncakePipe.send_tensor(uint8 tensor)`` in the sender -> ``recv_tensor()`` in the receiver, which
  returns a fresh result each time (the previous one is dropped first): from the pipe's pool of memory kept mapped
  (``result_pool_size``), else newly allocated memory with its page faults. Times send start -> result returned.
- ``ours_out``: the same, received with ``recv_tensor(out=buffer)`` into one reused buffer (what a caller with a
  reusable destination, like the KV connector, gets). Times send start -> result returned.
- ``raw_te``: the Transfer Engine alone, like for like with the pipe's configuration: the bytes go from a registered
  source buffer into a registered destination buffer of the receiver's engine (P2PHANDSHAKE) in ``chunk_size``
  writes (``batch_transfer_async_write``, one write per batch) with up to ``max_chunks_in_flight`` of them in flight,
  each awaited by polling ``transfer_check_status`` (as the pipe waits). Times the first write's start -> the last
  write's completion, on the sender: no side channel, no receiver involvement. The bound the pipe is measured against.
- ``socket``: ``sendall`` on a TCP_NODELAY loopback socket -> ``recv_into`` a preallocated buffer. Times send start
  -> last byte received.

One-way latency of one transfer: the sender stores ``time.perf_counter()`` (CLOCK_MONOTONIC, the same clock in
every process on Linux) into shared memory right before sending; the receiver takes ``perf_counter()`` right after
the receive completed; latency = the difference. A one-sided write tells the receiver nothing, so for ``raw_te``
the latency is measured on the sender, from the first write's start to the last one's completion. Transfers never
overlap: the receiver hands the sender a token before each one. A few untimed warm-up transfers come first, and the
last received bytes are checked against what was sent (untimed). Throughput = bytes / median latency, in GB/s (1e9 bytes/s).

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_pipe.py             # 4 KiB .. 256 MiB, about a minute
    .venv/bin/python benchmarks/bench_pipe.py --quick     # 4 KiB .. 1 MiB, few repeats (smoke test)
    .venv/bin/python benchmarks/bench_pipe.py --sizes 16M 64M 256M --chunk-size 16M --inflight 2
    .venv/bin/python benchmarks/bench_pipe.py --sizes 16M 128M --busy sender  # a spinning Python thread there
    .venv/bin/python benchmarks/bench_pipe.py --sizes 64M --no-pool --out-dir /tmp  # fresh results, as before the pool

It prints a markdown table and whether the targets are met, and writes ``bench_pipe.json`` (every median/p90,
the configuration and versions) and ``bench_pipe.png`` (throughput and latency vs. size) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

# The Transfer Engine reads these when it starts (in this process and in the spawned sender, which inherits them).
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: measure this checkout's pipe (not an installed copy), and
    sys.path.insert(0, str(REPO_ROOT))  # make the harness importable

from benchmarks.support import common, procs  # noqa: E402
from benchmarks.support.pipe_transports import (  # noqa: E402
    RECEIVERS,
    STEP_TIMEOUT,
    Link,
    Receiver,
    SenderFailed,
    check_sender_errors,
    pattern,
    sender_main,
    start_spinner,
)
from harness.pipes import make_config  # noqa: E402
from kv_pipe import ConfigError, MooncakeTransferEngineConfig  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
QUICK_SIZES = [4 * KiB, 64 * KiB, 1 * MiB]
QUICK_REPEATS_SCALE = 0.1
MAX_SIZE = 512 * MiB  # each process holds about 2.5x the largest size at once
WARMUP = 3
MIN_REPEATS = 3
TRANSPORTS = ("ours", "ours_out", "raw_te", "socket")
NOT_RUN = "not run"  # the error of a transport left out with --transports
BUSY_LOAD = 0.5  # a 1-minute load average above this before the run means someone else is using the CPU
TARGET_RATIO, TARGET_RATIO_FROM = 0.9, 16 * MiB
TARGET_LATENCY_US, TARGET_LATENCY_SIZE = 200.0, 4 * KiB


# ----------------------------------------------------------------------------- sizes, plan, statistics
def parse_size(text: str) -> int:
    """``4096``, ``4K``, ``4KiB``, ``16M``, ``1G`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 64K, 16MiB or 1G")
    size = int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]
    if not 0 < size <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be between 1 byte and {fmt_size(MAX_SIZE)}")
    return size


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def default_repeats(size: int) -> int:
    """Many repeats for small transfers (noisy, cheap), few for big ones."""
    for limit, repeats in ((4 * KiB, 200), (64 * KiB, 100), (1 * MiB, 50), (16 * MiB, 20), (64 * MiB, 10)):
        if size <= limit:
            return repeats
    return 5


@dataclass(frozen=True)
class Plan:
    """What one transport run does: for each size, ``warmup`` untimed then ``repeats[size]`` timed transfers."""

    sizes: tuple[int, ...]
    repeats: dict[int, int]
    warmup: int = WARMUP

    @classmethod
    def make(cls, sizes: list[int], scale: float) -> Plan:
        sizes = sorted(set(sizes))
        return cls(tuple(sizes), {s: max(MIN_REPEATS, round(default_repeats(s) * scale)) for s in sizes})

    def iterations(self, size: int) -> int:
        return self.warmup + self.repeats[size]


@dataclass(frozen=True)
class Stats:
    size: int
    repeats: int
    median_s: float
    p90_s: float
    min_s: float
    max_s: float

    @classmethod
    def of(cls, size: int, latencies: list[float]) -> Stats:
        return cls(size, len(latencies), statistics.median(latencies), common.percentile(latencies, 90), min(latencies),
                   max(latencies))

    @property
    def gbps(self) -> float:
        return self.size / self.median_s / 1e9


@dataclass
class TransportResult:
    name: str
    stats: dict[int, Stats] = field(default_factory=dict)
    error: str | None = None
    latencies: dict[int, list[float]] = field(default_factory=dict)  # every timed sample, over all rounds

    def merge(self, other: TransportResult) -> None:
        """Pool another round's samples into this result (medians are then taken over all rounds)."""
        if other.error:
            self.error = other.error
        for size, samples in other.latencies.items():
            self.latencies.setdefault(size, []).extend(samples)
            self.stats[size] = Stats.of(size, self.latencies[size])


def measure_size(receiver: Receiver, size: int, plan: Plan, proc: BaseProcess, link: Link) -> list[float]:
    latencies = []
    for i in range(plan.iterations(size)):
        link.go.put(i)
        latency = receiver.receive(size, proc, link)
        if i >= plan.warmup:
            latencies.append(latency)
    if not torch.equal(receiver.received(size), pattern(size)):
        raise RuntimeError(f"the {fmt_size(size)} received differ from what was sent")
    return latencies


def run_transport(transport: str, plan: Plan, config: dict[str, Any], busy: bool = False) -> TransportResult:
    """Start the receiver here and a sender child, measure every size, tear both down (engines included)."""
    result = TransportResult(transport)
    link = Link()
    receiver: Receiver | None = None
    proc: BaseProcess | None = None
    try:
        receiver = RECEIVERS[transport](config, max(plan.sizes))
        iterations = {size: plan.iterations(size) for size in plan.sizes}
        proc = procs.SPAWN.Process(target=sender_main, args=(transport, iterations, link, receiver.setup, busy),
                                   daemon=True)
        proc.start()
        for size in plan.sizes:
            result.latencies[size] = measure_size(receiver, size, plan, proc, link)
            stats = result.stats[size] = Stats.of(size, result.latencies[size])
            print(f"  {transport:6s} {fmt_size(size):>8s}: median {stats.median_s * 1e6:10.1f} us, "
                  f"p90 {stats.p90_s * 1e6:10.1f} us, {stats.gbps:6.2f} GB/s", flush=True)
        link.go.put(None)
        proc.join(timeout=STEP_TIMEOUT)
        check_sender_errors(link)
    except Exception as e:
        result.error = describe_failure(e, proc, link)
        print(f"  {transport}: FAILED: {result.error.splitlines()[0]}", flush=True)
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        if receiver is not None:
            try:
                receiver.close()
            except Exception as e:  # a failed teardown must not hide the measurements
                print(f"  {transport}: teardown failed: {e}", flush=True)
        del receiver
        gc.collect()  # drops the Transfer Engine (its threads and sockets) before the next transport starts
    return result


def describe_failure(e: Exception, proc: BaseProcess | None, link: Link) -> str:
    """The receiver's error, plus the sender's traceback if it has one (usually the root cause)."""
    if isinstance(e, SenderFailed):
        return str(e)
    text = f"receiver: {type(e).__name__}: {e}"
    if proc is not None:
        try:
            return f"{link.errors.get(timeout=15.0)}\n{text}"
        except queue.Empty:
            pass
    return text


# ----------------------------------------------------------------------------- report
def ratio(a: Stats | None, b: Stats | None) -> float | None:
    return a.gbps / b.gbps if a is not None and b is not None else None


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown_table(plan: Plan, results: dict[str, TransportResult]) -> str:
    lines = ["| size | ours median us | ours GB/s | ours into buffer GB/s | raw TE GB/s | socket GB/s | ours/raw TE "
             "| ours into buffer/raw TE | ours/socket |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in plan.sizes:
        ours, ours_out, raw, sock = (results[t].stats.get(size) for t in TRANSPORTS)
        lines.append(f"| {fmt_size(size)} | {fmt(ours and ours.median_s * 1e6, '.1f')} | {fmt(ours and ours.gbps, '.3f')} "
                     f"| {fmt(ours_out and ours_out.gbps, '.3f')} | {fmt(raw and raw.gbps, '.3f')} "
                     f"| {fmt(sock and sock.gbps, '.3f')} | {fmt(ratio(ours, raw), '.2f')} "
                     f"| {fmt(ratio(ours_out, raw), '.2f')} | {fmt(ratio(ours, sock), '.2f')} |")
    return "\n".join(lines)


def evaluate_targets(plan: Plan, results: dict[str, TransportResult]) -> dict[str, Any]:
    """The two targets; ``met`` is None when the run did not measure what a target needs."""
    big = [s for s in plan.sizes if s >= TARGET_RATIO_FROM]
    ratios = {s: ratio(results["ours"].stats.get(s), results["raw_te"].stats.get(s)) for s in big}
    ratios_out = {s: ratio(results["ours_out"].stats.get(s), results["raw_te"].stats.get(s)) for s in big}
    known_out = [r for r in ratios_out.values() if r is not None]
    known = [r for r in ratios.values() if r is not None]
    ratio_met = None if not big else (len(known) == len(big) and all(r >= TARGET_RATIO for r in known))
    small = results["ours"].stats.get(TARGET_LATENCY_SIZE)
    latency_us = small.median_s * 1e6 if small is not None else None
    ours_failed = results["ours"].error not in (None, NOT_RUN)
    return {
        "ours_vs_raw_te": {"goal": f"ours >= {TARGET_RATIO}x raw TE at {fmt_size(TARGET_RATIO_FROM)} and up",
                           "met": False if ours_failed and big else ratio_met,
                           "ratios": {str(s): r for s, r in ratios.items()}},
        "ours_into_buffer_vs_raw_te": {
            "goal": f"ours into a reused buffer >= {TARGET_RATIO}x raw TE at {fmt_size(TARGET_RATIO_FROM)} and up",
            "met": None if not big or len(known_out) != len(big) else all(r >= TARGET_RATIO for r in known_out),
            "ratios": {str(s): r for s, r in ratios_out.items()}},
        "ours_latency": {"goal": f"ours {fmt_size(TARGET_LATENCY_SIZE)} one-way latency median <= {TARGET_LATENCY_US:.0f} us",
                         "met": None if latency_us is None else latency_us <= TARGET_LATENCY_US, "median_us": latency_us},
    }


def targets_line(targets: dict[str, Any]) -> str:
    verdict = {True: "MET", False: "NOT MET", None: "not measured"}
    t1, t1b, t2 = targets["ours_vs_raw_te"], targets["ours_into_buffer_vs_raw_te"], targets["ours_latency"]

    def listed(ratios: dict[str, float | None]) -> str:
        return ", ".join(f"{fmt_size(int(s))} {fmt(r, '.2f')}" for s, r in ratios.items()) or "-"

    return (f"Targets: {t1['goal']}: {verdict[t1['met']]} ({listed(t1['ratios'])}); "
            f"{t1b['goal']}: {verdict[t1b['met']]} ({listed(t1b['ratios'])}); "
            f"{t2['goal']}: {verdict[t2['met']]} ({fmt(t2['median_us'], '.1f')} us).")


def package_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def write_json(path: Path, args: argparse.Namespace, plan: Plan, config: dict[str, Any],
               results: dict[str, TransportResult], targets: dict[str, Any], load_start: tuple[float, ...]) -> None:
    data = {
        "benchmark": "bench_pipe",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "commit": common.commit(), "command": common.command(), "cpu": common.cpu(),
        "kv_pipe_uncommitted_changes": git("status", "--porcelain", "--", "kv_pipe") not in (None, ""),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
                 "torch_threads": torch.get_num_threads(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "versions": {"torch": torch.__version__,
                     "mooncake": package_version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")},
        "args": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "pipe_config": config,
        "env": {k: os.environ.get(k) for k in ("MC_LOG_LEVEL", "MC_TCP_BIND_ADDRESS", "MC_TRANSFER_TIMEOUT", "OMP_NUM_THREADS")},
        "method": {"warmup": plan.warmup, "latency": "one-way, sender perf_counter() before send -> receiver perf_counter() "
                   "after receive; raw_te: on the sender, first write start -> last write done, in chunk_size writes "
                   "with max_chunks_in_flight in flight (the pipe's configuration)", "gbps": "bytes / median / 1e9"},
        "sizes": list(plan.sizes),
        "results": {name: {"error": r.error, "sizes": {str(s): {**asdict(st), "gbps": st.gbps} for s, st in r.stats.items()}}
                    for name, r in results.items()},
        "targets": targets,
    }
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_plot(path: Path, plan: Plan, results: dict[str, TransportResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"ours": "MooncakePipe (ours)", "ours_out": "MooncakePipe into a reused buffer",
              "raw_te": "raw TE, chunk_size writes, max_chunks_in_flight in flight", "socket": "Python TCP socket"}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 9), sharex=True)
    for name, r in results.items():
        sizes = [s for s in plan.sizes if s in r.stats]
        if not sizes:
            continue
        top.plot(sizes, [r.stats[s].gbps for s in sizes], marker="o", label=labels[name])
        line, = bottom.plot(sizes, [r.stats[s].median_s * 1e6 for s in sizes], marker="o", label=f"{labels[name]} median")
        bottom.plot(sizes, [r.stats[s].p90_s * 1e6 for s in sizes], linestyle=":", color=line.get_color(),
                    label=f"{labels[name]} p90")
    top.set(xscale="log", ylabel="throughput, GB/s (bytes / median)", title="One-way transfer, 127.0.0.1, CPU")
    bottom.set(xscale="log", yscale="log", xlabel="transfer size", ylabel="one-way latency, us")
    bottom.axhline(TARGET_LATENCY_US, color="grey", linewidth=0.8, linestyle="--",
                   label=f"target: ours at {fmt_size(TARGET_LATENCY_SIZE)} <= {TARGET_LATENCY_US:.0f} us")
    bottom.set_xticks(list(plan.sizes), [fmt_size(s) for s in plan.sizes], rotation=30)
    bottom.minorticks_off()
    for ax in (top, bottom):
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = MooncakeTransferEngineConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                   help="transfer sizes in bytes or with K/M/G (default: 4K 64K 1M 16M 64M 256M)")
    p.add_argument("--repeats-scale", type=float, default=1.0,
                   help="multiplies the timed repeats per size: 200 at 4 KiB ... 5 at 256 MiB (default: %(default)s)")
    p.add_argument("--chunk-size", type=parse_size, default=defaults.chunk_size,
                   help="MooncakePipe chunk_size (default: the config default, %(default)s)")
    p.add_argument("--staging-size", type=parse_size, default=defaults.staging_buffer_size,
                   help="MooncakePipe staging_buffer_size (default: the config default, %(default)s)")
    p.add_argument("--inflight", type=int, default=defaults.max_chunks_in_flight,
                   help="MooncakePipe max_chunks_in_flight (default: the config default, %(default)s)")
    p.add_argument("--no-pool", action="store_true",
                   help="MooncakePipe result_pool_size 0: every result of ours is freshly allocated")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="MooncakePipe huge_pages false (default: true, the config default)")
    p.add_argument("--rounds", type=int, default=3,
                   help="run every transport this many times in rotating order and pool the samples (default: 3)")
    p.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=list(TRANSPORTS),
                   help="which transports to measure (default: all three)")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results",
                   help="where bench_pipe.json and bench_pipe.png go (default: benchmarks/results)")
    p.add_argument("--busy", choices=("sender", "receiver", "both"), default=None,
                   help="a never-waiting Python thread in the sending, the receiving or both processes (as in a vLLM "
                        "process whose engine loop spins); results go to bench_pipe_busy.json/png")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke test: sizes {' '.join(fmt_size(s) for s in QUICK_SIZES)} unless --sizes is given, "
                        f"repeats x{QUICK_REPEATS_SCALE}")
    args = p.parse_args(argv)
    if args.repeats_scale <= 0:
        p.error("--repeats-scale must be > 0")
    try:  # the pipe refuses bad knobs itself; say so before anything starts
        MooncakeTransferEngineConfig(chunk_size=args.chunk_size, staging_buffer_size=args.staging_size,
                                     max_chunks_in_flight=args.inflight)
    except ConfigError as e:
        p.error(f"--chunk-size/--staging-size/--inflight: {e}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.quick:
        args.repeats_scale *= QUICK_REPEATS_SCALE
        args.rounds = 1
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    return args


def pipe_config(args: argparse.Namespace) -> dict[str, Any]:
    """Two free ports on 127.0.0.1 (P2PHANDSHAKE, TCP) plus the pipe knobs from the command line (the raw TE
    baseline takes chunk_size and max_chunks_in_flight from it too)."""
    pool = 0 if args.no_pool else MooncakeTransferEngineConfig().result_pool_size  # named in the JSON either way
    return make_config(chunk_size=args.chunk_size, staging_buffer_size=args.staging_size, max_chunks_in_flight=args.inflight,
                       huge_pages=args.huge_pages, result_pool_size=pool)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.make(args.sizes, args.repeats_scale)
    config = pipe_config(args)
    print(f"bench_pipe: sizes {', '.join(fmt_size(s) for s in plan.sizes)}; repeats "
          f"{', '.join(str(plan.repeats[s]) for s in plan.sizes)} (+{plan.warmup} warm-up); chunk {fmt_size(args.chunk_size)}, "
          f"staging {fmt_size(args.staging_size)}, in flight {args.inflight}, result pool "
          f"{'off' if args.no_pool else 'on'}, huge pages {'on' if args.huge_pages else 'off'}", flush=True)
    load_start = os.getloadavg()
    if load_start[0] > BUSY_LOAD:
        print(f"note: load average {load_start[0]:.2f} - other processes use the CPU, expect noisy numbers", flush=True)
    if args.busy in ("receiver", "both"):
        start_spinner()  # the receiving side (this process); sender children start their own
    results = {name: TransportResult(name, error=NOT_RUN) for name in TRANSPORTS}
    for name in args.transports:
        results[name].error = None
    for rnd in range(args.rounds):  # rounds in rotating order, pooled: drift on a shared host hits every transport
        order = args.transports[rnd % len(args.transports):] + args.transports[:rnd % len(args.transports)]
        print(f"round {rnd + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        for name in order:
            results[name].merge(run_transport(name, plan, config, args.busy in ("sender", "both")))
    targets = evaluate_targets(plan, results)
    print()
    print(markdown_table(plan, results))
    print()
    print(targets_line(targets))
    for name, r in results.items():
        if r.error and r.error != NOT_RUN:
            print(f"\n{name} failed:\n{r.error}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "bench_pipe_busy" if args.busy else "bench_pipe"
    write_json(args.out_dir / f"{name}.json", args, plan, config, results, targets, load_start)
    write_plot(args.out_dir / f"{name}.png", plan, results)
    print(f"\nwrote {args.out_dir / f'{name}.json'} and {args.out_dir / f'{name}.png'}")
    return 1 if any(results[t].error for t in args.transports) else 0


if __name__ == "__main__":
    sys.exit(main())
