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

Writes ``--name``.json and ``--name``.md (default bench_routing) to ``--out-dir`` (default benchmarks/results). The
figures depend on the machine (a fixed threshold chosen on one box lost on a slower one): write one results file per
machine kind, ``--name bench_routing_sweep_<machine>`` (e.g. ``avx512``, ``amx``, ``avx2``); the results header names
the CPU, its flags and the dtype. Each run's ``vllm bench serve`` output and JSON and every server's log stay in a
temporary directory with ``--keep-logs``.

Caveats: the client, the fronts and the vLLM API servers are not pinned and share the two cores with the engines, in
every stack alike; the prefix index of our proxy and vllm-router's radix tree see text, the instances tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.support.common import fmt, header, native_dtype, percentile, vllm_version, write  # noqa: E402
from benchmarks.support.serve_client import goodput, run_bench_serve  # noqa: E402
from benchmarks.support.stacks import serve_args_for  # noqa: E402
from harness.ports import HOST, free_port  # noqa: E402
from harness.processes import http_ok, spawn, stop, wait_ready  # noqa: E402
from harness.vllm import VllmServer, build_model, connector_config, mooncake_json, start_vllm  # noqa: E402

DEV_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
TTFT_TARGET, MOVED_TARGET = 1.05, 1.1
LOADED_BYTES = "vllm:mooncake_kv_loaded_bytes_total"
DECISIONS = "mooncake_proxy_route_decisions_total"
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class Run:
    """One ``vllm bench serve`` run of one workload against one front at one rate."""

    front: str
    workload: str
    rate: float = 0.0  # requests per second
    round: int = 0
    completed: int = 0
    failed: int = 0
    duration: float = 0.0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    followup_ttft_p50: float | None = None
    first_ttft_p50: float | None = None
    itl_p99: float | None = None
    tpot_p50: float | None = None
    goodput: float | None = None
    moved_per_req: float | None = None     # bytes
    uncached_per_req: float | None = None  # bytes
    skipped: float | None = None
    decisions: dict[str, float] = field(default_factory=dict)  # our proxy's route decisions, "choice/reason" -> count
    routed: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)  # instance -> CPU seconds its processes used per second
    error: str = ""
    requests: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    @property
    def moved_ratio(self) -> float | None:
        if self.moved_per_req is None or not self.uncached_per_req:
            return None
        return self.moved_per_req / self.uncached_per_req


# ----------------------------------------------------------------------------- instance metrics
def samples(url: str) -> list[str]:
    """The sample lines of ``url``/metrics (Prometheus text format, comments left out)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def scrape(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics summed over labels (``name`` -> value)."""
    out: dict[str, float] = {}
    for line in samples(url):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def scrape_labeled(url: str, metric: str, labels: tuple[str, ...]) -> dict[str, float]:
    """The samples of one ``metric`` of ``url``/metrics, kept apart by ``labels``: their values joined by "/" ->
    value (the route decisions' reasons are what tells a skip rule's choices apart, which ``scrape`` sums away)."""
    out: dict[str, float] = {}
    for line in samples(url):
        if line.split("{", 1)[0].split(" ", 1)[0] != metric:
            continue
        found = dict(LABEL.findall(line.rsplit(" ", 1)[0]))
        key = "/".join(found.get(label, "") for label in labels)
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of the process ``pid`` and its live descendants (a vLLM instance's API server and
    engine core), in seconds."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def reset_prefix_cache(server: VllmServer, timeout: float = 60.0) -> None:
    """Empty the instance's prefix cache; retried while running requests still hold blocks."""
    deadline = time.monotonic() + timeout
    while True:
        req = urllib.request.Request(f"{server.url}/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            if json.loads(resp.read() or b"{}").get("success", True):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: /reset_prefix_cache kept failing for {timeout:g} s")
        time.sleep(0.5)


