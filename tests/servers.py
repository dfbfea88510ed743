"""Real metadata servers for tests, started on 127.0.0.1 with free ports and always stopped afterwards.

``etcd_server`` runs Debian's ``etcd`` (package etcd-server); ``http_metadata_server`` runs the Mooncake wheel's
``mooncake_http_metadata_server``. Both are context managers yielding the address the pipe's config takes. Ports,
processes and vLLM instances, which the benchmarks use too, are in ``harness``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from harness.ports import HOST, free_port
from harness.processes import ServerUnavailable, http_ok, log_tail, start, stop, wheel_binary

ATTEMPTS = 3  # a free port can be taken between picking it and the server binding it: retry with new ones


def find_etcd() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").is_file() else None)
    if path is None:
        raise ServerUnavailable("the etcd binary was not found (PATH, /usr/bin/etcd): run scripts/setup.sh, "
                                "which installs the Debian package etcd-server")
    return path


def _metadata_answers(port: int, log: Path) -> Callable[[], bool]:
    """Ready when the port accepts and a GET of an unknown key gets the server's own 404 "metadata not found".

    The server catches its own bind error in a thread and keeps running, so its log is checked too.
    """
    def check() -> bool:
        if "Server error" in log_tail(log):
            raise ServerUnavailable(f"mooncake_http_metadata_server failed on port {port}: {log_tail(log)}")
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
def etcd_server(data_root: Path, host: str = HOST, prefix: list[str] | None = None,
                probe_host: str | None = None) -> Iterator[str]:
    """A one-member etcd cluster on ``host`` with its data under ``data_root``; yields its "host:port". ``prefix``:
    run it on another host (harness/netns.py), reached from here at ``probe_host``."""
    binary = find_etcd()
    error: ServerUnavailable | None = None
    for attempt in range(ATTEMPTS):
        client, peer = free_port(), free_port()
        data_dir = data_root / f"etcd-{attempt}"
        client_url, peer_url = f"http://{host}:{client}", f"http://{HOST}:{peer}"  # peers: none but itself
        listen = client_url if probe_host is None else f"{client_url},http://{probe_host}:{client}"
        cmd = [*(prefix or []), binary, "--name", "test", "--data-dir", str(data_dir),
               "--listen-client-urls", listen, "--advertise-client-urls", client_url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"test={peer_url}", "--initial-cluster-state", "new"]
        try:
            proc = start(cmd, data_root / f"etcd-{attempt}.log",
                         http_ok(f"http://{probe_host or host}:{client}/health"), "etcd")
        except ServerUnavailable as e:
            error = e
            continue
        try:
            yield f"{host}:{client}"
        finally:
            stop(proc)
        return
    raise ServerUnavailable(f"etcd would not start in {ATTEMPTS} attempts: {error}")


@contextlib.contextmanager
def http_metadata_server(log_dir: Path) -> Iterator[str]:
    """The wheel's HTTP metadata server on 127.0.0.1; yields "http://127.0.0.1:PORT/metadata"."""
    binary = wheel_binary("mooncake_http_metadata_server")
    error: ServerUnavailable | None = None
    for attempt in range(ATTEMPTS):
        port = free_port()
        cmd = [binary, "--host", HOST, "--port", str(port)]
        try:
            log = log_dir / f"http-metadata-{attempt}.log"
            proc = start(cmd, log, _metadata_answers(port, log), "mooncake_http_metadata_server")
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
