"""The stacks bench_e2e, bench_serve and bench_ttft start, one at a time, on 127.0.0.1: ``colocated`` (one plain vLLM
instance), ``ours`` and ``push`` (our producer on core 0 and consumer on core 1, pull or push, ``proxy_server.py`` in
front) and ``builtin`` (vLLM's own MooncakeConnector through ``benchmarks/peers/builtin_mooncake_shim.py``); the
``vllm serve`` settings they share, the streaming HTTP client and the connector's log lines they parse."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from benchmarks.support.common import ROOT, native_dtype
from harness.ports import HOST, free_port
from harness.processes import http_ok, spawn, stop, wait_ready
from harness.vllm import VllmServer

SERVE_ARGS = ["--enforce-eager", "--max-model-len", "4608", "--kv-cache-memory-bytes", str(1 << 30), "--max-num-seqs", "8"]


def serve_args_for(dtype: str) -> list[str]:
    """The ``vllm serve`` arguments every stack gets, computing in ``dtype`` (see ``common.native_dtype``)."""
    return ["--dtype", dtype, *SERVE_ARGS]


REQUEST_TIMEOUT = 300.0

OURS_LOADED = re.compile(r"MooncakeConnector: loaded request \S+ \((?:pulled|pushed)\): (\d+) tokens, [^,]*, ([\d.]+) MiB in "
                         r"([\d.]+) ms")
PUSH_SPLIT = re.compile(r"\(pushed\).*waited ([\d.]+) ms for the push.* staging area in ([\d.]+) ms")  # wait, copy
OURS_FAILED = re.compile(r"MooncakeConnector: (?:loading the KV of request|the producer holds no KV|.*recomputing)")


# ----------------------------------------------------------------------------- HTTP client
def stream(url: str, path: str, body: dict[str, Any], ids: list[int] | None = None) -> tuple[float, float, str]:
    """POST a streamed completion; returns (seconds to the first chunk, seconds to the end, text). ``ids``: gets the
    answer's token ids (the body asks for them with ``return_token_ids``)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT)
    start = time.perf_counter()
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{url}{path} answered {resp.status}: {resp.read(500)!r}")
        first: float | None = None
        text: list[str] = []
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            if first is None:
                first = time.perf_counter() - start
            for choice in json.loads(payload).get("choices", []):
                text.append(choice.get("text") or "")
                if ids is not None:
                    ids += choice.get("token_ids") or []
        if first is None:
            raise RuntimeError(f"{url}{path} streamed no tokens")
        return first, time.perf_counter() - start, "".join(text)
    finally:
        conn.close()


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}{path} answered {resp.status}: {data[:500]!r}")
        return json.loads(data)
    finally:
        conn.close()


