"""GPU benchmark: what moving KV costs when it lives on a GPU, all columns in one run on one machine (no vLLM needed:
``scripts/gpu_check.sh`` runs it on a GPU machine after the ``cuda`` tests).

Sections (each timed the same way for every column it has; TCP over loopback, P2PHANDSHAKE, one process per side):

1. ``pipe``: one tensor one way through ``MooncakePipe`` (a sender process, this process receiving), from the
   sender's ``send_tensor`` start to the result on the receiver's device (a CUDA result: its copy onto the device has
   ended). ``device``: both pipe ends and the tensor on the GPU (staged through pinned host memory); ``host``: the same
   pipe and bytes on the host. ``syncs/send``: synchronizing CUDA calls one device ``send_tensor`` made (torch's sync
   debug mode counts them: a blocking copy, a stream or device synchronize; an event wait is none).
2. ``engine``: one ``transfer_sync_write`` of the raw Transfer Engine into a peer process's registered memory:
   ``device->device`` (both buffers GPU memory registered with the engine; only with the engine's CUDA build) and
   ``pinned->pinned`` (page-locked host memory); from the call to its return.
3. ``copies``: the same bytes device -> pinned host -> device with torch (each copy non-blocking, then its event
   waited for): the cost of staging through the host.
4. ``save/load``: the connector's data path (``harness.workers``, no vLLM): a producer worker saves a prompt of N
   blocks of a FlashAttention-layout cache (pull mode), a consumer worker in another process loads them; ``save
   (forward thread)`` is the time ``wait_for_save`` took (the copies out of a GPU cache only get queued there),
   ``load`` from the consumer's ``start_step`` to the load reported done; the loaded blocks are compared bit for
   bit. Rows for a GPU cache and a host cache, with the device memory torch reserved in each process before the
   worker was made and after the save + load (what the connector takes beyond vLLM's budget).
5. ``forward loop``: a forward-like loop on a GPU cache in vLLM's hook order (per layer: a matmul writing the step's
   blocks, then ``save_kv_layer``; then ``start_load_kv``, ``wait_for_save`` saving the step's prompt, pull mode,
   ``get_finished``), its step time with saving on and off (each step synchronized at its end, for timing only).
6. ``gather``: a 1 GiB gather out of a GPU cache (``KVStaging.gather``: the forward thread's call, and until its copy
   ended), the first and a warm one: its pinned memory comes from the arena taken at start-up; beside it what a
   fresh pinned allocation of 1 GiB costs with torch (the first, and a warm one from torch's cache).
7. ``context``: a process that never touches CUDA makes an engine transfer of plain host memory; does a GPU context
   of its own show on the device (``nvidia-smi``) after it? (The engine's CUDA build over TCP makes one per
   process; its non-CUDA build, the one the ``cuda`` extra installs, none.)

Run::

    .venv/bin/python benchmarks/bench_gpu.py                  # on a GPU machine (scripts/gpu_check.sh)
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --quick   # a smoke run of the same code on the host
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.support import common  # noqa: E402
from harness.pipes import make_config, open_pipe  # noqa: E402
from harness.ports import port_pair  # noqa: E402

MiB = 1 << 20
_ctx = mp.get_context("spawn")  # CUDA in a child needs a fresh process


# ------------------------------------------------------------------------------------------------ helpers
def pattern(nbytes: int, seed: int, device: str) -> torch.Tensor:
    """``nbytes`` bytes from ``seed``, the same on every device: 1 MiB drawn at random, repeated, each repeat XORed
    with its own index (a piece in the wrong place shows; a GiB is made in milliseconds on a GPU)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (min(nbytes, MiB),), dtype=torch.uint8, generator=g).to(device)
    repeats = -(-nbytes // base.numel())
    marks = (torch.arange(repeats, device=device) % 251).to(torch.uint8).view(-1, 1)
    return (base.repeat(repeats, 1) ^ marks).view(-1)[:nbytes].contiguous()


def settle(device: str) -> None:
    """For timing only: the work queued on the device has ended."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 2)


def rate(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def count_syncs(fn: Callable[[], None]) -> int:
    """How many synchronizing CUDA calls ``fn`` made (torch's sync debug mode warns once per call)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# ------------------------------------------------------------------------------------------------ 1. pipe
def pipe_sender(cfg: dict[str, Any], device: str, nbytes: int, repeats: int, tokens: Any, stamp: Any,
                out: Any) -> None:
    t = pattern(nbytes, nbytes, device)
    syncs = -1
    with open_pipe(cfg, 0, device=device) as pipe:
        for i in range(repeats):
            tokens.get(timeout=120)
            settle(device)
            stamp.value = time.perf_counter()
            if device.startswith("cuda") and i == repeats - 1:
                syncs = count_syncs(lambda: pipe.send_tensor(t))
            else:
                pipe.send_tensor(t)
        pipe.recv_tensor(timeout=120)  # the receiver's "done"
    out.put(syncs)


def pipe_run(device: str, nbytes: int, repeats: int) -> dict[str, Any]:
    cfg = make_config(timeout=60.0)
    tokens, stamp, out = _ctx.Queue(), _ctx.Value("d", 0.0), _ctx.Queue()
    child = _ctx.Process(target=pipe_sender, args=(cfg, device, nbytes, repeats, tokens, stamp, out), daemon=True)
    child.start()
    samples, exact = [], False
    try:
        with open_pipe(cfg, 1, device=device) as pipe:
            expected = pattern(nbytes, nbytes, device)
            for _ in range(repeats):
                tokens.put(1)
                got = pipe.recv_tensor(timeout=120)
                settle(device)
                samples.append(time.perf_counter() - stamp.value)
            exact = bool(torch.equal(got, expected))
            pipe.send_tensor(None)
            syncs = out.get(timeout=120)
    finally:
        child.join(timeout=30)
    best = samples[1:] or samples  # the first one links and warms up
    return {"ms": median_ms(best), "GB/s": rate(nbytes, statistics.median(best)), "exact": exact, "syncs": syncs}


# ------------------------------------------------------------------------------------------------ 2. engine
def engine_build() -> str:
    """The installed Transfer Engine's distribution (its CUDA and non-CUDA builds ship the same ``mooncake``)."""
    from importlib import metadata

    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("mooncake-transfer-engine"):
            return f"{name} {dist.version}"
    return "unknown"


def _engine() -> Any:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(f"127.0.0.1:{port_pair()}", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Transfer Engine initialize failed")
    return engine


def _buffer(kind: str, nbytes: int) -> torch.Tensor:
    if kind == "device":
        return torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def engine_target(kind: str, nbytes: int, where: Any, done: Any, verdict: Any) -> None:
    engine = _engine()
    buf = _buffer(kind, nbytes)
    if engine.register_memory(buf.data_ptr(), nbytes) != 0:
        raise RuntimeError(f"registering {kind} memory failed")
    where.put((f"127.0.0.1:{engine.get_rpc_port()}", buf.data_ptr()))
    done.wait(300)
    verdict.put(bool(torch.equal(buf.cpu(), pattern(nbytes, 7, "cpu"))))


def engine_run(kind: str, nbytes: int, repeats: int) -> dict[str, Any]:
    where, done, verdict = _ctx.Queue(), _ctx.Event(), _ctx.Queue()
    child = _ctx.Process(target=engine_target, args=(kind, nbytes, where, done, verdict), daemon=True)
    child.start()
    try:
        session, remote = where.get(timeout=120)
        engine = _engine()
        src = _buffer(kind, nbytes)
        src.copy_(pattern(nbytes, 7, "cpu"))
        if engine.register_memory(src.data_ptr(), nbytes) != 0:
            raise RuntimeError(f"registering {kind} memory failed")
        settle("cuda" if kind == "device" else "cpu")
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            if engine.transfer_sync_write(session, src.data_ptr(), remote, nbytes) != 0:
                raise RuntimeError("transfer_sync_write failed")
            samples.append(time.perf_counter() - start)
        done.set()
        exact = verdict.get(timeout=120)
    finally:
        done.set()
        child.join(timeout=30)
    best = samples[1:] or samples
    return {"ms": median_ms(best), "GB/s": rate(nbytes, statistics.median(best)), "exact": exact}


# ------------------------------------------------------------------------------------------------ 3. copies
def copies_run(nbytes: int, repeats: int) -> dict[str, Any]:
    src = pattern(nbytes, 3, "cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty_like(src)
    d2h, h2d = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        mid = time.perf_counter()
        back.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        d2h.append(mid - start)
        h2d.append(time.perf_counter() - mid)
    gib = nbytes / (1 << 30)
    return {"d2h ms/GiB": round(statistics.median(d2h) * 1e3 / gib, 1),
            "h2d ms/GiB": round(statistics.median(h2d) * 1e3 / gib, 1), "exact": bool(torch.equal(back, src))}


# ------------------------------------------------------------------------------------------------ 4. save/load
BLOCK, HEADS, HEAD_DIM = 16, 8, 128  # a FlashAttention cache: [2, blocks, 16, 8 KV heads, 128] per layer, bf16
WARM_UP = [60_000 + i for i in range(BLOCK)]  # a one-block prompt loaded first, untimed


def flash_caches(layers: int, num_blocks: int, seed: int, device: str) -> dict[str, torch.Tensor]:
    shape = (2, num_blocks, BLOCK, HEADS, HEAD_DIM)
    out = {}
    for i in range(layers):
        n = torch.Size(shape).numel() * 2
        out[f"model.layers.{i}.self_attn.attn"] = pattern(n, seed * 1000 + i, device).view(torch.bfloat16).view(shape)
    return out


def save_side(cfg: dict[str, Any], device: str, layers: int, num_blocks: int, nblocks: int, ready: Any, done: Any,
              out: Any) -> None:
    from harness.workers import connector_worker, prefill_steps

    caches = flash_caches(layers, num_blocks, 1, device)
    before = reserved_mib(device)
    worker = connector_worker("kv_producer", cfg, caches, block_size=BLOCK, kv_heads=HEADS, num_blocks=num_blocks)
    try:
        prefill_steps(worker, list(caches), [("w", WARM_UP, [num_blocks - 1])], "pull", 1 << 30)
        tokens = list(range(1, nblocks * BLOCK + 1))
        start = time.perf_counter()
        prefill_steps(worker, list(caches), [("r", tokens, list(range(nblocks)))], "pull", 1 << 30)
        seconds = time.perf_counter() - start
        settle(device)
        out.put((seconds, before, reserved_mib(device)))
        ready.set()
        done.wait(300)
    finally:
        worker.close()


def save_load_run(device: str, layers: int, nblocks: int) -> dict[str, Any]:
    from harness.workers import connector_worker, run_loads

    num_blocks = 2 * nblocks + 8
    cfg = make_config(prefill_url=f"127.0.0.1:{port_pair()}", timeout=60.0)
    ready, done, out = _ctx.Event(), _ctx.Event(), _ctx.Queue()
    child = _ctx.Process(target=save_side, args=(cfg, device, layers, num_blocks, nblocks, ready, done, out),
                         daemon=True)
    child.start()
    try:
        caches = flash_caches(layers, num_blocks, 2, device)
        before = reserved_mib(device)
        worker = connector_worker("kv_consumer", cfg, caches, block_size=BLOCK, kv_heads=HEADS, num_blocks=num_blocks,
                                  load_timeout=120.0)
        try:
            if not ready.wait(300):
                raise TimeoutError("the producer did not save")
            save, saver_before, saver_after = out.get(timeout=30)
            tokens = list(range(1, nblocks * BLOCK + 1))
            target = list(range(nblocks + 8, 2 * nblocks + 8))
            load = {"req_id": "r", "token_ids": tokens, "first_block": 0, "block_ids": target,
                    "num_tokens": len(tokens) - 1}
            producer = cfg["prefill_url"]
            warm = {"req_id": "w", "token_ids": WARM_UP, "first_block": 0, "block_ids": [num_blocks - 1],
                    "num_tokens": BLOCK - 1}
            run_loads(worker, [warm], [producer], 1, timeout=300)  # links both ways: not part of the timing
            start = time.perf_counter()
            finished, failed, _ = run_loads(worker, [load], [producer], 1, timeout=300)
            seconds = time.perf_counter() - start
            after = reserved_mib(device)
            expected = flash_caches(layers, num_blocks, 1, "cpu")
            exact = not failed and finished == {"r"} and all(
                torch.equal(c[:, target].cpu().view(torch.uint8), e[:, :nblocks].view(torch.uint8))
                for c, e in zip(caches.values(), expected.values(), strict=True))
        finally:
            worker.close()
    finally:
        done.set()
        child.join(timeout=30)
    nbytes = nblocks * layers * 2 * BLOCK * HEADS * HEAD_DIM * 2
    return {"MiB": round(nbytes / MiB, 1), "save ms (forward thread)": round(save * 1e3, 2),
            "load ms": round(seconds * 1e3, 2), "load GB/s": rate(nbytes, seconds),
            "producer reserved MiB before/after": f"{saver_before}/{saver_after}",
            "consumer reserved MiB before/after": f"{before}/{after}", "exact": exact}


def reserved_mib(device: str) -> float:
    """Device memory torch's allocator holds in this process (0 for a host cache)."""
    return round(torch.cuda.memory_reserved() / MiB, 1) if device.startswith("cuda") else 0.0


# ------------------------------------------------------------------------------------------------ 5. forward loop
def forward_loop_run(device: str, layers: int, nblocks: int, steps: int) -> dict[str, Any]:
    from harness.workers import connector_worker
    from harness.workers import step as connector_step
    from kv_connector.metadata import MooncakeConnectorMetadata, SaveRequest

    num_blocks = nblocks * (steps + 1)
    caches = flash_caches(layers, num_blocks, 3, device)
    cfg = make_config(prefill_url=f"127.0.0.1:{port_pair()}")
    worker = connector_worker("kv_producer", cfg, caches, block_size=BLOCK, kv_heads=HEADS, num_blocks=num_blocks,
                              buffer_size=2 << 30)
    rows = nblocks * BLOCK
    x = torch.randn(rows, HEADS * HEAD_DIM, device=device, dtype=torch.bfloat16)
    w = torch.randn(HEADS * HEAD_DIM, HEADS * HEAD_DIM, device=device, dtype=torch.bfloat16) / 64

    def loop(save: bool) -> float:
        times = []
        for step in range(steps):
            ids = list(range(step * nblocks, (step + 1) * nblocks))
            meta = MooncakeConnectorMetadata(saves=[SaveRequest(f"s{save}{step}", list(range(rows)), ids)] if save
                                             else [])
            settle(device)
            start = time.perf_counter()

            def attention(name: str, ids: list[int] = ids) -> None:  # writes the step's blocks of layer ``name``
                y = (x @ w).view(nblocks, BLOCK, HEADS, HEAD_DIM)
                caches[name][0, ids[0]:ids[-1] + 1] = y
                caches[name][1, ids[0]:ids[-1] + 1] = y
            connector_step(worker, meta, list(caches), attention)  # vLLM's order: forward, start_load_kv, ...
            settle(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:] or times)

    try:
        off = loop(False)
        on = loop(True)
        off_again = loop(False)
    finally:
        worker.close()
    base = min(off, off_again)
    return {"step ms, saving off": round(base * 1e3, 2), "step ms, saving on": round(on * 1e3, 2),
            "ratio": round(on / base, 2) if base else 0.0,
            "MiB saved per step": round(nblocks * layers * 2 * BLOCK * HEADS * HEAD_DIM * 2 / MiB, 1)}


# ------------------------------------------------------------------------------------------------ 6. gather
def gather_run(nbytes: int) -> list[dict[str, Any]]:
    from kv_connector.cache.staging import KVStaging

    layers = 4
    per_block = layers * 2 * BLOCK * HEADS * HEAD_DIM * 2
    nblocks = nbytes // per_block
    caches = flash_caches(layers, nblocks + 1, 5, "cuda")
    staging = KVStaging(list(caches.values()), 1, pinned_bytes=nbytes + 64 * MiB)
    rows = []
    call, whole = [], []
    for _ in range(2):
        settle("cuda")
        start = time.perf_counter()
        staged = staging.gather(range(nblocks))
        call.append(time.perf_counter() - start)
        staged.wait()
        whole.append(time.perf_counter() - start)
        del staged
    rows.append({"what": f"KVStaging.gather, {nblocks * per_block / MiB:.0f} MiB (arena)",
                 "first: call ms": round(call[0] * 1e3, 2), "first: copied ms": round(whole[0] * 1e3, 2),
                 "warm: call ms": round(call[1] * 1e3, 2), "warm: copied ms": round(whole[1] * 1e3, 2)})
    fresh = []
    for _ in range(2):
        start = time.perf_counter()
        t = torch.empty(nblocks * per_block, dtype=torch.uint8, pin_memory=True)
        fresh.append(time.perf_counter() - start)
        del t
    rows.append({"what": "torch.empty(pin_memory=True) of as much (no arena)", "first: call ms":
                 round(fresh[0] * 1e3, 2), "first: copied ms": "-", "warm: call ms": round(fresh[1] * 1e3, 2),
                 "warm: copied ms": "-"})
    return rows


# ------------------------------------------------------------------------------------------------ 7. context
def context_peer(role: str, where: Any, written: Any, verdict: Any) -> None:
    """An engine in a process that never touches CUDA, over plain (pageable) host memory: the target registers 1
    MiB, the source writes it; each then asks ``nvidia-smi`` whether this process holds a GPU context."""
    import ctypes
    import subprocess

    engine = _engine()
    buf = ctypes.create_string_buffer(MiB)
    address = ctypes.addressof(buf)
    if engine.register_memory(address, MiB) != 0:
        raise RuntimeError("registering host memory failed")
    if role == "target":
        where.put((f"127.0.0.1:{engine.get_rpc_port()}", address))
        ok = written.wait(120) and buf.raw == b"\x07" * MiB
    else:
        session, remote = where.get(timeout=120)
        ctypes.memset(address, 7, MiB)
        ok = engine.transfer_sync_write(session, address, remote, MiB) == 0
        written.set()
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=60).stdout.split()
    verdict.put((role, ok, str(os.getpid()) in apps))


def context_run() -> list[dict[str, Any]]:
    where, written, verdict = _ctx.Queue(), _ctx.Event(), _ctx.Queue()
    peers = [_ctx.Process(target=context_peer, args=(role, where, written, verdict), daemon=True)
             for role in ("target", "source")]
    for peer in peers:
        peer.start()
    try:
        got = dict((role, (ok, context)) for role, ok, context in (verdict.get(timeout=180) for _ in peers))
    finally:
        for peer in peers:
            peer.join(timeout=30)
    return [{"engine build": engine_build(), "transfer ok": got["source"][0] and got["target"][0],
             "GPU context in the source": got["source"][1], "GPU context in the target": got["target"][1],
             "ok": got["source"][0] and got["target"][0] and not (got["source"][1] or got["target"][1])}]


# ------------------------------------------------------------------------------------------------ main
def table(title: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"\n### {title}\n", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def section(name: str, fn: Callable[[], list[dict[str, Any]]], results: dict[str, Any]) -> str:
    """Run one section; a failure is reported in its table and the other sections still run."""
    start = time.perf_counter()
    try:
        rows = fn()
    except Exception as e:  # report and go on: the run is one prepared command on a borrowed machine
        rows = [{"error": f"{type(e).__name__}: {e}"}]
    results[name] = rows
    print(table(f"{name} ({time.perf_counter() - start:.0f} s)", rows), flush=True)
    return table(name, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the 'device' columns' tensors live (cpu: a smoke run of the same code)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    parser.add_argument("--name", default="bench_gpu")
    args = parser.parse_args()
    device = args.device
    cuda = device.startswith("cuda")
    sizes = [4 * MiB, 16 * MiB] if args.quick else [64 * MiB, 256 * MiB, 1024 * MiB]
    repeats = 3 if args.quick else 5
    layers, nblocks = (4, 8) if args.quick else (32, 64)
    gpu = torch.cuda.get_device_name() if cuda else "none"
    print(f"device {device} ({gpu}), torch {torch.__version__}, engine {engine_build()}", flush=True)
    results: dict[str, Any] = {}
    out = [common.header(f"GPU data path ({device}: {gpu})")]

    def pipe_rows() -> list[dict[str, Any]]:
        rows = []
        for n in sizes:
            dev, host = pipe_run(device, n, repeats), pipe_run("cpu", n, repeats)
            rows.append({"MiB": n // MiB, "device ms": dev["ms"], "device GB/s": dev["GB/s"], "host ms": host["ms"],
                         "host GB/s": host["GB/s"], "device/host": round(dev["ms"] / host["ms"], 2) if host["ms"] else 0,
                         "syncs/send": dev["syncs"] if cuda else "-", "exact": dev["exact"] and host["exact"]})
        return rows

    def engine_rows() -> list[dict[str, Any]]:
        rows = []
        device_memory = cuda and "non-cuda" not in engine_build()  # only the CUDA build moves device memory
        for n in sizes:
            row: dict[str, Any] = {"MiB": n // MiB}
            for kind in (["device", "pinned"] if device_memory else ["pinned"]):
                got = engine_run(kind, n, repeats)
                label = "device->device" if kind == "device" else "pinned->pinned"
                row[f"{label} ms"], row[f"{label} GB/s"] = got["ms"], got["GB/s"]
                row[f"{label} exact"] = got["exact"]
            rows.append(row)
        return rows

    def copy_rows() -> list[dict[str, Any]]:
        return [{"MiB": n // MiB, **copies_run(n, repeats)} for n in sizes] if cuda else []

    def save_load_rows() -> list[dict[str, Any]]:
        devices = [device, "cpu"] if cuda else ["cpu"]
        return [{"cache": d, "layers": layers, "blocks": nblocks, **save_load_run(d, layers, nblocks)}
                for d in devices]

    def loop_rows() -> list[dict[str, Any]]:
        return [{"cache": device, "layers": layers, "blocks/step": nblocks,
                 **forward_loop_run(device, layers, nblocks, 4 if args.quick else 10)}]

    out.append(section("1. pipe: one tensor one way", pipe_rows, results))
    out.append(section("2. engine: one transfer_sync_write", engine_rows, results))
    out.append(section("3. copies: device -> pinned host -> device", copy_rows, results))
    out.append(section("4. connector save -> load of N blocks (pull)", save_load_rows, results))
    out.append(section("5. forward-like loop, saving on vs off", loop_rows, results))
    if cuda:
        out.append(section("6. a 1 GiB gather out of the cache, first vs warm",
                           lambda: gather_run(256 * MiB if args.quick else 1024 * MiB), results))
        out.append(section("7. a GPU context from an engine transfer of host memory?", context_run, results))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.md").write_text("".join(out))
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(
        {"commit": common.commit(), "command": common.command(), "cpu": common.cpu(), "gpu": gpu,
         "torch": torch.__version__, "device": device, "results": results}, indent=1))
    print(f"wrote {args.out_dir / args.name}.md and .json")
    failed = any("error" in row or row.get("exact") is False or row.get("ok") is False
                 for rows in results.values() for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
