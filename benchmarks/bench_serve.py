"""Under load: ``vllm bench serve`` against a colocated pair, our 1P1D (pull and push) and vLLM's built-in connector.

Four stacks serve the realistic-KV tiny model (``kv32k``: 8 layers, 32 KiB of KV per token in bfloat16, built by
scripts/setup.sh) on the same two cores, each vLLM instance pinned to one of them, started by this script on
127.0.0.1 with the instances of ``benchmarks/support/stacks.py`` and identical ``vllm serve`` settings (bench_e2e's:
eager, max-model-len 4608, 1 GiB of KV cache, 8 sequences at most; the dtype of this CPU, see below).
The stacks run one after the other, each alone on the machine; each is started once, serves all its runs, and stops:

- ``colocated``: two plain vLLM instances (no connector), core 0 and core 1, behind
  ``benchmarks/peers/round_robin_proxy.py`` (each request, whole, to the next instance; streams pass through).
  The same hardware as a 1P1D pair, and the same single HTTP hop in front.
- ``ours``: a producer (core 0) and a consumer (core 1) with ``kv_connector.mooncake_connector`` (P2PHANDSHAKE, TCP)
  behind ``proxy_server.py`` (a ``max_tokens=1`` prefill on the producer, then the streamed request on the consumer).
  Pull mode.
- ``push``: the same with ``"transfer_mode": "push"``.
- ``builtin``: vLLM's own MooncakeConnector over TCP (through ``benchmarks/peers/builtin_mooncake_shim.py``, a CPU
  device shim) behind ``proxy_server.py --protocol bootstrap``.

Python's thread switch interval is as in bench_e2e: our connector sets 0.1 ms in our instances (its
``gil_switch_interval`` default), the other stacks keep Python's 5 ms; no variable is set for it.

The load is vLLM's own client, ``vllm bench serve`` (run as a command; its ``--save-result --save-detailed`` JSON is
read back): ``--dataset-name random`` prompts of exactly ``--random-input-len`` tokens, 128 output tokens with
``--ignore-eos``, streamed ``/v1/completions``, Poisson arrivals at each ``--request-rate`` of a sweep from light
load to beyond what the colocated pair sustains. Every stack gets the same prompts at each point (one seed per
point, so a later point does not replay an earlier one's prompts into the prefix caches). Columns, as
``vllm bench serve`` measures them on the client:

- TTFT: send to the first streamed token; ITL: between two consecutive streamed chunks, over all requests;
  TPOT: per request, (latency - TTFT) / (output tokens - 1); p50 and p99;
- out tok/s: output tokens / the run's duration (first send to last answer); req/s: completed requests / duration;
- goodput: requests / duration that met the SLO (TTFT <= SLO and TPOT <= SLO, vLLM's definition), computed here
  from the per-request figures. By default the SLO of each prompt length is derived from the colocated pair's
  lowest-rate point: TTFT <= ``--slo-ttft-x`` x its TTFT p50 and TPOT <= ``--slo-tpot-x`` x its TPOT p50 (so the
  colocated stack runs first); ``--slo-ttft-ms``/``--slo-tpot-ms`` set it instead. The output states it.
- KV used: growth of the consumer's ``vllm:external_prefix_cache_hits_total`` over (prompt tokens - 1) per request:
  the share of the prompt the decode instance did not compute itself (1.00: every request's KV came over).

A ``MC1`` row: one request at a time (``--max-concurrency 1``), for the TTFT target.

Targets (printed as met / NOT met with the numbers):

1. 1P1D (ours pull and push) ITL p99 <= 0.5x the colocated pair's, at the lowest swept rate where the colocated
   pair's ITL p99 has at least doubled from its lowest-rate value;
2. 1P1D goodput (the best over the sweep) >= 1.2x the colocated pair's;
3. push TTFT (p50) <= 1.05x colocated at 1024 tokens, one request at a time (the MC1 row).

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_serve.py           # reduced: 1024-token sweep, one 3072 point; ~12 minutes
    .venv/bin/python benchmarks/bench_serve.py --full    # 1024 and 3072 full sweeps, more prompts; ~1.5 hours (estimate)
    .venv/bin/python benchmarks/bench_serve.py --modes colocated push --rates 1024=0.5,2 --prompts 6  # shorter

It prints a markdown table and writes bench_serve.json, bench_serve.md and bench_serve.png (ITL p99 and TTFT p99 vs
request rate per stack) to ``--out-dir`` (default benchmarks/results).

Caveats: the client, the proxies and the vLLM API servers are not pinned and share the two cores with the engines,
in every stack alike; a few prompts per rate make p99 figures coarse (the ITL p99 is over ~127 gaps per request,
so with 8 requests a single decode step that waited for another request's prefill can set it: the colocated pair's
lowest-rate "idle" ITL p99 can already be such a step). Each run's ``vllm bench serve`` output and JSON and
every server's log are in a temporary directory, kept with ``--keep-logs`` or when a stack failed.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support.common import (  # noqa: E402
    cpu,
    fmt,
    header,
    native_dtype,
    vllm_version,
    write,
)
from benchmarks.support.serve_client import goodput, run_bench_serve  # noqa: E402
from benchmarks.support.stacks import Stacks, serve_args_for, stream  # noqa: E402
from harness.ports import HOST  # noqa: E402
from harness.vllm import VllmServer  # noqa: E402

MODES = ("colocated", "ours", "push", "builtin")
LABELS = {"colocated": "colocated x2", "ours": "ours pull", "push": "ours push", "builtin": "built-in"}
MAX_MODEL_LEN = 4608
OUTPUT_LEN = 128
TARGET_LENGTH = 1024            # the MC1 (TTFT) target's prompt length
ITL_RATIO_TARGET = 0.5          # 1P1D / colocated ITL p99, where the colocated ITL p99 has doubled
ITL_DOUBLING = 2.0
GOODPUT_RATIO_TARGET = 1.2      # 1P1D / colocated best goodput
PUSH_TTFT_RATIO_TARGET = 1.05   # push / colocated TTFT p50, one request at a time, 1024 tokens

# Request rates (req/s) per prompt length: from light load to beyond what the colocated pair sustains (the load is
# decode-bound; benchmarks/results/NOTES.md has the figures these sweeps were chosen from).
REDUCED = {"rates": {1024: [0.25, 0.5, 1.0, 2.0], 3072: [0.5]}, "duration": 8.0, "prompts": 8, "mc1_prompts": 5}
FULL = {"rates": {1024: [0.125, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0], 3072: [0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5]},
        "duration": 40.0, "prompts": 16, "mc1_prompts": 16}


@dataclass
class Point:
    """One ``vllm bench serve`` run against one stack."""

    stack: str
    length: int
    rate: float | None            # req/s; None: all at once (the MC1 row, with max_concurrency 1)
    max_concurrency: int | None
    prompts: int
    seed: int
    completed: int = 0
    failed: int = 0
    duration: float = 0.0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    tpot_p50: float | None = None
    tpot_p99: float | None = None
    output_throughput: float | None = None
    request_throughput: float | None = None
    goodput: float | None = None           # computed here against the stated SLO
    vllm_goodput: float | None = None      # vllm bench serve's own, when the SLO was known before the run
    kv_used: float | None = None           # 1P1D: external prefix cache hits / (prompt tokens - 1)
    wall_s: float = 0.0
    error: str = ""
    requests: dict[str, list[Any]] = field(default_factory=dict, repr=False)  # per request: ttft, latency, tokens

    @property
    def label(self) -> str:
        return "MC1" if self.max_concurrency == 1 else fmt(self.rate, 2)


# ----------------------------------------------------------------------------- the stacks
class ServeStacks(Stacks):
    """bench_e2e's stacks, with the colocated stack as a pair behind a round-robin proxy and the built-in stack behind
    proxy_server.py --protocol bootstrap: every stack is reached at ``proxy_url``."""

    def specs(self) -> list[tuple[str, int, dict[str, Any] | None, Path | None, dict[str, str]]]:
        others = [spec for spec in super().specs() if spec[0] != "colocated"]
        return [("colocated-0", 0, None, None, {}), ("colocated-1", 1, None, None, {}), *others]

    def start_front(self) -> None:
        if "colocated" in self.modes:
            upstreams = [arg for name in ("colocated-0", "colocated-1") for arg in ("--upstream", self.servers[name].url)]
            self.start_proxy([str(ROOT / "benchmarks" / "peers" / "round_robin_proxy.py"), *upstreams])
        elif "builtin" in self.modes:
            self.start_proxy([str(ROOT / "proxy_server.py"), "--prefill", self.servers["builtin-producer"].url,
                              "--decode", self.servers["builtin-consumer"].url, "--protocol", "bootstrap",
                              "--bootstrap", f"http://{HOST}:{self.bootstrap_port}", "--log-level", "WARNING",
                              "--skip-prefill-below", "0"])
        else:
            super().start_front()

    def consumer(self) -> VllmServer | None:
        return next((s for n, s in self.servers.items() if n.endswith("-consumer")), None)


# ----------------------------------------------------------------------------- one run of vllm bench serve
def run_point(stacks: ServeStacks, point: Point, model: Path, work: Path, slo: tuple[float, float] | None) -> None:
    """Run ``vllm bench serve`` for ``point`` against the stack's front and fill in its figures."""
    name = f"{point.stack}-{point.length}-{point.label}"
    dataset = ["--dataset-name", "random", "--random-input-len", str(point.length), "--random-output-len",
               str(OUTPUT_LEN), "--random-range-ratio", "0"]
    extra = ["--max-concurrency", str(point.max_concurrency)] if point.max_concurrency else []
    if slo is not None:
        extra += ["--goodput", f"ttft:{slo[0]:.3f}", f"tpot:{slo[1]:.3f}"]
    consumer = stacks.consumer()
    hits_before = consumer.metric("vllm:external_prefix_cache_hits_total") if consumer else 0.0
    began = time.monotonic()
    result = run_bench_serve(stacks.proxy_url, model, dataset, point.prompts, point.rate, point.seed,
                             work / f"{name}.json", extra)
    point.wall_s = time.monotonic() - began
    point.error = result.error
    if not result.data:
        return
    data = result.data
    point.completed, point.failed, point.duration = data["completed"], data["failed"], data["duration"]
    point.output_throughput, point.request_throughput = data["output_throughput"], data["request_throughput"]
    if point.completed:
        for attr, key in (("ttft", "ttft"), ("itl", "itl"), ("tpot", "tpot")):
            setattr(point, f"{attr}_p50", data.get(f"p50_{key}_ms"))
            setattr(point, f"{attr}_p99", data.get(f"p99_{key}_ms"))
    point.vllm_goodput = data.get("request_goodput")
    point.requests = result.requests
    if consumer is not None:
        hits = consumer.metric("vllm:external_prefix_cache_hits_total") - hits_before
        expected = sum(n - 1 for n, out in zip(data["input_lens"], data["output_lens"], strict=True) if out)
        point.kv_used = hits / expected if expected else None


