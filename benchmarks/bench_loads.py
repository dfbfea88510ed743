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

``--single ROUNDS`` (~3 minutes for 20): one load at a time instead, each timed next to a bare-pipe transfer of the
same bytes over a pipe kept up between rounds (bench_loads_single.json / .md). Goal (issue #17): a single pull load of
96 MiB (3072 tokens) in vLLM at >= 0.7x the bare pipe's throughput::

    .venv/bin/python benchmarks/bench_loads.py --single 20
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import random
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from harness.ports import free_port  # noqa: E402
from harness.vllm import VllmServer, start_vllm  # noqa: E402

MODEL = ROOT / ".cache" / "models" / "kv32k"
BLOCK = 128
ROW_BYTES = 8 * 8 * 128 * 256 * 2  # kv32k in bfloat16: 8 layers x [8 heads, 128 tokens, K and V of 128] per block
GOAL = 0.5
SINGLE_GOAL = 0.7
SWITCH_INTERVAL = 0.0001  # the connector's gil_switch_interval default, for the bare pipe too


def mooncake_json(path: Path) -> Path:
    path.write_text(json.dumps({"prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}",
                                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "timeout": 30}))
    return path


def serve_args(dtype: str, kv_bytes: int) -> list[str]:
    return ["--dtype", dtype, "--enforce-eager", "--max-model-len", "3200", "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-num-seqs", "128"]


def start(work: Path, dtype: str, concurrency: int, max_in_flight: int) -> tuple[VllmServer, VllmServer]:
    config = mooncake_json(work / "mooncake.json")
    kv_max = max_in_flight * 3072 * 32 * 1024
    connector = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector"}
    producer = VllmServer("producer", MODEL, free_port(), 0, work,
                          {**connector, "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"buffer_size": kv_max + (1 << 30), "entry_ttl": 600}},
                          config, serve_args(dtype, 1 << 30))
    consumer = VllmServer("consumer", MODEL, free_port(), 1, work,
                          {**connector, "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"load_concurrency": concurrency, "load_timeout": 120}},
                          config, serve_args(dtype, kv_max + (256 << 20)))
    start_vllm(producer, consumer)
    return producer, consumer


def stats(server: VllmServer) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:mooncake_kv_") and "{" in line:
            name = line.split("{", 1)[0].removeprefix("vllm:mooncake_kv_").removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def post(server: VllmServer, tokens: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": server.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{server.url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def prefill(producer: VllmServer, prompts: list[list[int]]) -> None:
    """Prefill ``prompts`` on the producer (4 at a time) and wait until it saved them all: it keeps their KV."""
    saved = stats(producer).get("saved", 0)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda t: post(producer, t, 1), prompts))
    deadline = time.monotonic() + 60
    while stats(producer).get("saved", 0) < saved + len(prompts) and time.monotonic() < deadline:
        time.sleep(0.02)


def in_vllm_round(producer: VllmServer, consumer: VllmServer, n: int, rng: random.Random,
                  longest: bool = False, tokens: int | None = None) -> dict[str, Any]:
    lengths = [3072 if longest else tokens or rng.randint(1024, 3072) for _ in range(n)]
    prompts = [[rng.randrange(10, 7000) for _ in range(length)] for length in lengths]
    prefill(producer, prompts)
    before = stats(consumer)
    ended = lambda s: sum(s.get(k, 0) - before.get(k, 0) for k in ("loaded", "load_misses", "load_failures"))  # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        start = time.perf_counter()
        futures = [pool.submit(post, consumer, t, 1) for t in prompts]
        while True:
            now = stats(consumer)
            if ended(now) >= n:
                wall = time.perf_counter() - start
                break
            if time.perf_counter() - start > 600:
                raise RuntimeError(f"only {ended(now)} of {n} loads ended in 600 s")
            time.sleep(0.01)
        for f in futures:
            f.result()
    after = stats(consumer)
    fetched = after.get("fetched_bytes", 0) - before.get("fetched_bytes", 0)
    sizes = [(-(-(len(t) - 1) // BLOCK)) * ROW_BYTES for t in prompts]  # what each load moves (nothing cached)
    return {"n": n, "loaded": after.get("loaded", 0) - before.get("loaded", 0),
            "failed": ended(after) - (after.get("loaded", 0) - before.get("loaded", 0)),
            "bytes": fetched, "expected_bytes": sum(sizes), "seconds": wall, "GBps": fetched / wall / 1e9, "sizes": sizes}


# ----------------------------------------------------------------------------- the bare pipe
def _pipe_config(base: dict[str, Any]) -> Any:
    from kv_pipe import MooncakeTransferEngineConfig

    return MooncakeTransferEngineConfig.from_dict(base)


def _bare_sender(cfg: dict[str, Any], sizes: list[int], ready: Any, core: int | None) -> None:
    import os

    import torch

    from kv_pipe import MooncakePipe

    if core is not None:
        os.sched_setaffinity(0, {core})
    sys.setswitchinterval(SWITCH_INTERVAL)
    with MooncakePipe(kv_rank=0, config=_pipe_config(cfg)) as pipe:
        data = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8)
        ready.set()
        pipe.recv_tensor(timeout=120)  # "go"
        for size in sizes:
            pipe.send_tensor(data[:size])
        pipe.recv_tensor(timeout=120)  # "done": keep the pipe up until everything is received


def bare_pipe_round(cfg: dict[str, Any], sizes: list[int], pinned: bool) -> dict[str, Any]:
    """The sizes through a bare pipe; ``pinned``: sender on core 0, receiver (this process, meanwhile) on core 1."""
    import os

    import torch

    from kv_pipe import MooncakePipe
    from kv_pipe.memory import WarmPool

    cfg = {**cfg, "prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}"}
    sys.setswitchinterval(SWITCH_INTERVAL)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    sender = ctx.Process(target=_bare_sender, args=(cfg, sizes, ready, 0 if pinned else None), daemon=True)
    sender.start()
    all_cores = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {1})
    pool = WarmPool(keep=1)
    buf = pool.get(max(sizes))
    with MooncakePipe(kv_rank=1, config=_pipe_config(cfg)) as pipe:
        if not ready.wait(120):
            raise RuntimeError("the bare-pipe sender did not start")
        start = time.perf_counter()
        pipe.send_tensor(torch.zeros(1))
        for size in sizes:
            got = pipe.recv_tensor(timeout=120, out=buf)
            assert got is not None and got.numel() == size
        wall = time.perf_counter() - start
        pipe.send_tensor(torch.zeros(1))
    sender.join(30)
    os.sched_setaffinity(0, all_cores)
    return {"n": len(sizes), "bytes": sum(sizes), "seconds": wall, "GBps": sum(sizes) / wall / 1e9, "pinned": pinned}


def _bare_server(cfg: dict[str, Any], largest: int, ready: Any, core: int) -> None:
    """A bare-pipe sender that stays up: sends a tensor of each size it is asked for (0: stop)."""
    import os

    import torch

    from kv_pipe import MooncakePipe

    os.sched_setaffinity(0, {core})
    sys.setswitchinterval(SWITCH_INTERVAL)
    with MooncakePipe(kv_rank=0, config=_pipe_config(cfg)) as pipe:
        data = torch.randint(0, 255, (largest,), dtype=torch.uint8)
        ready.set()
        while True:
            ask = pipe.recv_tensor(timeout=3600)
            size = int(ask.item()) if ask is not None else 0
            if size <= 0:
                return
            pipe.send_tensor(data[:size])


def _bare_receiver(cfg: dict[str, Any], largest: int, conn: Any, core: int) -> None:
    """The receiving end of ``BarePipe``, in a process of its own pinned to ``core`` with every thread it starts (as
    the consumer's worker): times each size ``conn`` asks for, from asking the sender to the bytes being in a reused,
    mapped buffer registered once as a receive region, as the consumer's KV cache is (so the sender writes straight
    into it); answers the seconds (0 stops it)."""
    import os

    import torch

    from kv_pipe import MooncakePipe
    from kv_pipe.scatter import Scatter

    os.sched_setaffinity(0, {core})
    sys.setswitchinterval(SWITCH_INTERVAL)
    buf = torch.zeros(largest, dtype=torch.uint8)  # written: mapped, as the consumer's KV cache blocks are
    with MooncakePipe(kv_rank=1, config=_pipe_config(cfg)) as pipe:
        pipe.register_receive_region(buf)
        conn.send("ready")
        while True:
            size = conn.recv()
            start = time.perf_counter()
            pipe.send_tensor(torch.tensor([size], dtype=torch.int64))
            if size <= 0:
                return
            got = pipe.recv_tensor(timeout=120, out=Scatter.of([(buf.data_ptr(), size)], (buf,)))
            seconds = time.perf_counter() - start
            conn.send(seconds if got is not None and got.numel() == size else -1.0)


class BarePipe:
    """One bare pipe kept up between single loads, so that each load in vLLM is timed next to a bare transfer of the
    same bytes (interleaved: the machine's slow drifts hit both). The sender on core 0 and the receiver on core 1,
    each a process pinned with all its threads, as the vLLM producer's and consumer's workers."""

    def __init__(self, cfg: dict[str, Any], largest: int) -> None:
        cfg = {**cfg, "prefill_url": f"127.0.0.1:{free_port()}", "decode_url": f"127.0.0.1:{free_port()}"}
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        self.sender = ctx.Process(target=_bare_server, args=(cfg, largest, ready, 0), daemon=True)
        self.sender.start()
        if not ready.wait(120):
            raise RuntimeError("the bare-pipe sender did not start")
        self.conn, theirs = ctx.Pipe()
        self.receiver = ctx.Process(target=_bare_receiver, args=(cfg, largest, theirs, 1), daemon=True)
        self.receiver.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the bare-pipe receiver did not start")
        self.transfer(1 << 20)  # the link's set-up is not timed (the vLLM pair's link is up too)

    def transfer(self, size: int) -> float:
        """Seconds from the receiver asking for ``size`` bytes until they are in its buffer."""
        self.conn.send(size)
        if not self.conn.poll(120):
            raise RuntimeError(f"the bare pipe did not move {size} bytes in 120 s")
        seconds = self.conn.recv()
        if seconds < 0:
            raise RuntimeError(f"the bare pipe's receiver got the wrong size for {size} bytes")
        return seconds

    def close(self) -> None:
        self.conn.send(0)
        self.receiver.join(30)
        self.sender.join(30)


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
            prefill(producer, [prompt])
            seen, before = len(load_timings(consumer.log, 0)), stats(consumer)
            post(consumer, prompt, 1)
            deadline = time.monotonic() + 10
            while not (timings := load_timings(consumer.log, seen)) and time.monotonic() < deadline:
                time.sleep(0.02)
            if len(timings) != 1:
                raise RuntimeError(f"round {r}: {len(timings)} pulled-load lines in the consumer's log (expected 1)")
            nbytes = stats(consumer).get("fetched_bytes", 0) - before.get("fetched_bytes", 0)
            ms = timings[0][0]
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
        common.header("One pull load inside vLLM vs the bare pipe, interleaved (bench_loads.py --single)", dtype), "",
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


def load_timings(log: Path, skip: int) -> list[tuple[float, float, float]]:
    """(total, fetch, copy) ms of each pulled load in the consumer's log after the first ``skip`` of them."""
    pattern = re.compile(r"loaded request \S+ \(pulled\).* in ([\d.]+) ms \([\d.]+ GB/s; fetch ([\d.]+) ms, "
                         r"(?:copy into the KV cache ([\d.]+) ms|received into the KV cache blocks)\)")
    found = [(float(a), float(b), float(c or 0)) for a, b, c in pattern.findall(log.read_text(errors="replace"))]
    return found[skip:]  # type: ignore[return-value]


# ----------------------------------------------------------------------------- run
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--load-concurrency", type=int, nargs="+", default=[1, 4],
                        help="the consumer's load_concurrency values to run (1: one load at a time, as before #14)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None, help="every prompt this long (default: 1024-3072)")
    parser.add_argument("--single", type=int, default=0, metavar="ROUNDS",
                        help="instead: ROUNDS single loads of --tokens (default 3072) tokens, each next to a bare-pipe "
                        "transfer of the same bytes (results in bench_loads_single.*)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU computes it natively")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    if not MODEL.is_dir():
        print(f"{MODEL} is missing: run scripts/setup.sh", file=sys.stderr)
        return 2
    dtype = args.dtype or common.native_dtype()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop the vLLM instances
    if dtype != "bfloat16":
        print("note: the KV sizes below assume bfloat16; with float32 every load moves twice the bytes", file=sys.stderr)
    rng = random.Random(1234)
    if args.single:
        tokens = args.tokens or 3072
        with tempfile.TemporaryDirectory(prefix="bench-loads-") as tmp:
            producer, consumer = start(Path(tmp), dtype, 1, 4)
            try:
                in_vllm_round(producer, consumer, 4, random.Random(99), longest=True)  # warm-up
                cfg = json.loads((Path(tmp) / "mooncake.json").read_text())
                single = single_loads(producer, consumer, cfg, tokens, args.single, rng)
            finally:
                producer.stop()
                consumer.stop()
        table = single_markdown(single, tokens, dtype)
        print(table)
        common.write("bench_loads_single", {"dtype": dtype, "tokens": tokens, "rounds": single, "goal": SINGLE_GOAL},
                     table, args.out_dir)
        return 0
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