def kv_bytes_per_token(model: Path, dtype: str) -> int:
    config = json.loads((model / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    size = 4 if dtype == "float32" else 2
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * size


# ----------------------------------------------------------------------------- fleets and fronts
class Fleet:
    """The vLLM instances of one fleet, and the front currently in front of them."""

    def __init__(self, kind: str, model: Path, work: Path, serve_args: list[str], one_process: bool = False,
                 unpinned: bool = False) -> None:
        self.kind, self.model, self.work = kind, model, work
        env = {**DEV_ENV, **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if one_process else {}),
               **({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"} if unpinned else {})}
        self.servers: list[VllmServer] = []
        self.front: subprocess.Popen | None = None
        self.front_url = ""
        self.proxy_log_level = "WARNING"
        if kind in ("colocated", "colocated4"):
            for i in range(4 if kind == "colocated4" else 2):
                self.servers.append(VllmServer(f"colocated-{i}", model, free_port(), i % 2, work, None, None,
                                               serve_args, env))
        else:
            count = 1 if kind == "1p1d" else 2
            for i in range(count):
                config = mooncake_json(work / f"producer{i}.json")
                self.servers.append(VllmServer(f"producer{i}", model, free_port(), 0, work,
                                               connector_config("kv_producer"), config, serve_args, env))
            first = json.loads((work / "producer0.json").read_text())["prefill_url"]
            for i in range(count):
                config = mooncake_json(work / f"consumer{i}.json", **({"prefill_url": first} if i == 0 else {}))
                self.servers.append(VllmServer(f"consumer{i}", model, free_port(), 1, work,
                                               connector_config("kv_consumer"), config, serve_args, env))
        start_vllm(*self.servers)

    @property
    def producers(self) -> list[VllmServer]:
        return [s for s in self.servers if s.name.startswith("producer")]

    @property
    def consumers(self) -> list[VllmServer]:
        """Where requests are decoded (every instance of a colocated fleet)."""
        return [s for s in self.servers if not s.name.startswith("producer")]

    def start_front(self, front: str) -> None:
        self.stop_front()
        front = base_front(front)
        port = free_port()
        urls = [s.url for s in self.servers]
        router = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        if front.startswith("router") or front == "colocated ca":
            if router is None:
                raise RuntimeError("vllm-router is not installed: scripts/setup.sh installs it with the test extras")
        if front in ("colocated rr", "colocated4 rr"):
            cmd = [sys.executable, str(ROOT / "benchmarks" / "peers" / "round_robin_proxy.py"),
                   *[a for u in urls for a in ("--upstream", u)]]
        elif front == "colocated ca":
            cmd = [router, "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warning"]
        elif front == "router ca":
            cmd = [router, "--vllm-pd-disaggregation", *[a for s in self.producers for a in ("--prefill", s.url)],
                   *[a for s in self.consumers for a in ("--decode", s.url)], "--prefill-policy", "cache_aware",
                   "--decode-policy", "cache_aware", "--log-level", "warning"]
        else:
            # with --keep-logs our proxy says why it routed each request where (INFO), else only what went wrong
            cmd = [sys.executable, str(ROOT / "proxy_server.py"), "--log-level", self.proxy_log_level,
                   *[a for s in self.producers for a in ("--prefill", s.url)],
                   *[a for s in self.consumers for a in ("--decode", s.url)]]
            # every rule and threshold named, so that a change of the proxy's defaults changes no front
            if front == "ours balance":
                cmd += ["--routing", "prefix", "--prefix-index-entries", "0", "--skip-prefill-below", "0"]
            elif front == "ours prefix":
                cmd += ["--routing", "prefix", "--skip-prefill-below", "0"]
            elif front.startswith("ours skip"):
                cmd += ["--routing", "prefix", "--skip-prefill-below", front.removeprefix("ours skip")]
            elif front == "ours estimate":  # --skip-prefill-below 0: no bound on what it may skip
                cmd += ["--routing", "estimate", "--skip-prefill-below", "0"]
            elif front == "ours estimate on-prefill":
                cmd += ["--routing", "estimate", "--skip-prefill-below", "0", "--decode-on-prefill"]
        if front.startswith("router") or front == "colocated ca":
            cmd += ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]
        cmd += ["--host", HOST, "--port", str(port)]
        log = self.work / f"front-{front.replace(' ', '_')}.log"
        self.front = spawn(cmd, log)
        self.front_url = f"http://{HOST}:{port}"
        wait_ready(self.front, cmd, log, http_ok(f"{self.front_url}/health"), front, 120.0)

    def stop_front(self) -> None:
        if self.front is not None:
            stop(self.front)
            self.front = None

    def stop(self) -> None:
        self.stop_front()
        for server in self.servers:
            server.stop()


def fronts_of(kind: str, thresholds: list[int]) -> list[str]:
    if kind == "colocated":
        return ["colocated rr", "colocated ca"]
    if kind == "colocated4":
        return ["colocated4 rr"]
    fronts = ["ours balance", "ours prefix", *[f"ours skip{n}" for n in thresholds], "ours estimate",
              "ours estimate on-prefill", "router ca"]
    if kind == "1p1d":  # ours prefix too: with one instance per role, the no-skipping baseline
        return [f"1p1d {f}" for f in fronts]
    return fronts


def base_front(front: str) -> str:
    """The front without its fleet's name (``1p1d ours balance`` -> ``ours balance``)."""
    return front.removeprefix("1p1d ")


def fleet_prefix(front: str) -> str:
    return front[:len(front) - len(base_front(front))]


def skips_prefills(front: str) -> bool:
    """Whether the front is one of our proxy's skip rules (the fronts a target check chooses among)."""
    return base_front(front).startswith(("ours skip", "ours estimate"))


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


# ----------------------------------------------------------------------------- report
def table(runs: list[Run], slos: dict[str, tuple[float, float]], slo_notes: dict[str, str] | None = None) -> str:
    out = ["| workload | front | rate req/s | round | n | failed | TTFT p50 ms | TTFT p99 ms | follow-up TTFT p50 ms "
           "| ITL p99 ms | TPOT p50 ms | goodput req/s | KV moved/req MiB | uncached KV/req MiB | moved/uncached "
           "| skipped | CPU busy |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        mib = 1 << 20
        out.append(f"| {r.workload} | {r.front} | {r.rate:g} | {r.round} | {r.completed} | {r.failed} "
                   f"| {fmt(r.ttft_p50)} | {fmt(r.ttft_p99)} | {fmt(r.followup_ttft_p50)} | {fmt(r.itl_p99)} "
                   f"| {fmt(r.tpot_p50)} | {fmt(r.goodput, 3)} "
                   f"| {fmt(None if r.moved_per_req is None else r.moved_per_req / mib, 2)} "
                   f"| {fmt(None if r.uncached_per_req is None else r.uncached_per_req / mib, 2)} "
                   f"| {fmt(r.moved_ratio, 2)} | {fmt(r.skipped, 0)} | {busy_text(r.busy)} |")
    out.append("")
    for workload, slo in slos.items():
        note = (slo_notes or {}).get(workload)
        out.append(f"SLO ({workload}): TTFT <= {slo[0]:.0f} ms and TPOT <= {slo[1]:.1f} ms"
                   f"{f' ({note})' if note else ''}.")
    decided = decision_lines(runs)
    if decided:
        out += ["", f"Route decisions of our proxy (`{DECISIONS}`, choice/reason=requests):", "", *decided]
    errors = [f"- {run_name(r)}: {r.error}" for r in runs if r.error]
    if errors:
        out += ["", "Errors:", "", *errors]
    return "\n".join(out) + "\n"


def busy_text(busy: dict[str, float]) -> str:
    """``producer0 0.42, consumer0 0.97``: each instance's CPU use during the run, in cores."""
    return ", ".join(f"{name} {value:.2f}" for name, value in busy.items()) or "-"


def run_name(run: Run) -> str:
    return f"{run.front} / {run.workload} / {run.rate:g} req/s / round {run.round}"


def decision_lines(runs: list[Run]) -> list[str]:
    """One list item per run of our proxy that counted any route decision: how many requests each reason sent where
    (the ``skipped`` column says how many; this says why, e.g. ``local/faster_locally`` against
    ``remote/not_learned``)."""
    return [f"- {run_name(r)}: " + " ".join(f"{key}={count:.0f}" for key, count in sorted(r.decisions.items()))
            for r in runs if any(r.decisions.values())]


def medians(runs: list[Run]) -> dict[tuple[str, str, float], Run]:
    """Per (workload, front, rate): a run whose figures are the medians of that front's rounds at that rate (the run
    itself if one)."""
    groups: dict[tuple[str, str, float], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.front, r.rate), []).append(r)
    out = {}
    for key, group in groups.items():
        if len(group) == 1:
            out[key] = group[0]
            continue

        def med(name: str, group: list[Run] = group) -> float | None:
            values = [getattr(r, name) for r in group if getattr(r, name) is not None]
            return statistics.median(values) if values else None

        out[key] = Run(key[1], key[0], key[2], completed=sum(r.completed for r in group), goodput=med("goodput"),
                       ttft_p50=med("ttft_p50"), followup_ttft_p50=med("followup_ttft_p50"),
                       moved_per_req=med("moved_per_req"), uncached_per_req=med("uncached_per_req"))
    return out


def targets(runs: list[Run], thresholds: list[int]) -> tuple[list[str], dict[float, str]]:
    """The target checks at every rate swept (met / NOT met, with the figures), and the front chosen at each: the load
    may favour another rule (skipping a prefill costs the decode instance more when it is busier)."""
    by = medians([r for r in runs if not r.error and r.completed])
    lines: list[str] = []
    chosen: dict[float, str] = {}
    for rate in sorted({rate for (_, _, rate) in by}):
        found, front = targets_at(by, rate)
        lines += found
        if front is not None:
            chosen[rate] = front
    return lines or ["no completed run: nothing to check"], chosen


def targets_at(by: dict[tuple[str, str, float], Run], rate: float) -> tuple[list[str], str | None]:
    """The target checks at one rate, every line naming it, and the front chosen there: the best of the
    ``ours skip<N>`` and ``ours estimate`` fronts on the shared workload, compared with the others at the same rate."""
    at = f"{rate:g} req/s"

    def get(workload: str, front: str) -> Run | None:
        return by.get((workload, front, rate))

    candidates = [r for (workload, front, r_rate), r in by.items()
                  if workload == "shared" and r_rate == rate and skips_prefills(front)]
    if candidates:
        best = max(candidates, key=lambda r: (round(r.goodput or 0.0, 3), -(r.followup_ttft_p50 or 1e9)))
        lines = [f"{at}: chosen `{best.front}` (of the `ours skip<N>` and `ours estimate` fronts: the best goodput on "
                 "the shared workload, then the lowest follow-up TTFT)"]
    else:  # a random-only run: the first such front it ran
        front = next((f for (w, f, x) in by if w == "random" and x == rate and skips_prefills(f)), None)
        if front is None:
            return [f"{at}: no `ours skip<N>` or `ours estimate` run: nothing to check"], None
        best = Run(front, "shared", rate)
        lines = [f"{at}: checked `{front}` (no shared-workload run to choose by)"]

    def check(what: str, ok: bool | None, detail: str) -> None:
        lines.append(f"- {at}, {what}: {'met' if ok else 'NOT met' if ok is not None else 'not measured'} ({detail})")

    if candidates:
        ratio = best.moved_ratio
        check("KV moved <= 1.1x the uncached tokens' KV", None if ratio is None else ratio <= MOVED_TARGET,
              f"{fmt(ratio, 2)}x")
        for colo in ("colocated rr", "colocated ca"):
            c = get("shared", colo)
            if c is None:
                continue
            x = best.followup_ttft_p50 / c.followup_ttft_p50 if best.followup_ttft_p50 and c.followup_ttft_p50 else None
            check(f"follow-up TTFT p50 <= 1.05x {colo}", None if x is None else x <= TTFT_TARGET,
                  f"{fmt(best.followup_ttft_p50)} vs {fmt(c.followup_ttft_p50)} ms, {fmt(x, 2)}x")
        for peer in ("colocated rr", "colocated ca", fleet_prefix(best.front) + "router ca", "colocated4 rr"):
            p = get("shared", peer)
            if p is None or best.goodput is None or p.goodput is None:
                continue
            what = f"goodput >= {peer}" + (" (as many instances as the 2P2D; not an issue target)"
                                           if peer == "colocated4 rr" else "")
            check(what, best.goodput >= p.goodput, f"{best.goodput:.3f} vs {p.goodput:.3f} req/s")
    new = get("random", best.front)
    today = get("random", fleet_prefix(best.front) + "ours balance")
    if today and new and today.goodput is not None and new.goodput is not None and today.ttft_p50 and new.ttft_p50:
        check("random: goodput not lower than ours balance", new.goodput >= today.goodput,
              f"{new.goodput:.3f} vs {today.goodput:.3f} req/s")
        check("random: TTFT p50 within 10% of ours balance", new.ttft_p50 <= 1.1 * today.ttft_p50,
              f"{new.ttft_p50:.0f} vs {today.ttft_p50:.0f} ms")
    plain = get("random", fleet_prefix(best.front) + "ours prefix")
    if plain and new and plain.goodput is not None and new.goodput is not None:
        check("random: goodput not lower than ours prefix (no skipping)", new.goodput >= plain.goodput,
              f"{new.goodput:.3f} vs {plain.goodput:.3f} req/s")
    return lines, best.front


def slos_of(runs: list[Run], workloads: list[str], rate: float, x: float) -> dict[str, tuple[float, float]]:
    """Per workload: ``x`` times ``colocated rr``'s TTFT p50 and TPOT p50 at ``rate`` (medians over its rounds). One
    SLO for every rate, from the lowest: at a higher rate goodput then shows what the load costs each front."""
    out = {}
    for workload in workloads:
        base = [r for r in runs if r.front == "colocated rr" and r.workload == workload and r.rate == rate
                and r.ttft_p50 and r.tpot_p50]
        if base:
            out[workload] = (x * statistics.median(r.ttft_p50 for r in base),
                             x * statistics.median(r.tpot_p50 for r in base))
    return out


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
    parser.add_argument("--name", default="bench_routing",
                        help="results file name (default bench_routing; the figures depend on the machine: one file "
                             "per machine kind, e.g. bench_routing_sweep_<machine>)")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds: every front and workload at every rate this many times, round after round (the "
                             "checks use each front's median per rate; default 1)")
    parser.add_argument("--slo-from", type=Path, help="take the SLOs from an earlier results JSON (e.g. a run "
                        "without the colocated fleet)")
    args = parser.parse_args()
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
