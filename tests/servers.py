"""Real metadata servers for tests, started on 127.0.0.1 with free ports and always stopped afterwards.

``etcd_server`` runs Debian's ``etcd`` (package etcd-server); ``http_metadata_server`` runs the Mooncake wheel's
``mooncake_http_metadata_server``. Both are context managers yielding the address the pipe's config takes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0
ATTEMPTS = 3  # a free port can be taken between picking it and the server binding it: retry with new ones


class ServerUnavailable(RuntimeError):
    """A server binary is missing or would not start; the message says what to do."""


def _port_range() -> tuple[int, int]:
    """Below the kernel's ephemeral range: a port picked here is not handed out meanwhile to another process's outgoing
    connection or to a server binding port 0 (vLLM's own sockets do). ``MKV_TEST_PORTS=first-last`` narrows it, so
    that test runs side by side (scripts/test.sh) never pick the same port."""
    first, last = os.environ.get("MKV_TEST_PORTS", "20000-31999").split("-")
    return int(first), int(last) + 1


_PORTS = _port_range()


_handed_out: set[int] = set()


def free_port(host: str = HOST) -> int:
    """A port nothing listens on now and not handed out before by this process, for a server a test starts next."""
    for _ in range(1000):
        port = random.randrange(*_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise ServerUnavailable(f"no free port in {_PORTS} on {host}")


def find_etcd() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").is_file() else None)
    if path is None:
        raise ServerUnavailable("the etcd binary was not found (PATH, /usr/bin/etcd): run scripts/setup.sh, "
                                "which installs the Debian package etcd-server")
    return path


def find_http_metadata_server() -> str:
    path = Path(sys.executable).parent / "mooncake_http_metadata_server"
    if not path.is_file():
        raise ServerUnavailable(f"{path} not found: run scripts/setup.sh, which installs the Mooncake Transfer Engine "
                                "wheel (it provides mooncake_http_metadata_server)")
    return str(path)


def _log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to its whole process group (servers like vLLM fork workers), then SIGKILL if it does not exit in
    time; always reaps the process."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    kill(proc)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the process and everything it started (its process group), and reap it."""
    signal_group(proc, signal.SIGKILL)
    proc.wait(timeout=STOP_TIMEOUT)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _start(cmd: list[str], log: Path, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` (output to ``log``) and wait until ``ready()``; raises with the log's tail if it dies or is late."""
    proc = spawn(cmd, log, env)
    wait_ready(proc, cmd, log, ready, what, timeout)
    return proc


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own process group: stop() reaches its children


def wait_ready(proc: subprocess.Popen, cmd: list[str], log: Path, ready: Callable[[], bool], what: str,
               timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise ServerUnavailable(f"{what} exited with code {proc.returncode} before it was ready; "
                                        f"command {' '.join(cmd)}; log tail:\n{_log_tail(log)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{what} did not answer within {timeout:.0f} s; "
                                        f"command {' '.join(cmd)}; log tail:\n{_log_tail(log)}")
            time.sleep(0.1)
    except BaseException:
        stop(proc)
        raise


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False
    return check


def _metadata_answers(port: int, log: Path) -> Callable[[], bool]:
    """Ready when the port accepts and a GET of an unknown key gets the server's own 404 "metadata not found".

    The server catches its own bind error in a thread and keeps running, so its log is checked too.
    """
    def check() -> bool:
        if "Server error" in _log_tail(log):
            raise ServerUnavailable(f"mooncake_http_metadata_server failed on port {port}: {_log_tail(log)}")
        try:
            with socket.create_connection((HOST, port), timeout=1.0):
                pass
        except OSError:
            return False
        try:
            urllib.request.urlopen(f"http://{HOST}:{port}/metadata?key=readiness-probe", timeout=1.0).close()
        except urllib.error.HTTPError as e:
            return e.code == 404 and b"metadata not found" in e.read()
        except OSError:
            return False
        return False
    return check


@contextlib.contextmanager
def etcd_server(data_root: Path) -> Iterator[str]:
    """A one-member etcd cluster on 127.0.0.1 with its data under ``data_root``; yields its "host:port"."""
    binary = find_etcd()
    error: ServerUnavailable | None = None
    for attempt in range(ATTEMPTS):
        client, peer = free_port(), free_port()
        data_dir = data_root / f"etcd-{attempt}"
        client_url, peer_url = f"http://{HOST}:{client}", f"http://{HOST}:{peer}"
        cmd = [binary, "--name", "test", "--data-dir", str(data_dir),
               "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"test={peer_url}", "--initial-cluster-state", "new"]
        try:
            proc = _start(cmd, data_root / f"etcd-{attempt}.log", http_ok(f"{client_url}/health"), "etcd")
        except ServerUnavailable as e:
            error = e
            continue
        try:
            yield f"{HOST}:{client}"
        finally:
            stop(proc)
        return
    raise ServerUnavailable(f"etcd would not start in {ATTEMPTS} attempts: {error}")


@contextlib.contextmanager
def http_metadata_server(log_dir: Path) -> Iterator[str]:
    """The wheel's HTTP metadata server on 127.0.0.1; yields "http://127.0.0.1:PORT/metadata"."""
    binary = find_http_metadata_server()
    error: ServerUnavailable | None = None
    for attempt in range(ATTEMPTS):
        port = free_port()
        cmd = [binary, "--host", HOST, "--port", str(port)]
        try:
            log = log_dir / f"http-metadata-{attempt}.log"
            proc = _start(cmd, log, _metadata_answers(port, log), "mooncake_http_metadata_server")
        except ServerUnavailable as e:
            error = e
            continue
        try:
            yield f"http://{HOST}:{port}/metadata"
        finally:
            stop(proc)
        return
    raise ServerUnavailable(f"mooncake_http_metadata_server would not start in {ATTEMPTS} attempts: {error}")


def etcd_get(endpoint: str, key: str) -> bytes | None:
    """The value of ``key`` in the etcd at ``host:port`` (v3 JSON gateway), or None if absent."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=body, method="POST")
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        kvs = json.loads(resp.read()).get("kvs", [])
    return base64.b64decode(kvs[0]["value"]) if kvs else None


def http_metadata_get(url: str, key: str) -> bytes | None:
    """The value of ``key`` in the HTTP metadata server at ``url`` (".../metadata"), or None if absent."""
    try:
        with urllib.request.urlopen(f"{url}?key={urllib.parse.quote(key, safe='')}", timeout=5.0) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


# ----------------------------------------------------------------------------- vLLM
REPO = Path(__file__).resolve().parents[1]
VLLM_START_TIMEOUT = 420.0  # cold starts on a busy 2-core machine


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


class VllmServer(OpenAIClient):
    """One ``vllm serve`` process on 127.0.0.1 (pinned to ``core``), with its log file."""

    def __init__(self, name: str, model: Path, port: int, core: int, log_dir: Path, kv_transfer_config: dict | None,
                 mooncake_json: Path | None, extra_args: list[str], env: dict[str, str] | None = None,
                 confine: bool = False) -> None:
        super().__init__(f"http://{HOST}:{port}", str(model))
        self.name, self.port = name, port
        self.log = log_dir / f"{name}.log"
        # confine: every process of the instance on its core. A starting vLLM (torch's import) pins itself to each
        # core it may use in turn to probe it, and next to a busy vLLM on the other core that probe stalled for
        # minutes on this 2-core machine: an instance (re)started under load must stay off the busy core.
        self.cmd = [*(["taskset", "-c", str(core)] if confine else []), str(Path(sys.executable).parent / "vllm"), "serve",
                    self.model, "--host", HOST, "--port", str(port), *extra_args]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        # the connector is found through the installed package, as for users; ``env`` adds or overrides variables
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "MC_LOG_LEVEL": "WARNING", **(env or {})}
        if mooncake_json is not None:
            env["MOONCAKE_CONFIG_PATH"] = str(mooncake_json)
        self.env = env
        self.proc = spawn(self.cmd, self.log, env)

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.cmd, self.log, http_ok(f"{self.url}/health"), f"vLLM {self.name}", VLLM_START_TIMEOUT)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        stop(self.proc)

    def restart(self) -> None:
        """Start the same command again (after a stop or a kill), and wait until it serves."""
        stop(self.proc)
        self.proc = spawn(self.cmd, self.log, self.env)
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
