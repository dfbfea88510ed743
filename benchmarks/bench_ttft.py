"""Where a disaggregated request's time to first token goes, one request at a time, next to a colocated instance.

The stacks of ``benchmarks/support/stacks.py`` (bench_e2e's: the same ``vllm serve`` settings, one core per instance,
each stack alone on the machine): ``colocated`` (one plain instance), ``ours`` (pull) and ``push`` (a producer on
core 0, a consumer on core 1, ``proxy_server.py`` in front). For each of ``--requests`` fresh prompts of
``--tokens`` tokens (after ``--warmup`` untimed ones), streamed, ``max_tokens`` 4, greedy:

- colocated: TTFT from the plain instance;
- ours / push:
  1. *through the proxy*: TTFT of the request sent to ``proxy_server.py``, as a client sees it; push: the proxy
     sends the decode request together with the prefill (``--dispatch concurrent``, its default), and, on another
     fresh prompt, after the prefill answered (``--dispatch sequential``, a second proxy in front of the same
     instances; row 1b);
  2. *prefill*: a fresh prompt's prefill request sent to the producer by hand (``max_tokens`` 1,
     ``do_remote_decode``; push: ``mooncake_push_to`` the consumer's pipes, as the proxy would), to its answer;
  3. *decode TTFT*: then that prompt's streamed request to the consumer with the prefill's ``kv_transfer_params``;
     the consumer's load line splits its KV part (push: the wait for the push's commit and the copy from the
     staging area; pull: the fetch into the KV cache blocks);
  4. *consumer floor*: the same prompt to the consumer again, now wholly in its own prefix cache (nothing to load;
     it computes the last token, as in 3);
  5. *producer alone*: another fresh prompt streamed straight from the producer (no remote decode): its own TTFT with
     the connector saving (pull) or pushing (push) the prompt's KV while it prefills.

2 + 3 is the proxy path without the proxy; 5 against colocated is what saving or pushing the KV costs the producer;
3 is the decode instance's share (vLLM's disaggregation protocol has the consumer compute the prompt's last token
itself, after its KV arrived).

Run (from the repository root; ~4 minutes)::

    .venv/bin/python benchmarks/bench_ttft.py
    .venv/bin/python benchmarks/bench_ttft.py --modes colocated push --requests 4

Prints a markdown table and writes bench_ttft.json / bench_ttft.md to ``--out-dir`` (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import random
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

from benchmarks.support import common  # noqa: E402
from benchmarks.support.stacks import OURS_LOADED, PUSH_SPLIT, LogTail, Stacks, post, serve_args_for, stream  # noqa: E402
from kv_connector.param_keys import PUSH_TO  # noqa: E402
from kv_proxy.discovery import push_target  # noqa: E402

MODES = ("colocated", "ours", "push")
LABELS = {"colocated": "colocated", "ours": "ours pull", "push": "ours push"}
PHASES = (("ttft", "TTFT (colocated: the instance; else through the proxy)"),
          ("ttft_sequential", "1b. TTFT through the proxy, sequential dispatch (push)"),
          ("prefill", "2. prefill request to the producer, to its answer"),
          ("decode_ttft", "3. decode request's TTFT on the consumer"),
          ("hand_sum", "2 + 3"),
          ("push_wait", "   of which the wait for the push's commit (push)"),
          ("push_copy", "   of which the copy from the staging area (push)"),
          ("pull_load", "   of which the pull load (pull)"),
          ("consumer_floor", "4. consumer TTFT, prompt in its own prefix cache"),
          ("producer_alone", "5. producer's own TTFT, a plain request"))


def run_stack(mode: str, model: Path, work: Path, dtype: str, prompts: list[list[int]], warmup: int,
              vocab: int) -> dict[str, list[float]]:
    stacks = Stacks(model, work, (mode,), serve_args_for(dtype))
    print(f"{mode}: starting ...", flush=True)
    stacks.start()
    sequential = stacks.start_extra_proxy(stacks.proxy_args(mode, "--dispatch", "sequential")) if mode == "push" \
        else None
    out: dict[str, list[float]] = {}

    def add(key: str, ms: float, i: int) -> None:
        if i >= warmup:
            out.setdefault(key, []).append(ms)

    # the by-hand prompts are other fresh prompts: nothing the proxy path left in a prefix cache
    def variant(p: list[int], k: int) -> list[int]:
        return [3 + (t + k) % (vocab - 3) for t in p]

    try:
        for i, p in enumerate(prompts):
            if mode == "colocated":
                add("ttft", stream(stacks.servers["colocated"].url, "/v1/completions", stacks.body(p, 4))[0] * 1e3, i)
                continue
            producer, consumer = stacks.servers[f"{mode}-producer"], stacks.servers[f"{mode}-consumer"]
            tail = LogTail(consumer.log)
            through = [("ttft", stacks.proxy_url, p)]
            if sequential is not None:  # both dispatches on fresh prompts, in turn first
                through.insert(i % 2, ("ttft_sequential", sequential, variant(p, 19)))
            for key, url, prompt in through:
                add(key, stream(url, "/v1/completions", stacks.body(prompt, 4))[0] * 1e3, i)
            tail.new()
            q = variant(p, 7)
            params: dict[str, Any] = {"do_remote_decode": True}
            if mode == "push":
                with urllib.request.urlopen(f"{consumer.url}/metrics", timeout=10) as resp:
                    target = push_target(resp.read().decode())
                params[PUSH_TO] = None if target is None else target[0]
            start = time.perf_counter()
            answer = post(producer.url, "/v1/completions", stacks.body(q, 1, kv_transfer_params=params))
            prefill = (time.perf_counter() - start) * 1e3
            decode = stream(consumer.url, "/v1/completions",
                            stacks.body(q, 4, kv_transfer_params=answer.get("kv_transfer_params")))[0] * 1e3
            add("prefill", prefill, i)
            add("decode_ttft", decode, i)
            add("hand_sum", prefill + decode, i)
            log = tail.new()
            if (m := PUSH_SPLIT.search(log)) is not None:
                add("push_wait", float(m.group(1)), i)
                add("push_copy", float(m.group(2)), i)
            elif (m := OURS_LOADED.search(log)) is not None:
                add("pull_load", float(m.group(3)), i)
            elif i >= warmup:
                print(f"  {mode} #{i}: no load line in the consumer's log (KV not transferred?)", flush=True)
            add("consumer_floor", stream(consumer.url, "/v1/completions", stacks.body(q, 4))[0] * 1e3, i)
            add("producer_alone", stream(producer.url, "/v1/completions", stacks.body(variant(p, 13), 4))[0] * 1e3, i)
            if i >= warmup:
                print(f"  {mode} #{i - warmup}: proxy TTFT {out['ttft'][-1]:.1f} ms = prefill {prefill:.1f} + decode "
                      f"{decode:.1f} by hand", flush=True)
    finally:
        stacks.stop()
    return out


def markdown(results: dict[str, dict[str, list[float]]], args: argparse.Namespace, dtype: str) -> str:
    modes = [m for m in MODES if m in results]
    med = {m: {k: statistics.median(v) for k, v in results[m].items()} for m in modes}
    base = med.get("colocated", {}).get("ttft")
    lines = [common.header("Where the time to first token goes, one request at a time (bench_ttft.py)", dtype), "",
             f"kv32k model, {args.tokens}-token fresh prompts, {args.requests} per stack (after {args.warmup} "
             "untimed), streamed, greedy; p50 in ms (x colocated TTFT where it is a TTFT). See the script's "
             "docstring for what each row times.", "",
             "| | " + " | ".join(LABELS[m] for m in modes) + " |", "|---|" + "---:|" * len(modes)]
    for key, label in PHASES:
        cells = []
        for m in modes:
            value = med[m].get(key)
            ratio = f" (x{value / base:.2f})" if value is not None and base and key in (
                "ttft", "ttft_sequential", "hand_sum", "producer_alone") else ""
            cells.append("-" if value is None else f"{value:.1f}{ratio}")
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if base and "push" in med:
        p = med["push"]
        lines += ["", f"Push TTFT through the proxy x{p['ttft'] / base:.2f} colocated with concurrent dispatch, "
                  f"x{p['ttft_sequential'] / base:.2f} with sequential (issue #17's target: <= 1.05). "
                  f"Of the {p['ttft'] - base:.0f} ms over colocated, the producer's prefill with the push running takes "
                  f"{p['producer_alone'] - base:.0f} ms more than colocated's (row 5), and the consumer's part is "
                  f"{p['decode_ttft']:.0f} ms (row 3; its own floor with nothing to load: "
                  f"{p['consumer_floor']:.0f} ms, row 4), of which waiting for the KV {p.get('push_wait', 0):.1f} ms "
                  f"and copying it {p.get('push_copy', 0):.1f} ms."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 where the CPU computes it natively")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=common.RESULTS)
    args = parser.parse_args()
    model = ROOT / ".cache" / "models" / "kv32k"
    if not (model / "config.json").is_file():
        print(f"{model} is missing: run scripts/setup.sh", file=sys.stderr)
        return 2
    dtype = args.dtype or common.native_dtype()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.tokens)] for _ in range(args.warmup + args.requests)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop every server
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ttft-") as tmp:
        for mode in [m for m in MODES if m in args.modes]:
            results[mode] = run_stack(mode, model, Path(tmp), dtype, prompts, args.warmup, vocab)
    table = markdown(results, args, dtype)
    print(table)
    common.write("bench_ttft", {"dtype": dtype, "tokens": args.tokens, "samples_ms": results}, table, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