class LogTail:
    """New text of a log file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, path.stat().st_size if path.exists() else 0

    def new(self) -> str:
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return data.decode(errors="replace")


# ----------------------------------------------------------------------------- the stacks
class Stacks:
    """The servers of the stacks in ``modes``; the benchmark runs one stack at a time (``modes`` of one)."""

    def __init__(self, model: Path, work: Path, modes: tuple[str, ...], serve_args: list[str] | None = None) -> None:
        self.model, self.work, self.modes = model, work, modes
        self.serve_args = serve_args_for(native_dtype()) if serve_args is None else serve_args
        self.servers: dict[str, VllmServer] = {}
        self.proxy: subprocess.Popen | None = None
        self.proxy_url = ""
        self.extra_proxies: list[subprocess.Popen] = []
        self.bootstrap_port = free_port()

    def specs(self) -> list[tuple[str, int, dict[str, Any] | None, Path | None, dict[str, str]]]:
        """Every instance any stack may use: (name, core, kv_transfer_config, mooncake.json, extra environment);
        the part of the name before the first "-" is its stack. Writes the stacks' mooncake.json."""
        mooncake = self.work / "mooncake.json"
        mooncake.write_text(json.dumps({"prefill_url": f"{HOST}:{free_port()}", "decode_url": f"{HOST}:{free_port()}",
                                        "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}))
        ours = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector",
                "kv_load_failure_policy": "recompute"}
        push = {"kv_connector_extra_config": {"transfer_mode": "push"}}
        shim = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "builtin_mooncake_shim",
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
        peers = str(ROOT / "benchmarks" / "peers")
        builtin_env = {"VLLM_HOST_IP": HOST, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(self.bootstrap_port),
                       "PYTHONPATH": os.pathsep.join(p for p in (peers, os.environ.get("PYTHONPATH")) if p)}
        specs = [
            ("colocated", 0, None, None, {}),
            ("ours-producer", 0, {**ours, "kv_role": "kv_producer"}, mooncake, {}),
            ("ours-consumer", 1, {**ours, "kv_role": "kv_consumer"}, mooncake, {}),
            ("push-producer", 0, {**ours, "kv_role": "kv_producer", **push}, mooncake, {}),
            ("push-consumer", 1, {**ours, "kv_role": "kv_consumer", **push}, mooncake, {}),
            ("builtin-producer", 0, {**shim, "kv_role": "kv_producer", "engine_id": "bench-prefill"}, None, builtin_env),
            ("builtin-consumer", 1, {**shim, "kv_role": "kv_consumer", "engine_id": "bench-decode"}, None, builtin_env),
        ]
        return specs

    def start(self) -> None:
        began = time.monotonic()
        try:
            for name, core, kv, config, env in self.specs():
                if name.split("-")[0] not in self.modes:
                    continue
                self.servers[name] = VllmServer(name, self.model, free_port(), core, self.work, kv, config,
                                                self.serve_args, env)
            for name, server in self.servers.items():
                server.wait_ready()
                print(f"  {name} is up ({time.monotonic() - began:.0f} s)", flush=True)
            self.start_front()
        except BaseException:
            self.stop()
            raise

    def start_front(self) -> None:
        """The proxy in front of a disaggregated stack of ours, if one is in ``modes``."""
        ours_mode = next((m for m in ("ours", "push") if m in self.modes), None)
        if ours_mode is not None:
            self.start_proxy(self.proxy_args(ours_mode))

    def proxy_args(self, mode: str, *extra: str) -> list[str]:
        """``proxy_server.py`` in front of the stack ``mode`` of ours, with ``extra`` options; every prefill remote
        (``--skip-prefill-below 0``): these benchmarks time the disaggregated path."""
        return [str(ROOT / "proxy_server.py"), "--prefill", self.servers[f"{mode}-producer"].url, "--decode",
                self.servers[f"{mode}-consumer"].url, "--log-level", "WARNING", "--skip-prefill-below", "0", *extra]

    def start_extra_proxy(self, script_args: list[str]) -> str:
        """Another proxy (e.g. other options, same instances); its URL. Stopped with the stack."""
        main, url = (self.proxy, self.proxy_url)
        try:
            self.start_proxy(script_args)
            assert self.proxy is not None
            self.extra_proxies.append(self.proxy)
            return self.proxy_url
        finally:
            self.proxy, self.proxy_url = main, url

    def start_proxy(self, script_args: list[str]) -> None:
        """Start ``python script_args... --host HOST --port PORT`` as ``self.proxy`` and wait for its /health."""
        port = free_port()
        self.proxy_url = f"http://{HOST}:{port}"
        cmd = [sys.executable, *script_args, "--host", HOST, "--port", str(port)]
        log = self.work / "proxy.log"
        self.proxy = spawn(cmd, log)
        wait_ready(self.proxy, cmd, log, http_ok(f"{self.proxy_url}/health"), "proxy", 60.0)

    def stop(self) -> None:
        for proxy in [self.proxy, *self.extra_proxies]:
            if proxy is not None:
                stop(proxy)
        for server in self.servers.values():
            server.stop()

    def body(self, tokens: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
        return {"model": str(self.model), "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, **extra}

    def external_hits(self) -> dict[str, float]:
        return {name: self.servers[name].metric("vllm:external_prefix_cache_hits_total")
                for name in ("ours-consumer", "push-consumer", "builtin-consumer") if name in self.servers}
