#!/usr/bin/env python
"""Every KV layout in both modes and across TP sizes: architecture x mode x (producer TP -> consumer TP).

For each combination: a producer and a consumer serving a tiny model of that architecture (scripts/build_tiny_model.py,
float32, eager), and the colocated reference: the producer itself with its prefix cache emptied (same TP), else a
colocated instance of the consumer's TP size. Six unique prompts of 150-1,500 tokens, one at a time, are prefilled on
the producer and decoded (12 tokens, greedy) on the consumer. Columns: answers equal to the reference; KV bytes the
consumer's loads wrote (moved) vs the bytes of the tokens it claimed (claimed: external prefix-cache hits x KV bytes
per token; a TP 2 consumer's two ranks each write their own heads, an MLA consumer's each the whole latent); bytes
fetched over the wire (pull); bytes the producer saved (the prefill's save plus the reference's: an MLA producer saves
on one rank only); p50 load time from the connector's log (pull: request, transfer and copy; push: the wait for the
push's commit plus the copy).

Usage: .venv/bin/python benchmarks/bench_architectures.py [--only NAME ...] [--prompts N]   (~25 min for all)
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from harness.ports import free_port, port_pair  # noqa: E402
from harness.vllm import MLA_ARGS, VllmServer, build_model, connector_config, mooncake_json, start_vllm  # noqa: E402
from scripts.build_tiny_model import kv_bytes_per_token  # noqa: E402

LENGTHS = [150, 300, 500, 800, 1100, 1500]
MAX_TOKENS = 12
ARCHS = ["tiny", "qwen2", "qwen3", "mistral", "gemma2", "deepseek_mla"]
# (preset, mode, producer TP, consumer TP)
RUNS = [(a, m, 1, 1) for a in ARCHS for m in ("pull", "push")] + \
       [(a, "pull", p, c) for a in ("tiny", "deepseek_mla") for p, c in ((2, 2), (2, 1), (1, 2))]
LOAD_LINE = re.compile(r"loaded request \S+ \((pulled|pushed)\): .* in ([\d.]+) ms")


def serve_args(tp: int, mla: bool = False) -> list[str]:
    return ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes",
            str(128 << 20), "--max-num-batched-tokens", "2048", "--tensor-parallel-size", str(tp),
            *(MLA_ARGS if mla else [])]


def tp_env(tp: int, core: int) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else str(core)}


def run(preset: str, mode: str, ptp: int, ctp: int, work: Path, cases: list[list[int]]) -> dict:
    path = build_model(preset, quiet=True)
    mla = preset == "deepseek_mla"
    cfg = mooncake_json(work / f"{preset}-{mode}-{ptp}{ctp}.json", prefill_url=f"127.0.0.1:{port_pair()}",
                        decode_url=f"127.0.0.1:{port_pair()}")
    name = f"{preset}-{mode}-tp{ptp}to{ctp}"
    producer = VllmServer(f"{name}-producer", path, free_port(), 0, work, connector_config("kv_producer",
                          transfer_mode=mode), cfg, serve_args(ptp, mla), {**tp_env(ptp, 0), "VLLM_SERVER_DEV_MODE": "1"})
    consumer = VllmServer(f"{name}-consumer", path, free_port(), 1, work, connector_config("kv_consumer",
                          transfer_mode=mode), cfg, serve_args(ctp, mla), tp_env(ctp, 1))
    servers = [producer, consumer]
    reference = None
    if ptp != ctp:
        reference = VllmServer(f"{name}-colocated", path, free_port(), 0, work, None, None,
                               [*serve_args(ctp, mla), "--no-enable-prefix-caching"], tp_env(ctp, 0))
        servers.append(reference)
    equal = 0
    try:
        start_vllm(*servers)
        for tokens in cases:
            if reference is None:
                producer.post("/reset_prefix_cache", {})
                want = producer.complete(tokens, MAX_TOKENS)
            else:
                want = reference.complete(tokens, MAX_TOKENS)
            body = {"model": producer.model, "prompt": tokens, "max_tokens": 1, "temperature": 0.0,
                    "kv_transfer_params": {"do_remote_decode": True}}
            params = producer.post("/v1/completions", body)["kv_transfer_params"]
            equal += consumer.complete(tokens, MAX_TOKENS, kv_transfer_params=params) == want
        hits = consumer.metric("vllm:external_prefix_cache_hits_total")
        loaded = consumer.metric("vllm:mooncake_kv_loaded_bytes_total")
        fetched = consumer.metric("vllm:mooncake_kv_fetched_bytes_total")
        saved = producer.metric("vllm:mooncake_kv_saved_bytes_total")
        times = [float(m.group(2)) for m in LOAD_LINE.finditer(consumer.log_text())]
    finally:
        for server in servers:
            server.stop()
    per_token = kv_bytes_per_token(json.loads((path / "config.json").read_text()), 4)  # float32
    return {"arch": preset, "mode": mode, "tp": f"{ptp} -> {ctp}", "equal": equal, "prompts": len(cases),
            "claimed_bytes": hits * per_token, "loaded_bytes": loaded, "fetched_bytes": fetched, "saved_bytes": saved,
            "loads": len(times), "load_ms_p50": statistics.median(times) if times else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="architectures to run (default: all)")
    ap.add_argument("--prompts", type=int, default=len(LENGTHS))
    args = ap.parse_args()
    rng = random.Random(11)
    cases = [[rng.randrange(3, 5999) for _ in range(n)] for n in LENGTHS[:args.prompts]]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-arch-") as tmp:
        for preset, mode, ptp, ctp in RUNS:
            if args.only and preset not in args.only:
                continue
            row = run(preset, mode, ptp, ctp, Path(tmp), cases)
            print(row, flush=True)
            rows.append(row)
    lines = [common.header("Architectures x modes x TP sizes: answers and KV moved", "float32"), "",
             "| architecture | mode | TP | answers = colocated | moved / claimed | fetched MiB | saved MiB | loads | "
             "load p50 ms |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["loaded_bytes"] / r["claimed_bytes"] if r["claimed_bytes"] else float("nan")
        p50 = f"{r['load_ms_p50']:.1f}" if r["load_ms_p50"] is not None else "-"
        lines.append(f"| {r['arch']} | {r['mode']} | {r['tp']} | {r['equal']}/{r['prompts']} | {ratio:.3f} "
                     f"({r['loaded_bytes'] / 2**20:.1f} / {r['claimed_bytes'] / 2**20:.1f} MiB) | "
                     f"{r['fetched_bytes'] / 2**20:.1f} | {r['saved_bytes'] / 2**20:.1f} | {r['loads']} | {p50} |")
    table = "\n".join(lines) + "\n"
    print(table)
    common.write("bench_architectures", {"runs": rows}, table)


if __name__ == "__main__":
    main()
