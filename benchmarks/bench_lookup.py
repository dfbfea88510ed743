"""What "find before you claim" (#45) costs and gives, on the seed's flow under vLLM's default policy.

One producer (core 0) and one consumer (core 1) serving the kv32k model with the MooncakeConnector, started as the
README starts them (no ``kv_load_failure_policy``: vLLM's ``fail``), no proxy. For each of ``--requests`` rounds, two
fresh prompts of ``--tokens`` tokens, streamed to the consumer with no ``kv_transfer_params``:

- *miss*: straight to the consumer (no producer ever saw it);
- *hit*: the seed's flow: a ``max_tokens=1`` prefill on the producer first, then the request to the consumer.

Columns: the consumer's TTFT p50 / p99 for each; the KV the consumer loaded per hit (its connector's
``fetched_bytes``: bytes that moved, not vLLM's hit counter); the lookup's latency p50 / p99 (its
``vllm:mooncake_kv_lookup_seconds`` histogram, interpolated as Prometheus' ``histogram_quantile`` does).

Rows: the same stack run from two trees in one run, one after the other: ``--before`` (a commit, checked out in a
temporary worktree and put first on the instances' ``PYTHONPATH``; default: the tree before #45) and this tree.

Run (from the repository root; ~4 minutes)::

    .venv/bin/python benchmarks/bench_lookup.py
    .venv/bin/python benchmarks/bench_lookup.py --requests 16 --tokens 2000 --before ade59f7

Prints a markdown table and writes bench_lookup.json / bench_lookup.md to ``--out-dir`` (default
benchmarks/results).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support import common  # noqa: E402
from benchmarks.support.stacks import serve_args_for, stream  # noqa: E402
from harness.ports import free_port  # noqa: E402
from harness.vllm import VllmServer, build_model, connector_config, mooncake_json  # noqa: E402

BEFORE = "ade59f7"  # the landed tree #45 was filed against


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 5000) for _ in range(n)]


def scrape(server: VllmServer) -> str:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        return resp.read().decode()


def counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def buckets(text: str, name: str) -> list[tuple[float, float]]:
    """The cumulative (upper bound, count) pairs of histogram ``name``, summed over labels."""
    out: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            le = float("inf") if bound == "+Inf" else float(bound)
            out[le] = out.get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return sorted(out.items())


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile (0..1) of the observations made between two scrapes of one histogram (linear within a
    bucket, as Prometheus' histogram_quantile)."""
    was = dict(before)
    cumulative = [(le, n - was.get(le, 0.0)) for le, n in after]
    total = cumulative[-1][1] if cumulative else 0.0
    if not total:
        return None
    rank, low, seen = q * total, 0.0, 0.0
    for le, n in cumulative:
        if n >= rank:
            if le == float("inf"):
                return low
            return low + (le - low) * ((rank - seen) / (n - seen) if n > seen else 0.0)
        low, seen = le, n
    return low


@contextlib.contextmanager
def tree_at(ref: str) -> Iterator[Path]:
    """A temporary git worktree of ``ref``."""
    with tempfile.TemporaryDirectory(prefix="bench-lookup-tree-") as tmp:
        path = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=ROOT, capture_output=True)


