"""KV-aware routing and conditional disaggregation under load: ``vllm bench serve`` on a shared-prefix workload and on
the random dataset, against every front of the same two cores.

The fleets, one after the other, each alone on the machine. Every instance serves the kv32k model (32 KiB of KV per
token in bfloat16, 64 KiB in float32; ``--dtype``, by default the CPU's native one, benchmarks/support/common.py) with the
``vllm serve`` settings of benchmarks/support/stacks.py, prefix caching on, and ``VLLM_SERVER_DEV_MODE=1`` (for its
``/reset_prefix_cache``):

- **colocated**: two plain vLLM instances, core 0 and core 1. Fronts:
  ``colocated rr`` (benchmarks/peers/round_robin_proxy.py: each request, whole, to the next instance) and
  ``colocated ca`` (vllm-router ``--policy cache_aware``, its regular mode).
- **colocated4**: four plain vLLM instances, two per core (as many instances as the 2P2D fleet: what running four
  vLLM instances on two cores costs by itself, without any connector). Front ``colocated4 rr`` (the round robin).
- **2P2D**: two producers (core 0) and two consumers (core 1) of our connector, pull mode, P2PHANDSHAKE, each with its
  own mooncake.json, as tests/kv_connector/test_xpyd.py. Fronts:
  ``ours balance`` (proxy_server.py ``--prefix-index-entries 0``: fewest outstanding requests, no prefix index),
  ``ours prefix`` (``--routing prefix``, prefix-aware routing, no prefill skipped: the proxy's defaults),
  ``ours skip<N>`` (``--routing prefix --skip-prefill-below N``, one front per N of ``--thresholds``),
  ``ours estimate`` (``--routing estimate``: instances and skips chosen by the estimated time to the first token,
  prefix index on, ``--skip-prefill-below`` at its default 0, which there means no bound),
  ``ours estimate on-prefill`` (the same with ``--decode-on-prefill``: a request may also be served whole on a
  prefill instance) and
  ``router ca`` (vllm-router ``--vllm-pd-disaggregation`` with ``cache_aware`` prefill and decode policies).
- **1P1D**: one producer (core 0) and one consumer (core 1): as many instances on the same cores as the colocated
  pair. The 2P2D fleet's fronts, named ``1p1d <front>``; with one instance per role there is nothing to choose, so
  ``1p1d ours prefix`` differs from ``1p1d ours balance`` only by its prefix index: it is the no-skipping baseline.

Before each run every instance's prefix cache is emptied (``POST /reset_prefix_cache``, retried while requests hold
blocks) and a new front is started, so every run begins equally cold. ``vllm bench serve`` runs without its initial
test request (``--ready-check-timeout-sec 0``: that request would warm one prefix before the timed run).

Workloads, one run per front and rate each, Poisson arrivals at each of ``--rates`` req/s (every front and workload
at every rate, round after round with ``--repeat``), ``--output-len`` tokens (``--ignore-eos``):

- ``shared``: vLLM's ``prefix_repetition`` dataset, ``--prefixes`` shared histories of ``--prefix-len`` tokens
  (conversations, system prompts), each followed by ``--per-prefix`` different new parts of ``--suffix-len`` tokens,
  shuffled. A *follow-up* is a request whose history an earlier request of the run already sent.
- ``random``: vLLM's ``random`` dataset, prompts of exactly ``--random-len`` tokens, nothing shared.

Columns:

- TTFT p50/p99, ITL p99: as ``vllm bench serve`` measures them on the client; follow-up TTFT p50: over follow-ups
  (the dataset is rebuilt here with vLLM's own class, tokenizer and seed to know which requests they are);
- goodput: requests per second that met TTFT <= SLO and TPOT <= SLO (vLLM's definition); the SLO of each workload is
  ``--slo-x`` times ``colocated rr``'s TTFT p50 and TPOT p50 on it at the lowest rate swept (medians over the rounds;
  that front runs first), one SLO for every rate so that goodput shows what the load costs; it is printed
  (``--slo-from``: an earlier results file's SLOs instead);
- KV moved/req: growth of the consumers' ``vllm:mooncake_kv_loaded_bytes_total`` (bytes written into their KV caches by
  loads) per completed request;
- uncached KV/req: the KV of the prompt tokens the decode instance did not hold itself: growth of its
  ``vllm:prefix_cache_queries`` minus ``vllm:prefix_cache_hits``, times the model's KV bytes per token, per request;
  moved/uncached is their ratio (1.0: only what was missing moved; below 1: some was computed on the decode
  instance, for example a prefill the proxy skipped);
- skipped: prefills the proxy skipped (its ``mooncake_proxy_prefill_skipped_total``); below the table, per run of our
  proxy, its ``mooncake_proxy_route_decisions_total`` by ``choice/reason`` (why each request was prefilled remotely or
  computed whole on its decode instance);
- CPU busy: each instance's CPU time during the run (its API server and engine core processes, user + system) per
  second of the run, in cores: which instance's core saturates at a rate (each instance is pinned to one core).

Targets, per rate, on the shared workload, for the chosen front of either disaggregated fleet: the best of the
``ours skip<N>`` and ``ours estimate`` fronts (the best goodput, then the lowest follow-up TTFT): moved/uncached <= 1.1;
follow-up TTFT p50 <= 1.05x colocated; goodput >= colocated and >= router ca of the same fleet. On the random workload:
no regression against ``ours balance`` of the same fleet (goodput not lower; TTFT p50 within 10%), and goodput not
lower than ``ours prefix`` of the same fleet (no skipping).

Run (from the repository root)::

    .venv/bin/python benchmarks/bench_routing.py                # ~40 minutes
    # the colocated pair against the 1P1D fleet (as many instances on the same cores), three rounds
    .venv/bin/python benchmarks/bench_routing.py --fleets colocated 1p1d --repeat 3 --thresholds 256 \
        --fronts "colocated rr" "colocated ca" "1p1d ours balance" "1p1d ours skip256" "1p1d router ca" \
        --name bench_routing_1p1d
    .venv/bin/python benchmarks/bench_routing.py --prompts 16 --thresholds 512 --workloads shared   # shorter
    # the 2P2D fleet's run-to-run spread: fronts in rounds, the SLOs of the full run
    .venv/bin/python benchmarks/bench_routing.py --fleets 2p2d --workloads random --repeat 3 \
        --fronts "ours balance" "ours prefix" "ours skip256" --slo-from benchmarks/results/bench_routing.json \
        --name bench_routing_repeats
    # the load sweep: the colocated pair against the 1P1D fleet's fixed threshold and estimate, three rounds
    .venv/bin/python benchmarks/bench_routing.py --fleets colocated 1p1d --workloads shared random \
        --rates 0.5 1 2 --repeat 3 --thresholds 256 \
        --fronts "colocated rr" "colocated ca" "1p1d ours prefix" "1p1d ours skip256" "1p1d ours estimate" \
        "1p1d router ca" --name bench_routing_sweep_avx512
    # the medians of rounds run separately (e.g. one round per session, the later ones with --slo-from the first):
    # the table of --repeat N, read back from their results files, which must share their SLOs and CPU
    .venv/bin/python benchmarks/bench_routing.py --medians-of round1.json round2.json round3.json --name bench_routing

Writes ``--name``.json and ``--name``.md (default bench_routing; with ``--medians-of`` only if ``--name`` is given)
to ``--out-dir`` (default benchmarks/results). The figures depend on the machine (a fixed threshold chosen on one box
lost on a slower one): the results header names the CPU, its flags and the dtype; compare runs of one machine kind
(``--name bench_routing_sweep_<machine>``, e.g. ``avx512``, ``amx``, ``avx2``). Each run's ``vllm bench serve``
output and JSON and every server's log stay in a temporary directory with ``--keep-logs``.

Caveats: the client, the fronts and the vLLM API servers are not pinned and share the two cores with the engines, in
every stack alike; the prefix index of our proxy and vllm-router's radix tree see text, the instances tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support.common import fmt, header, native_dtype, percentile, vllm_version, write  # noqa: E402
from benchmarks.support.metrics import scrape, scrape_labeled  # noqa: E402
from benchmarks.support.routing_fleet import (  # noqa: E402
    Fleet,
    cpu_seconds,
    fronts_of,
    kv_bytes_per_token,
    reset_prefix_cache,
)
from benchmarks.support.routing_report import (  # noqa: E402
    DECISIONS,
    Run,
    base_front,
    medians_of,
    run_name,
    slos_of,
    table,
    targets,
)
from benchmarks.support.serve_client import goodput, run_bench_serve  # noqa: E402
from benchmarks.support.stacks import serve_args_for  # noqa: E402
from harness.vllm import build_model  # noqa: E402

LOADED_BYTES = "vllm:mooncake_kv_loaded_bytes_total"


# ----------------------------------------------------------------------------- one run
def dataset_args(workload: str, args: argparse.Namespace) -> list[str]:
    if workload == "shared":
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.prefixes),
                "--prefix-repetition-output-len", str(args.output_len)]
    return ["--dataset-name", "random", "--random-input-len", str(args.random_len), "--random-output-len",
            str(args.output_len), "--random-range-ratio", "0"]


def followups(model: Path, args: argparse.Namespace) -> list[bool]:
    """For each request of the shared workload, in the order ``vllm bench serve`` sends it: whether an earlier
    request had the same history (the dataset rebuilt with vLLM's class, the model's tokenizer and the run's seed)."""
    from vllm.benchmarks.datasets.datasets import PrefixRepetitionRandomDataset
    from vllm.tokenizers import get_tokenizer

    samples = PrefixRepetitionRandomDataset(random_seed=args.seed, dataset_path=None).sample(
        tokenizer=get_tokenizer(str(model)), num_requests=args.prompts, prefix_len=args.prefix_len,
        suffix_len=args.suffix_len, num_prefixes=args.prefixes, output_len=args.output_len)
    # the histories are random tokens: their first characters tell them apart
    key_chars = max(16, len(samples[0].prompt) * args.prefix_len // (2 * (args.prefix_len + args.suffix_len)))
    seen: set[str] = set()
    out = []
    for sample in samples:
        key = sample.prompt[:key_chars]
        out.append(key in seen)
        seen.add(key)
    return out


def run_one(fleet: Fleet, front: str, workload: str, rate: float, round_: int, args: argparse.Namespace, model: Path,
            work: Path, per_token: int, follow: list[bool]) -> Run:
    run = Run(front, workload, rate, round_)
    for server in fleet.servers:
        reset_prefix_cache(server)
    fleet.start_front(front)
    name = f"{front.replace(' ', '_')}-{workload}-{rate:g}rps-round{round_}"  # every run's output kept apart
    before = [scrape(s.url) for s in fleet.consumers]
    cpu_before, began = [cpu_seconds(s.proc.pid) for s in fleet.servers], time.monotonic()
    # without vllm bench serve's initial test request, which would warm one history before the timed run
    result = run_bench_serve(fleet.front_url, model, dataset_args(workload, args), args.prompts, rate, args.seed,
                             work / f"{name}.json", ["--ready-check-timeout-sec", "0"])
    wall = time.monotonic() - began
    run.busy = {s.name: (cpu_seconds(s.proc.pid) - b) / wall for s, b in zip(fleet.servers, cpu_before, strict=True)}
    run.error = result.error
    if not result.data:
        return run
    time.sleep(1.0)  # the last loads' stats reach /metrics with a later engine step
    after = [scrape(s.url) for s in fleet.consumers]
    data = result.data
    run.completed, run.failed, run.duration = data["completed"], data["failed"], data["duration"]
    if run.completed:
        run.ttft_p50, run.ttft_p99 = data.get("p50_ttft_ms"), data.get("p99_ttft_ms")
        run.itl_p99, run.tpot_p50 = data.get("p99_itl_ms"), data.get("p50_tpot_ms")
    run.requests = result.requests
    ok = [out > 0 for out in data["output_lens"]]
    if workload == "shared" and len(follow) == len(ok):
        later = [t * 1e3 for t, f, good in zip(data["ttfts"], follow, ok, strict=True) if f and good]
        first = [t * 1e3 for t, f, good in zip(data["ttfts"], follow, ok, strict=True) if not f and good]
        run.followup_ttft_p50 = percentile(later, 50) if later else None
        run.first_ttft_p50 = percentile(first, 50) if first else None

    def grew(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

    if run.completed:
        uncached = grew("vllm:prefix_cache_queries_total") - grew("vllm:prefix_cache_hits_total")
        run.uncached_per_req = uncached * per_token / run.completed
        run.moved_per_req = grew(LOADED_BYTES) / run.completed
    if base_front(front).startswith("ours"):
        proxy = scrape(fleet.front_url)
        run.skipped = proxy.get("mooncake_proxy_prefill_skipped_total", 0.0)
        run.decisions = scrape_labeled(fleet.front_url, DECISIONS, ("choice", "reason"))
        run.routed = {k: v for k, v in proxy.items() if k.startswith("mooncake_proxy_routed")}
    fleet.stop_front()
    return run


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleets", nargs="+", default=["colocated", "colocated4", "2p2d", "1p1d"],
                        choices=["colocated", "colocated4", "2p2d", "1p1d"])
    parser.add_argument("--workloads", nargs="+", default=["shared", "random"], choices=["shared", "random"])
    parser.add_argument("--thresholds", type=int, nargs="+", default=[256, 1024],
                        help="--skip-prefill-below values, one front each (default 256 1024)")
    parser.add_argument("--unpinned", action="store_true",
                        help="no instance pinned to a core: one compute thread each, placed by the OS "
                             "(VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=1)")
    parser.add_argument("--fronts", nargs="+", help="only these fronts, in this order in each round (default all)")
    parser.add_argument("--one-process-engine", action="store_true",
                        help="every instance runs its model worker inside its engine process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=0; vllm-cpu's default is a worker process of its own)")
    parser.add_argument("--rates", "--rate", dest="rates", type=float, nargs="+", default=[1.0], metavar="R",
                        help="requests per second, every front and workload at each, in this order in each round; "
                             "the SLOs come from the lowest (default 1.0; --rate is the same option)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=native_dtype(),
                        help="what every instance computes in (default here: %(default)s, the CPU's native dtype: "
                             "bfloat16 with AVX-512 BF16 or AMX, else float32)")
    parser.add_argument("--prompts", type=int, default=48, help="requests per run (default 48)")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=192)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--random-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--slo-x", type=float, default=2.0,
                        help="SLO: this times colocated rr's TTFT p50 and TPOT p50 at the lowest rate (default 2)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default=None,
                        help="results file name (default bench_routing; with --medians-of: written only if given; the "
                             "figures depend on the machine, e.g. bench_routing_sweep_<machine>)")
    parser.add_argument("--medians-of", nargs="+", type=Path, metavar="JSON",
                        help="run nothing: the medians over rounds run separately, from their results files (one per "
                             "round, sharing their SLOs: --slo-from the first), as --repeat N reports them")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds: every front and workload at every rate this many times, round after round (the "
                             "checks use each front's median per rate; default 1)")
    parser.add_argument("--slo-from", type=Path, help="take the SLOs from an earlier results JSON (e.g. a run "
                        "without the colocated fleet)")
    args = parser.parse_args()
    if args.medians_of:
        md, data = medians_of(args.medians_of)
        print(md)
        if args.name:
            write(args.name, data, md, args.out_dir)
        return
    args.name = args.name or "bench_routing"
    if min(args.rates) <= 0:
        parser.error("--rates: every rate must be above 0 requests per second")

    model = build_model("kv32k", quiet=True)
    dtype = args.dtype
    serve_args = serve_args_for(dtype)
    per_token = kv_bytes_per_token(model, dtype)
    follow = followups(model, args) if "shared" in args.workloads else []
    print(f"kv32k in {dtype}: {per_token} KV bytes per token; shared workload: {sum(follow)} follow-ups of "
          f"{len(follow)} requests", flush=True)
    work = Path(tempfile.mkdtemp(prefix="bench_routing-"))
    began = time.monotonic()
    runs: list[Run] = []
    failed = False
    try:
        for kind in args.fleets:
            print(f"fleet {kind}: starting", flush=True)
            fleet = Fleet(kind, model, work, serve_args, args.one_process_engine, args.unpinned)
            fleet.proxy_log_level = "INFO" if args.keep_logs else "WARNING"
            try:
                for server in fleet.servers:  # the first requests of a fresh instance are slower
                    server.complete([5 + server.port % 7] * 64, 4)
                available = fronts_of(kind, args.thresholds)
                fronts = [f for f in args.fronts or available if f in available]
                for round_, rate, front, workload in itertools.product(range(args.repeat), args.rates, fronts,
                                                                       args.workloads):
                    run = run_one(fleet, front, workload, rate, round_, args, model, work, per_token, follow)
                    runs.append(run)
                    print(f"  {run_name(run)}: TTFT p50 {fmt(run.ttft_p50)} ms, follow-up "
                          f"{fmt(run.followup_ttft_p50)} ms, ITL p99 {fmt(run.itl_p99)} ms, moved/uncached "
                          f"{fmt(run.moved_ratio, 2)}, skipped {fmt(run.skipped, 0)} {run.error}", flush=True)
            finally:
                fleet.stop()
    except BaseException:
        failed = True
        raise
    finally:
        if args.keep_logs or failed:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    slos: dict[str, tuple[float, float]] = {}
    if args.slo_from:
        slos = {w: (float(t), float(p)) for w, (t, p) in json.loads(args.slo_from.read_text())["slos"].items()}
    slo_notes = {w: f"from {args.slo_from}" for w in slos}
    lowest = min(args.rates)
    for workload, slo in slos_of(runs, args.workloads, lowest, args.slo_x).items():
        if workload not in slos:
            slos[workload] = slo
            slo_notes[workload] = (f"{args.slo_x:g}x colocated rr's TTFT p50 and TPOT p50 at {lowest:g} req/s, the "
                                   "lowest rate swept; the same SLO at every rate")
    for run in runs:
        if run.workload in slos:
            run.goodput = goodput(run.requests, run.duration, *slos[run.workload])
    checks, chosen = targets(runs, args.thresholds)
    if args.repeat > 1:
        checks.insert(0, f"(each front's median over {args.repeat} rounds)")
    minutes = (time.monotonic() - began) / 60
    rates = " / ".join(f"{rate:g}" for rate in args.rates)
    settings = (f"kv32k ({dtype}, {per_token >> 10} KiB of KV per token), vLLM {vllm_version()}; `vllm serve` "
                f"{' '.join(serve_args)}; {args.prompts} requests per run at {rates} req/s (Poisson), "
                f"{args.output_len} output tokens; shared: {args.prefixes} histories of {args.prefix_len} tokens + "
                f"{args.suffix_len} new tokens ({sum(follow)} follow-ups); random: {args.random_len} tokens; "
                f"{minutes:.0f} minutes.")
    md = (header("bench_routing: KV-aware routing and conditional disaggregation", dtype) + "\n" + settings + "\n\n"
          + table(runs, slos, slo_notes) + "\n" + "\n".join(checks) + "\n")
    print(md)
    write(args.name, {"settings": settings, "rates": args.rates, "slos": slos, "slo_notes": slo_notes,
                      "chosen": {f"{rate:g}": front for rate, front in chosen.items()}, "checks": checks,
                      "runs": [{**asdict(r), "moved_ratio": r.moved_ratio} for r in runs]}, md, args.out_dir)


if __name__ == "__main__":
    main()
