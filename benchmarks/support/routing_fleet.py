"""The vLLM fleets bench_routing measures and the fronts it puts before them, and what it reads from the instances:
their metrics, their processes' CPU time, their prefix caches emptied between runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks.support.common import ROOT
from benchmarks.support.routing_report import base_front
from harness.ports import HOST, free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm import VllmServer, connector_config, mooncake_json, start_vllm

DEV_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


# ----------------------------------------------------------------------------- instance processes
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