def warm_up(stacks: ServeStacks, model: Path, lengths: list[int], vocab: int, seed: int) -> None:
    """Two untimed requests per prompt length (the first requests of a fresh instance are slower), one per instance of
    the colocated pair."""
    rng = random.Random(seed)
    for length in lengths:
        for _ in range(2):
            tokens = [rng.randrange(3, vocab) for _ in range(length)]
            stream(stacks.proxy_url, "/v1/completions", {"model": str(model), "prompt": tokens, "max_tokens": 16,
                                                          "temperature": 0.0, "ignore_eos": True})


# ----------------------------------------------------------------------------- the sweep
def plan(args: argparse.Namespace) -> list[Point]:
    """The runs of one stack, in order (the same for every stack, seeds included): the MC1 point, then each length's
    rates from low to high."""
    points, seed = [], args.seed * 1000
    if TARGET_LENGTH in args.rates and args.mc1_prompts:
        points.append(Point("", TARGET_LENGTH, None, 1, args.mc1_prompts, seed))
    for length in sorted(args.rates):
        for rate in sorted(args.rates[length]):
            seed += 1
            points.append(Point("", length, rate, None, max(args.prompts, round(rate * args.duration)), seed))
    return points


def slo_for(args: argparse.Namespace, points: list[Point], length: int) -> tuple[float, float] | None:
    """(TTFT ms, TPOT ms) for ``length``: given, or from the colocated pair's lowest-rate point."""
    if args.slo_ttft_ms and args.slo_tpot_ms:
        return args.slo_ttft_ms, args.slo_tpot_ms
    idle = swept(points, "colocated", length)
    if not idle or idle[0].ttft_p50 is None or idle[0].tpot_p50 is None:
        return None
    return (args.slo_ttft_ms or args.slo_ttft_x * idle[0].ttft_p50, args.slo_tpot_ms or args.slo_tpot_x * idle[0].tpot_p50)


