"""Server processes started for a test or a benchmark: spawned in their own process group, waited for until they
answer, always stopped (with everything they started) afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from harness.vllm_fork import ForkedProcess, ForkServerError

START_TIMEOUT = 20.0
STOP_TIMEOUT = 10.0


class ServerUnavailable(RuntimeError):
    """A server binary is missing or would not start, or no port is free; the message says what to do."""


def wheel_binary(name: str) -> str:
    """A program the Mooncake Transfer Engine wheel installs beside this Python (``mooncake_master``, ...)."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        raise ServerUnavailable(f"{path} not found: run scripts/setup.sh, which installs the Mooncake Transfer Engine "
                                f"wheel (it ships {name})")
    return str(path)


def log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen | ForkedProcess) -> None:
    """SIGTERM to its whole process group (servers like vLLM fork workers), then SIGKILL if it does not exit in
    time; always reaps the process."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    kill(proc)


def kill(proc: subprocess.Popen | ForkedProcess) -> None:
    """SIGKILL the process and everything it started (its process group), and reap it."""
    signal_group(proc, signal.SIGKILL)
    proc.wait(timeout=STOP_TIMEOUT)


def signal_group(proc: subprocess.Popen | ForkedProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError, ForkServerError):  # gone, or never forked
        pass


def start(cmd: list[str], log: Path, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT,
          env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``cmd`` (output to ``log``) and wait until ``ready()``; raises with the log's tail if it dies or is late."""
    proc = spawn(cmd, log, env)
    wait_ready(proc, cmd, log, ready, what, timeout)
    return proc


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # its own process group: stop() reaches its children


def wait_ready(proc: subprocess.Popen | ForkedProcess, cmd: list[str], log: Path, ready: Callable[[], bool], what: str,
               timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise ServerUnavailable(f"{what} exited with code {proc.returncode} before it was ready; "
                                        f"command {' '.join(cmd)}; log tail:\n{log_tail(log)}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{what} did not answer within {timeout:.0f} s; "
                                        f"command {' '.join(cmd)}; log tail:\n{log_tail(log)}")
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
