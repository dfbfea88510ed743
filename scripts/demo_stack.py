"""The whole stack on one machine: a producer vLLM, a consumer vLLM and the proxy, on 127.0.0.1, sharing a KV pool
(a mooncake_master on 127.0.0.1:50051).

    .venv/bin/python scripts/demo_stack.py                 # start, send a completion and a chat request, stop
    .venv/bin/python scripts/demo_stack.py --keep-running  # start, then leave it running until Ctrl-C

Uses mooncake.json.example (P2PHANDSHAKE, TCP, 127.0.0.1:13003 / :13103) with the KV pool's keys added (the master,
256 MB of pool and 64 MB of staging per instance), the tiny local model built by scripts/setup.sh, the producer
pinned to core 0 and the consumer to core 1, ports 8100 (producer), 8200 (consumer), 8000 (proxy), 50051 (the
pool's master). Sends a completion, a chat request and the chat's next turn through the proxy, then a question about
a document the producer read straight to the consumer (the document's KV comes from the pool). Logs go to a
temporary directory, printed at the start. Everything is stopped on exit and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
START_TIMEOUT = 600.0
CONNECTOR = {"kv_connector": "MooncakeConnector", "kv_connector_module_path": "kv_connector.mooncake_connector",
             "kv_load_failure_policy": "recompute"}  # a failed KV load is recomputed (vLLM's default: an error)
MASTER_PORT, MASTER_METRICS_PORT = 50051, 9003  # the KV pool's master (Mooncake's default ports)
SERVE = ["--host", HOST, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(128 << 20)]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT leftovers are fine
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def start(name: str, cmd: list[str], logs: Path, env: dict[str, str]) -> subprocess.Popen:
    log = (logs / f"{name}.log").open("wb")
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_all(procs: dict[str, tuple[subprocess.Popen, str]], logs: Path) -> None:
    began = time.monotonic()
    pending = dict(procs)
    while pending:
        for name, (proc, url) in list(pending.items()):
            if proc.poll() is not None:
                tail = (logs / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
                raise SystemExit(f"{name} exited with code {proc.returncode} while starting:\n" + "\n".join(tail))
            if healthy(url):
                print(f"  {name} is up ({time.monotonic() - began:.0f} s)", flush=True)
                del pending[name]
        if time.monotonic() - began > START_TIMEOUT:
            raise SystemExit(f"{', '.join(pending)} did not start within {START_TIMEOUT:.0f} s; see the logs in {logs}")
        if pending:
            print(f"  waiting for {', '.join(pending)} ... {time.monotonic() - began:.0f} s", flush=True)
            time.sleep(5)


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def transfer_stats(logs: Path) -> list[str]:
    lines = []
    for name, pattern in (("producer", "saved request|loaded request"), ("consumer", "loaded request|layout")):
        for line in (logs / f"{name}.log").read_text(errors="replace").splitlines():
            if "MooncakeConnector" in line and re.search(pattern, line):
                lines.append(f"  {name}: {line.split('MooncakeConnector: ', 1)[-1]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep-running", action="store_true", help="leave the stack running until Ctrl-C")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "models" / "tiny")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"{args.model} has no model: run scripts/setup.sh (it builds the tiny models)")
    busy = [p for p in (8000, 8100, 8200, 13003, 13103, MASTER_PORT, MASTER_METRICS_PORT) if not port_free(p)]
    if busy:
        raise SystemExit(f"ports {busy} on {HOST} are in use: stop what holds them (an earlier demo?) and try again")

    logs = Path(tempfile.mkdtemp(prefix="mooncake-demo-"))
    config = logs / "mooncake.json"
    config.write_text(json.dumps({**json.loads((REPO / "mooncake.json.example").read_text()),
                                  "master_server_address": f"{HOST}:{MASTER_PORT}", "global_segment_size": "256MB",
                                  "local_buffer_size": "64MB"}))
    vllm = str(Path(sys.executable).parent / "vllm")
    # a fresh shared secret for this demo's pipes, as a deployment sets one (docs/deployment.md, Security)
    secret = os.environ.get("MOONCAKE_KV_SECRET") or secrets.token_hex(32)
    env = dict(os.environ, MOONCAKE_CONFIG_PATH=str(config), HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               MC_LOG_LEVEL="WARNING", MOONCAKE_KV_SECRET=secret)
    print(f"logs and mooncake.json in {logs}")
    print("starting the producer (core 0, port 8100) and the consumer (core 1, port 8200); vLLM takes ~30-60 s ...")
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start("mooncake_master", [str(Path(sys.executable).parent / "mooncake_master"),
                                               f"--rpc_port={MASTER_PORT}", f"--rpc_address={HOST}",
                                               f"--metrics_host={HOST}", f"--metrics_port={MASTER_METRICS_PORT}"],
                           logs, env))
        for name, port, core, role in (("producer", 8100, 0, "kv_producer"), ("consumer", 8200, 1, "kv_consumer")):
            cmd = [vllm, "serve", str(args.model), "--port", str(port), *SERVE,
                   "--kv-transfer-config", json.dumps({**CONNECTOR, "kv_role": role})]
            procs.append(start(name, cmd, logs, dict(env, VLLM_CPU_OMP_THREADS_BIND=str(core))))
        procs.append(start("proxy", [sys.executable, str(REPO / "proxy_server.py"), "--prefill", f"http://{HOST}:8100",
                                     "--decode", f"http://{HOST}:8200", "--host", HOST, "--port", "8000"], logs, env))
        wait_all({"producer": (procs[1], f"http://{HOST}:8100"), "consumer": (procs[2], f"http://{HOST}:8200"),
                  "proxy": (procs[3], f"http://{HOST}:8000")}, logs)
        model = str(args.model)
        if args.keep_running:
            print("\nThe stack is running. Try:\n"
                  f"  curl -s http://{HOST}:8000/v1/completions -H 'Content-Type: application/json' -d "
                  f"'{json.dumps({'model': model, 'prompt': 'def fibonacci(n):', 'max_tokens': 32})}'\n"
                  f"Logs: {logs}. Stop with Ctrl-C.")
            while all(p.poll() is None for p in procs):
                time.sleep(1)
            print("a server exited; stopping the others")
            return 1
        prompt = "import os\nimport sys\n\ndef main(argv):\n    " * 20
        answer = post(f"http://{HOST}:8000/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 24})
        print(f"\ncompletion through the proxy ({answer['usage']['prompt_tokens']} prompt tokens):\n"
              f"  {answer['choices'][0]['text']!r}")
        messages = [{"role": "user", "content": "Write a Python function that reads a file. " * 30}]
        chat = post(f"http://{HOST}:8000/v1/chat/completions", {"model": model, "max_tokens": 24,
                                                                "messages": messages})
        reply = chat["choices"][0]["message"]["content"]
        print(f"chat through the proxy ({chat['usage']['prompt_tokens']} prompt tokens):\n  {reply!r}")
        time.sleep(1.0)  # the decode's pool save: its answer's blocks
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now add error handling."}]
        turn = post(f"http://{HOST}:8000/v1/chat/completions", {"model": model, "max_tokens": 24,
                                                                "messages": messages})
        print(f"the chat's next turn ({turn['usage']['prompt_tokens']} prompt tokens: its history is held, the proxy "
              f"sends it straight to the consumer):\n  {turn['choices'][0]['message']['content']!r}")
        # the pool: a document the producer read (served whole there), then a question about it sent straight to the
        # consumer, which never saw it: its KV comes from the pool
        document = "class Config:\n    def load(self, path):\n        return open(path).read()\n" * 25
        post(f"http://{HOST}:8100/v1/completions", {"model": model, "prompt": document + "# summary:", "max_tokens": 8,
                                                    "kv_transfer_params": {"do_remote_decode": False}})
        time.sleep(1.0)  # the producer's pool save
        question = post(f"http://{HOST}:8200/v1/completions", {"model": model, "prompt": document + "# tests:",
                                                                "max_tokens": 8})
        print(f"a question about a document only the producer read, sent straight to the consumer "
              f"({question['usage']['prompt_tokens']} prompt tokens, the document's KV from the pool):\n"
              f"  {question['choices'][0]['text']!r}")
        time.sleep(1.0)
        print("\nKV transfer stats (from the instances' logs):")
        print("\n".join(transfer_stats(logs)) or "  none found: see the logs")
        # what shows KV moved: loads that wrote it into the consumer's cache (vLLM's external_prefix_cache_hits
        # counts claims, failed loads included)
        for name, port in (("producer", 8100), ("consumer", 8200)):
            with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as resp:
                moved = [line for line in resp.read().decode().splitlines() if line.startswith(
                    ("vllm:mooncake_kv_loaded_total", "vllm:mooncake_kv_loaded_bytes_total",
                     "vllm:mooncake_kv_pool_loaded_bytes_total", "vllm:mooncake_kv_pool_saved_bytes_total"))]
            print("\n".join(f"  {name} {line}" for line in moved) or f"  {name}: no KV moved on /metrics")
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    finally:
        print("stopping the proxy, both vLLM instances and the pool's master ...", flush=True)
        stop(procs[1:])  # the instances first: they leave the pool while its master still answers
        stop(procs[:1])
        print("stopped.")


if __name__ == "__main__":
    sys.exit(main())