def swept(points: list[Point], stack: str, length: int) -> list[Point]:
    """The rate sweep of ``stack`` at ``length``, lowest rate first, runs that failed left out."""
    return sorted((p for p in points if p.stack == stack and p.length == length and p.rate is not None
                   and p.completed and p.itl_p99 is not None), key=lambda p: p.rate or 0.0)


# ----------------------------------------------------------------------------- report
def markdown(points: list[Point], slos: dict[int, tuple[float, float] | None], rule: str) -> str:
    out = ["| stack | prompt tokens | rate req/s | n | failed | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
           "| TPOT p50 ms | out tok/s | req/s | goodput req/s | KV used |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        out.append(f"| {LABELS[p.stack]} | {p.length} | {p.label} | {p.completed} | {p.failed} | {fmt(p.ttft_p50)} "
                   f"| {fmt(p.ttft_p99)} | {fmt(p.itl_p50)} | {fmt(p.itl_p99)} | {fmt(p.tpot_p50)} "
                   f"| {fmt(p.output_throughput)} | {fmt(p.request_throughput, 2)} | {fmt(p.goodput, 2)} "
                   f"| {fmt(p.kv_used, 2)} |")
    out.append("")
    out += [f"{LABELS[p.stack]} {p.length} tokens @ {p.label}: {p.error}" for p in points if p.error]
    for length, slo in sorted(slos.items()):
        out.append(f"SLO at {length} tokens: " + (f"TTFT <= {slo[0]:.0f} ms and TPOT <= {slo[1]:.1f} ms ({rule})" if slo
                                                  else "none (no colocated point, no --slo-ttft-ms/--slo-tpot-ms)"))
    out += ["", "TTFT, ITL, TPOT, throughputs: as `vllm bench serve` measures them on the client (MC1: one request at a "
            "time); goodput: requests/s that met the SLO; KV used: the consumer's external prefix-cache hits over "
            "(prompt tokens - 1) per request."]
    return "\n".join(out)