def run_stack(name: str, model: Path, work: Path, serve_args: list[str], tree: Path | None, args: argparse.Namespace,
              seed: int) -> dict[str, Any]:
    """One producer and one consumer (from ``tree``, None: this one); the figures of ``args.requests`` rounds."""
    work.mkdir(parents=True, exist_ok=True)
    config = mooncake_json(work / "mooncake.json", timeout=30)
    env = {"PYTHONPATH": str(tree)} if tree is not None else {}
    producer = VllmServer(f"{name}-producer", model, free_port(), 0, work,
                          connector_config("kv_producer", failure_policy=None), config, serve_args, env)
    consumer = VllmServer(f"{name}-consumer", model, free_port(), 1, work,
                          connector_config("kv_consumer", failure_policy=None), config, serve_args, env)
    rng = random.Random(seed)
    body = {"model": str(model), "max_tokens": 4, "temperature": 0.0}
    try:
        producer.wait_ready()
        consumer.wait_ready()
        for _ in range(args.warmup):
            tokens = prompt(rng, args.tokens)
            producer.complete(tokens, 1)
            stream(consumer.url, "/v1/completions", {**body, "prompt": tokens})
            stream(consumer.url, "/v1/completions", {**body, "prompt": prompt(rng, args.tokens)})
        time.sleep(1.0)
        before = scrape(consumer)
        miss, hit = [], []
        for _ in range(args.requests):
            ttft, _, _ = stream(consumer.url, "/v1/completions", {**body, "prompt": prompt(rng, args.tokens)})
            miss.append(ttft)
            tokens = prompt(rng, args.tokens)
            producer.complete(tokens, 1)
            ttft, _, _ = stream(consumer.url, "/v1/completions", {**body, "prompt": tokens})
            hit.append(ttft)
        time.sleep(1.0)
        consumer.complete([1, 2, 3], 1, kv_transfer_params={"do_remote_prefill": False})  # a step: stats reach /metrics
        after = scrape(consumer)
    finally:
        producer.stop()
        consumer.stop()
    fetched = counter(after, "vllm:mooncake_kv_fetched_bytes_total") - counter(before, "vllm:mooncake_kv_fetched_bytes_total")
    loaded = counter(after, "vllm:mooncake_kv_loaded_total") - counter(before, "vllm:mooncake_kv_loaded_total")
    lookups_before = buckets(before, "vllm:mooncake_kv_lookup_seconds")
    lookups_after = buckets(after, "vllm:mooncake_kv_lookup_seconds")
    return {"miss_ttft_s": miss, "hit_ttft_s": hit, "loaded": loaded, "fetched_bytes": fetched,
            "lookup_p50_s": quantile(lookups_before, lookups_after, 0.5),
            "lookup_p99_s": quantile(lookups_before, lookups_after, 0.99),
            "lookups": (lookups_after[-1][1] if lookups_after else 0.0)
            - (lookups_before[-1][1] if lookups_before else 0.0)}


def ms(values: list[float], q: float) -> str:
    return common.fmt(common.percentile(values, q) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--before", default=BEFORE, help="the commit to compare with (default: the tree before #45)")
    parser.add_argument("--model", default="kv32k")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU computes it natively")
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    dtype = args.dtype or common.native_dtype()
    model = build_model(args.model, quiet=True)
    serve_args = serve_args_for(dtype)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-lookup-") as tmp, tree_at(args.before) as before_tree:
        for name, tree in ((f"before ({args.before})", before_tree), (f"after ({common.commit()})", None)):
            print(f"{name}: starting the pair ...", flush=True)
            results[name] = run_stack(name.split()[0], model, Path(tmp) / name.split()[0], serve_args, tree, args,
                                      seed=7)
    lines = [common.header("Find before you claim: the seed's flow under vLLM's default policy", dtype),
             f"\nkv32k model, {args.tokens}-token prompts, {args.requests} rounds (after {args.warmup} untimed), one "
             "request at a time, streamed, no kv_transfer_params, no kv_load_failure_policy set; producer core 0, "
             "consumer core 1, on 127.0.0.1. TTFT is the consumer's (the producer's prefill of a hit is not in it). "
             "KV loaded: the consumer connector's fetched bytes over the timed hits.\n",
             "| tree | paramless miss TTFT p50 / p99 (ms) | paramless hit TTFT p50 / p99 (ms) | hits loaded | KV loaded "
             "per hit (MiB) | lookup p50 / p99 (ms) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lookup = "-" if r["lookup_p50_s"] is None else \
            f"{r['lookup_p50_s'] * 1e3:.1f} / {r['lookup_p99_s'] * 1e3:.1f} ({r['lookups']:.0f} lookups)"
        lines.append(f"| {name} | {ms(r['miss_ttft_s'], 50)} / {ms(r['miss_ttft_s'], 99)} | "
                     f"{ms(r['hit_ttft_s'], 50)} / {ms(r['hit_ttft_s'], 99)} | {r['loaded']:.0f} of {args.requests} | "
                     f"{r['fetched_bytes'] / max(args.requests, 1) / 2**20:.1f} | {lookup} |")
    table = "\n".join(lines) + "\n"
    print(table)
    common.write("bench_lookup", {"dtype": dtype, "tokens": args.tokens, "requests": args.requests,
                                  "results": results}, table, args.out_dir)


if __name__ == "__main__":
    main()
