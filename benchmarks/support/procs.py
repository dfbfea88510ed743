"""Child processes of the multi-process benchmarks (bench_pipe, bench_xpyd): started with "spawn" (a fresh
interpreter, its own Transfer Engine), each reporting a failure with its traceback; the parent waits for them with
deadlines and notices a dead child at once."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

SPAWN = mp.get_context("spawn")
POLL = 0.2  # seconds between two looks at a child while waiting for it


def failure(who: str, e: BaseException) -> str:
    """What a child reports when it fails: who, the error, and the traceback being handled."""
    return f"{who}: {type(e).__name__}: {e}\n{traceback.format_exc()}"


def get(q: Any, timeout: float, check: Callable[[], None], what: str) -> Any:
    """The next item of ``q``. Between polls ``check()`` raises if a child failed or died; TimeoutError (naming
    ``what``) once ``timeout`` seconds passed without an item."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=POLL)
        except queue.Empty:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: nothing within {timeout:.0f} s") from None


def watch_parent(parent: int) -> None:
    """In a child: exit at once if the parent dies (its children must not linger holding ports and memory)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def run_threads(targets: list[Callable[[], None]], timeout: float, what: str) -> None:
    """Run every target in a thread of its own and wait for all; TimeoutError after ``timeout`` seconds, once the
    stacks of every thread are dumped on stderr (where the late ones are stuck)."""
    threads = [threading.Thread(target=t, daemon=True, name=f"{what}-{k}") for k, t in enumerate(targets)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"{what}: threads still running after {timeout:.0f} s (their stacks are on stderr)")