def targets(points: list[Point], lengths: list[int]) -> list[dict[str, Any]]:
    """The three targets, each with its numbers and verdict (None: not evaluable, with the reason)."""
    checks: list[dict[str, Any]] = []
    for length in lengths:
        colo = swept(points, "colocated", length)
        if len(colo) < 2:
            checks.append({"target": f"ITL p99 at {length} tokens", "met": None,
                           "text": "needs a colocated sweep of 2 rates or more"})
        else:
            idle = colo[0].itl_p99 or 0.0
            doubled = next((p for p in colo[1:] if (p.itl_p99 or 0.0) >= ITL_DOUBLING * idle), None)
            for stack in ("ours", "push"):
                mine = {p.rate: p for p in swept(points, stack, length)}
                if doubled is None:
                    worst = max(p.itl_p99 or 0.0 for p in colo) / idle if idle else float("nan")
                    checks.append({"target": f"{LABELS[stack]} ITL p99 at {length} tokens", "met": None,
                                   "text": f"not evaluable: the colocated ITL p99 never doubled from its idle {idle:.1f} "
                                           f"ms (at most x{worst:.2f}, up to {fmt(colo[-1].rate, 2)} req/s)"})
                    continue
                at = mine.get(doubled.rate)
                if at is None:
                    checks.append({"target": f"{LABELS[stack]} ITL p99 at {length} tokens", "met": None,
                                   "text": f"no {LABELS[stack]} point at {fmt(doubled.rate, 2)} req/s"})
                    continue
                ratio = (at.itl_p99 or 0.0) / (doubled.itl_p99 or 1.0)
                checks.append({"target": f"{LABELS[stack]} ITL p99 <= {ITL_RATIO_TARGET}x colocated at {length} tokens",
                               "met": ratio <= ITL_RATIO_TARGET, "ratio": ratio, "rate": doubled.rate,
                               "text": f"at {fmt(doubled.rate, 2)} req/s (colocated ITL p99 {idle:.1f} -> "
                                       f"{doubled.itl_p99:.1f} ms): {LABELS[stack]} {at.itl_p99:.1f} ms = x{ratio:.2f}"})
        best_colo = max((p.goodput for p in colo if p.goodput is not None), default=None)
        for stack in ("ours", "push"):
            best = max((p.goodput for p in swept(points, stack, length) if p.goodput is not None), default=None)
            name = f"{LABELS[stack]} goodput >= {GOODPUT_RATIO_TARGET}x colocated at {length} tokens"
            if best is None or best_colo is None:
                checks.append({"target": name, "met": None, "text": "no goodput figures (SLO or points missing)"})
            elif best_colo == 0:
                checks.append({"target": name, "met": best > 0, "text": f"colocated 0 req/s met the SLO, "
                                                                        f"{LABELS[stack]} {best:.2f}"})
            else:
                ratio = best / best_colo
                checks.append({"target": name, "met": ratio >= GOODPUT_RATIO_TARGET, "ratio": ratio,
                               "text": f"best over the sweep: {LABELS[stack]} {best:.2f} req/s, colocated "
                                       f"{best_colo:.2f} req/s = x{ratio:.2f}"})
    mc1 = {p.stack: p for p in points if p.max_concurrency == 1 and p.length == TARGET_LENGTH and p.ttft_p50}
    name = f"push TTFT <= {PUSH_TTFT_RATIO_TARGET}x colocated at {TARGET_LENGTH} tokens, one request at a time"
    if "push" in mc1 and "colocated" in mc1:
        ratio = (mc1["push"].ttft_p50 or 0.0) / (mc1["colocated"].ttft_p50 or 1.0)
        others = ", ".join(f"{LABELS[s]} x{(mc1[s].ttft_p50 or 0.0) / (mc1['colocated'].ttft_p50 or 1.0):.2f}"
                           for s in ("ours", "builtin") if s in mc1)
        checks.append({"target": name, "met": ratio <= PUSH_TTFT_RATIO_TARGET, "ratio": ratio,
                       "text": f"TTFT p50 push {mc1['push'].ttft_p50:.1f} ms, colocated {mc1['colocated'].ttft_p50:.1f}"
                               f" ms = x{ratio:.2f}" + (f" (for information: {others})" if others else "")})
    else:
        checks.append({"target": name, "met": None, "text": "needs the MC1 points of push and colocated"})
    return checks


