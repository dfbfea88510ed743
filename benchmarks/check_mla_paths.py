#!/usr/bin/env python
"""Why a disaggregated MLA model on the CPU can answer differently from a colocated one (docs/architecture.md).

1. In-instance control, no connector: for each prompt, the log-probability of the second generated token as the
   decode path computed it (one-token step after the prompt) and as the prefill path computes it (a prefill of the
   prompt plus the first generated token). Llama and DeepSeek-V2 MLA, both with sharp random weights.
2. 1P1D with this connector on the MLA model, the consumer computing the last 1 or 2 prompt tokens itself
   (``recompute_tokens``): answers equal to a colocated instance, and the first token's log-probability gap.
3. One colocated MLA instance: the same prompts sent one at a time and all at once give different text.

Usage: .venv/bin/python benchmarks/check_mla_paths.py [--prompts N]   (~6 min)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from harness.ports import free_port  # noqa: E402
from harness.vllm import MLA_ARGS, VllmServer, build_model, connector_config, mooncake_json, start_vllm  # noqa: E402

ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(128 << 20),
        "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", *MLA_ARGS]
LENGTHS = [150, 300, 500, 800, 1100, 1500]


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 5999) for _ in range(length)] for length in LENGTHS[:n]]


def generate(server: VllmServer, tokens: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    r = server.post("/v1/completions", {"model": server.model, "prompt": tokens, "max_tokens": max_tokens,
                                        "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True})
    lp = r["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]


def paths(preset: str, work: Path, cases: list[list[int]]) -> list[dict]:
    server = VllmServer(f"{preset}-paths", build_model(preset, quiet=True), free_port(), 0, work, None, None, ARGS)
    rows = []
    try:
        start_vllm(server)
        for tokens in cases:
            gen, lps = generate(server, tokens, 2)
            again, lps2 = generate(server, tokens + gen[:1], 1)
            rows.append({"model": preset, "prompt": len(tokens), "decode": lps[1], "prefill": lps2[0],
                         "same_token": again[0] == gen[1]})
    finally:
        server.stop()
    return rows


def disaggregated(work: Path, cases: list[list[int]], recompute: int) -> list[dict]:
    mla = build_model("deepseek_mla_sharp", quiet=True)
    cfg = mooncake_json(work / f"mooncake-{recompute}.json")
    colocated = VllmServer(f"colocated-{recompute}", mla, free_port(), 0, work, None, None, ARGS)
    producer = VllmServer(f"producer-{recompute}", mla, free_port(), 0, work, connector_config("kv_producer"), cfg, ARGS)
    consumer = VllmServer(f"consumer-{recompute}", mla, free_port(), 1, work,
                          connector_config("kv_consumer", recompute_tokens=recompute), cfg, ARGS)
    rows = []
    try:
        start_vllm(colocated, producer, consumer)
        for tokens in cases:
            want, want_lp = generate(colocated, tokens, 8)
            generate(producer, tokens, 1)
            got, got_lp = generate(consumer, tokens, 8)
            rows.append({"recompute_tokens": recompute, "prompt": len(tokens), "equal": got == want,
                         "first_logprob_gap": abs(got_lp[0] - want_lp[0])})
        hits = consumer.metric("vllm:external_prefix_cache_hits_total")
        moved = consumer.metric("vllm:mooncake_kv_loaded_bytes_total")
        rows.append({"recompute_tokens": recompute, "external_hits": hits, "loaded_bytes": moved})
    finally:
        for server in (colocated, producer, consumer):
            server.stop()
    return rows


def batching(work: Path, cases: list[list[int]]) -> dict:
    """A colocated instance of the MLA model (normal weights): the same prompts sent one at a time, then all at once."""
    server = VllmServer("batching", build_model("deepseek_mla", quiet=True), free_port(), 0, work, None, None, ARGS)
    try:
        start_vllm(server)
        alone = [generate(server, tokens, 12)[0] for tokens in cases]
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            together = [ids for ids, _ in pool.map(lambda t: generate(server, t, 12), cases)]
    finally:
        server.stop()
    return {"prompts": len(cases), "equal": sum(a == b for a, b in zip(alone, together, strict=True))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=6, help=f"prompts per run (at most {len(LENGTHS)})")
    args = ap.parse_args()
    cases = prompts(args.prompts)
    with tempfile.TemporaryDirectory(prefix="mla-paths-") as tmp:
        work = Path(tmp)
        control = paths("llama_sharp", work, cases) + paths("deepseek_mla_sharp", work, cases)
        pd = disaggregated(work, cases, 1) + disaggregated(work, cases, 2)
        batched = batching(work, cases + [[random.Random(100 + i).randrange(3, 5999) for _ in range(200 + 150 * i)]
                                          for i in range(3)])
    lines = [common.header("MLA on the CPU: decode path vs prefill path, and 1P1D", "float32"),
             "\n## 1. One instance, no connector: log-probability of the 2nd generated token\n",
             "| model | prompt tokens | decode path | prefill path | abs diff | same greedy token |",
             "|---|---:|---:|---:|---:|---|"]
    for r in control:
        lines.append(f"| {r['model']} | {r['prompt']} | {r['decode']:.5f} | {r['prefill']:.5f} | "
                     f"{abs(r['decode'] - r['prefill']):.2e} | {r['same_token']} |")
    lines += ["\n## 2. 1P1D (deepseek_mla_sharp, pull): the consumer computes the last N prompt tokens\n",
              "| recompute_tokens | answers equal colocated | max first-token log-prob gap | external hits | "
              "loaded MiB |", "|---:|---:|---:|---:|---:|"]
    for recompute in (1, 2):
        rows = [r for r in pd if r["recompute_tokens"] == recompute and "equal" in r]
        totals = next(r for r in pd if r["recompute_tokens"] == recompute and "loaded_bytes" in r)
        lines.append(f"| {recompute} | {sum(r['equal'] for r in rows)}/{len(rows)} | "
                     f"{max(r['first_logprob_gap'] for r in rows):.4f} | {totals['external_hits']:.0f} | "
                     f"{totals['loaded_bytes'] / 2**20:.1f} |")
    lines += ["\n## 3. One colocated instance, no connector (deepseek_mla, normal weights): prompts alone vs together\n",
              f"{batched['equal']} of {batched['prompts']} answers (12 tokens) are the same when the prompts are sent "
              "together as when each is sent alone."]
    table = "\n".join(lines) + "\n"
    print(table)
    common.write("check_mla_paths", {"control": control, "disaggregated": pd, "batching": batched}, table)


if __name__ == "__main__":
    main()
