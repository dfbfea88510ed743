"""The vLLM pair bench_loads and bench_loads_single load from: a producer (core 0) and a consumer (core 1) serving the
realistic-KV tiny model (``kv32k``) with our connector in pull mode; prompts prefilled on the producer, their decode
requests sent to the consumer, and what the consumer reports of its loads (its stats, its load lines)."""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.support import common
from harness.ports import free_port
from harness.vllm import REPO, VllmServer, mooncake_json, start_vllm

MODEL = REPO / ".cache" / "models" / "kv32k"
BLOCK = 128
ROW_BYTES = 8 * 8 * 128 * 256 * 2  # kv32k in bfloat16: 8 layers x [8 heads, 128 tokens, K and V of 128] per block


def prepare(dtype: str | None) -> str | None:
    """A loads benchmark's start: the dtype it runs (None: the model is missing, said on stderr); SIGTERM runs the
    finally blocks that stop the vLLM instances."""
    if not MODEL.is_dir():
        print(f"{MODEL} is missing: run scripts/setup.sh", file=sys.stderr)
        return None
    dtype = dtype or common.native_dtype()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if dtype != "bfloat16":
        print("note: the KV sizes below assume bfloat16; with float32 every load moves twice the bytes", file=sys.stderr)
    return dtype


def serve_args(dtype: str, kv_bytes: int) -> list[str]:
    return ["--dtype", dtype, "--enforce-eager", "--max-model-len", "3200", "--kv-cache-memory-bytes", str(kv_bytes),
            "--max-num-seqs", "128"]


def start(work: Path, dtype: str, concurrency: int, max_in_flight: int, kv_digest: str = "sampled"
          ) -> tuple[VllmServer, VllmServer]:
    """The pair, started (``kv_digest``: both instances' option)."""
    config = mooncake_json(work / "mooncake.json", timeout=30)
    kv_max = max_in_flight * 3072 * 32 * 1024
    connector = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector",
                 "kv_load_failure_policy": "recompute"}
    producer = VllmServer("producer", MODEL, free_port(), 0, work,
                          {**connector, "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"buffer_size": kv_max + (1 << 30), "entry_ttl": 600,
                                                         "kv_digest": kv_digest}},
                          config, serve_args(dtype, 1 << 30))
    consumer = VllmServer("consumer", MODEL, free_port(), 1, work,
                          {**connector, "kv_role": "kv_consumer",
                           "kv_connector_extra_config": {"load_concurrency": concurrency, "load_timeout": 120,
                                                         "kv_digest": kv_digest}},
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


def load_timings(log: Path, skip: int) -> list[tuple[float, float, float, float]]:
    """(total, fetch, copy, digest check) ms of each pulled load in the consumer's log after the first ``skip`` of
    them (the check 0 where the load was not checked)."""
    pattern = re.compile(r"loaded request \S+ \(pulled\).* in ([\d.]+) ms \([\d.]+ GB/s; fetch ([\d.]+) ms, "
                         r"(?:copy into the KV cache ([\d.]+) ms|received into the KV cache blocks)"
                         r"(?:, digest check ([\d.]+) ms)?\)")
    found = [(float(a), float(b), float(c or 0), float(d or 0))
             for a, b, c, d in pattern.findall(log.read_text(errors="replace"))]
    return found[skip:]


def single_load(producer: VllmServer, consumer: VllmServer, prompt: list[int], what: str,
                timeout: float = 20.0) -> tuple[float, float, float, float]:
    """Prefill ``prompt`` on the producer, then its decode request (``max_tokens`` 1) on the consumer: the
    ``load_timings`` of that one pulled load (``what`` names it if its load line does not come)."""
    prefill(producer, [prompt])
    seen = len(load_timings(consumer.log, 0))
    post(consumer, prompt, 1)
    deadline = time.monotonic() + timeout
    while not (found := load_timings(consumer.log, seen)) and time.monotonic() < deadline:
        time.sleep(0.02)
    if len(found) != 1:
        raise RuntimeError(f"{what}: {len(found)} pulled-load lines in the consumer's log (expected 1)")
    return found[0]