def summary(checks: list[dict[str, Any]]) -> str:
    verdict = {True: "met", False: "NOT met", None: "not evaluated"}
    return "\n".join(f"- {c['target']}: **{verdict[c['met']]}**: {c['text']}" for c in checks)


def plot(points: list[Point], lengths: list[int], path: Path, dtype: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(len(lengths), 2, figsize=(12, 4.2 * len(lengths)), squeeze=False)
    for row, length in zip(axes, lengths, strict=True):
        for ax, attr, title in ((row[0], "itl_p99", "ITL p99"), (row[1], "ttft_p99", "TTFT p99")):
            for stack in MODES:
                mine = swept(points, stack, length)
                if mine:
                    ax.plot([p.rate for p in mine], [getattr(p, attr) for p in mine], marker="o", label=LABELS[stack])
            ax.set_yscale("log")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("ms")
            ax.set_title(f"{title}, {length}-token prompts, {OUTPUT_LEN} output tokens")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
    fig.suptitle(f"bench_serve: kv32k ({dtype}), 2 cores: colocated pair vs 1P1D (vllm bench serve, random dataset)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_stack(stacks: ServeStacks, mode: str, args: argparse.Namespace, model: Path, work: Path, vocab: int,
              lengths: list[int], points: list[Point], slos: dict[int, tuple[float, float] | None]) -> None:
    """Every point of the plan against the started stack ``mode``; appends to ``points`` (and, for the colocated
    stack, fills ``slos`` from its lowest rate of each length)."""
    warm_up(stacks, model, lengths, vocab, args.seed + 7)
    for point in plan(args):
        point.stack = mode
        explicit = (args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms and args.slo_tpot_ms else None
        run_point(stacks, point, model, work, slos.get(point.length, explicit))
        points.append(point)
        if mode == "colocated" and point.length not in slos and point.rate is not None and point.completed:
            slos[point.length] = slo_for(args, points, point.length)  # its lowest rate: the first one run
        print(f"  {LABELS[mode]} {point.length} tokens @ {point.label}: {point.completed}/{point.prompts} done, "
              f"TTFT p50/p99 {fmt(point.ttft_p50)}/{fmt(point.ttft_p99)} ms, ITL p50/p99 {fmt(point.itl_p50)}/"
              f"{fmt(point.itl_p99)} ms, {fmt(point.output_throughput)} tok/s, {fmt(point.request_throughput, 2)}"
              f" req/s" + (f", KV used {point.kv_used:.2f}" if point.kv_used is not None else "")
              + f" ({point.wall_s:.0f} s)" + (f" [{point.error}]" if point.error else ""), flush=True)


# ----------------------------------------------------------------------------- main
def parse_rates(values: list[str]) -> dict[int, list[float]]:
    """``LEN=R1,R2,...`` entries."""
    rates: dict[int, list[float]] = {}
    for value in values:
        length, _, listed = value.partition("=")
        try:
            rates[int(length)] = [float(r) for r in listed.split(",") if r]
        except ValueError:
            raise argparse.ArgumentTypeError(f"--rates {value!r}: expected LEN=RATE[,RATE...]") from None
        if not rates[int(length)] or min(rates[int(length)]) <= 0:
            raise argparse.ArgumentTypeError(f"--rates {value!r}: expected positive rates")
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="the full sweep (default: the reduced one)")
    parser.add_argument("--rates", nargs="+", metavar="LEN=R1,R2", help="prompt length and its request rates (req/s); "
                        f"default {REDUCED['rates']} (--full: {FULL['rates']})")
    parser.add_argument("--prompts", type=int, help="at least this many prompts per rate (default 8, --full 16)")
    parser.add_argument("--duration", type=float, help="and at least rate x this many seconds of arrivals "
                        "(default 8, --full 40)")
    parser.add_argument("--mc1-prompts", type=int, help="prompts of the one-at-a-time point at 1024 tokens "
                        "(default 5, --full 16; 0: none)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="stacks to run, in this order (default all; colocated first gives the SLO)")
    parser.add_argument("--dtype", default=None, help="vLLM dtype (default: the CPU's native one, "
                        "bfloat16 with AVX-512 BF16 or AMX, else float32)")
    parser.add_argument("--slo-ttft-x", type=float, default=4.0, help="SLO: TTFT <= this x colocated idle TTFT p50")
    parser.add_argument("--slo-tpot-x", type=float, default=2.0, help="SLO: TPOT <= this x colocated idle TPOT p50")
    parser.add_argument("--slo-ttft-ms", type=float, help="SLO: TTFT in ms (all lengths), instead of --slo-ttft-x")
    parser.add_argument("--slo-tpot-ms", type=float, help="SLO: TPOT in ms (all lengths), instead of --slo-tpot-x")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "models" / "kv32k",
                        help="the model directory (default .cache/models/kv32k, built by scripts/setup.sh)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--keep-logs", action="store_true", help="print the log directory and keep it")
    args = parser.parse_args()

    preset = FULL if args.full else REDUCED
    try:
        args.rates = parse_rates(args.rates) if args.rates else dict(preset["rates"])
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))
    args.prompts = args.prompts or preset["prompts"]
    args.duration = args.duration if args.duration is not None else preset["duration"]
    args.mc1_prompts = args.mc1_prompts if args.mc1_prompts is not None else preset["mc1_prompts"]
    too_long = [n for n in args.rates if n + OUTPUT_LEN > MAX_MODEL_LEN]
    if too_long:
        parser.error(f"--rates lengths {too_long}: prompt + {OUTPUT_LEN} must fit the {MAX_MODEL_LEN}-token model length")
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        parser.error(f"{args.model}: no model there; run scripts/setup.sh (it builds .cache/models/kv32k)")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    info = cpu()
    dtype = args.dtype or native_dtype(info)
    lengths = sorted(args.rates)
    modes = list(args.modes)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    print(f"dtype {dtype}; logs in {work}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop every process

    points: list[Point] = []
    slos: dict[int, tuple[float, float] | None] = {}
    began = time.monotonic()
    failures: dict[str, str] = {}
    for mode in modes:
        stacks = ServeStacks(model, work, (mode,), serve_args_for(dtype))
        print(f"{mode}: starting 2 vLLM instances and the proxy ... ({time.monotonic() - began:.0f} s in)", flush=True)
        try:
            stacks.start()
            try:
                run_stack(stacks, mode, args, model, work, vocab, lengths, points, slos)
            finally:
                stacks.stop()
        except Exception as e:  # a stack that fails is reported; the other stacks still run
            failures[mode] = f"{type(e).__name__}: {e}"[:2000]
            print(f"{mode} FAILED: {failures[mode]}", file=sys.stderr, flush=True)

    for length in lengths:
        if length not in slos:
            slos[length] = slo_for(args, points, length)
    for p in points:
        slo = slos.get(p.length)
        p.goodput = goodput(p.requests, p.duration, *slo) if slo else None
    checks = targets(points, lengths)
    rule = ", ".join([f"TTFT {args.slo_ttft_ms} ms" if args.slo_ttft_ms else
                      f"TTFT {args.slo_ttft_x:g}x the colocated pair's TTFT p50 at its lowest rate",
                      f"TPOT {args.slo_tpot_ms} ms" if args.slo_tpot_ms else
                      f"TPOT {args.slo_tpot_x:g}x its TPOT p50 there"])
    table = markdown(points, slos, rule)
    text = summary(checks) + "".join(f"\n- stack {m} FAILED: {f}" for m, f in failures.items())
    elapsed = time.monotonic() - began
    print()
    print(table)
    print()
    print(text)
    print(f"\n{elapsed / 60:.1f} minutes")
    md = (header("bench_serve: vllm bench serve, colocated pair vs 1P1D", dtype) + "\n"
          f"kv32k model, {OUTPUT_LEN} output tokens (ignore_eos), random dataset, Poisson arrivals; "
          f"`vllm serve` arguments {' '.join(serve_args_for(dtype))}; {'full' if args.full else 'reduced'} sweep, "
          f"{elapsed / 60:.0f} minutes.\n\n{table}\n\n## Targets\n\n{text}\n")
    data = {"dtype": dtype, "vllm": vllm_version(),
            "serve_args": serve_args_for(dtype), "output_len": OUTPUT_LEN,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "model"},
            "slo_ms": {str(n): ({"ttft": s[0], "tpot": s[1]} if s else None) for n, s in slos.items()},
            "targets": checks, "failed_stacks": failures, "elapsed_s": elapsed,
            "points": [{k: v for k, v in asdict(p).items() if k != "requests"} for p in points]}
    write("bench_serve", data, md, args.out_dir)
    plot(points, lengths, args.out_dir / "bench_serve.png", dtype)
    print(f"wrote {args.out_dir / 'bench_serve.json'}, bench_serve.md, bench_serve.png")
    if args.keep_logs or failures:
        print(f"logs kept in {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
