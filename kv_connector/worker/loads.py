"""The consumer's loads in flight: each runs in a pool thread (fetch, then copy into the KV cache) with its own
deadline, so the fetch of one overlaps the copy of another and a slow producer delays only its own requests. The
engine loop collects finished ones every step. A load never raises into vLLM: whatever goes wrong is logged,
counted, and reported as a failed load, which vLLM recomputes.

A load awaiting a push (a decode sent together with its prefill) spends most of its time waiting for the producer's
prefill: it runs in a pool of its own, so that such waits never hold the ``concurrency`` slots other loads need.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

from kv_connector.cache.layout import LayoutMismatch
from kv_connector.cache.pinned import ArenaFull
from kv_connector.cache.staging import CacheSuspended
from kv_connector.metadata import LoadRequest
from kv_connector.stats import StatsRecorder
from kv_connector.worker.transfer import KVMiss, LoadResult
from kv_lookup_buffer import BufferClosed
from kv_pipe import PipeError

logger = logging.getLogger(f"vllm.{__name__}")
AWAITING_LOADS = 64  # threads for loads awaiting a push: nearly all of their time is a wait on a condition


@dataclass
class Finished:
    """What the engine loop reports to vLLM this step."""

    done: set[str] = field(default_factory=set)  # every finished load, failed ones included
    failed: set[str] = field(default_factory=set)  # nothing usable: the prompt is recomputed
    bad_blocks: set[int] = field(default_factory=set)  # blocks a partial load did not write (recomputed from there)
    sending: set[str] = field(default_factory=set)  # held requests whose copies out of the cache ended
    partial: set[str] = field(default_factory=set)  # loads that wrote only some of their blocks


class Loads:
    def __init__(self, load: Callable[[LoadRequest, float], LoadResult], concurrency: int, timeout: float,
                 stats: StatsRecorder, thread_init: Callable[[], None] | None = None, fail: bool = False) -> None:
        """``thread_init``: run by each loader thread first (e.g. make the KV cache's GPU its current device).
        ``fail``: vLLM ends a request whose load failed with an error (kv_load_failure_policy "fail"; the logs say
        so), else recomputes its prompt."""
        self._load = load
        self._then = "its request fails (kv_load_failure_policy fail)" if fail else "recomputing"
        self.timeout = timeout
        self.stats = stats
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="mooncake-kv-load",
                                        initializer=thread_init)
        self._awaiting = ThreadPoolExecutor(max_workers=AWAITING_LOADS, thread_name_prefix="mooncake-kv-await",
                                            initializer=thread_init)
        self._running: dict[str, tuple[LoadRequest, Future[LoadResult | None]]] = {}
        self._lock = threading.Lock()

    def start(self, req: LoadRequest) -> None:
        deadline = time.monotonic() + self.timeout  # from the claim: time queued behind other loads counts too
        self.stats.gauge("loads_in_flight", 1)
        pool = self._awaiting if req.source.await_push else self._pool
        self._running[req.req_id] = (req, pool.submit(self._run, req, deadline))

    def _run(self, req: LoadRequest, deadline: float) -> LoadResult | None:
        """One load, start to end; None if nothing was written. Never raises."""
        start = time.perf_counter()
        try:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"it waited longer than load_timeout={self.timeout:g} s to start")
            result = self._load(req, deadline)
        except KVMiss:
            logger.info("MooncakeConnector: the producer holds no KV for request %s (%d tokens; asked in %.1f ms): %s",
                        req.req_id, len(req.token_ids), (time.perf_counter() - start) * 1e3, self._then)
            self.stats.count("load_misses")
            return None
        except LayoutMismatch as e:
            logger.error("MooncakeConnector: %s; request %s: %s", e, req.req_id, self._then)
            self.stats.count("load_failures")
            return None
        except (PipeError, BufferClosed, TimeoutError, ValueError, ArenaFull, CacheSuspended) as e:
            logger.warning("MooncakeConnector: loading the KV of request %s failed (%s): %s", req.req_id, e, self._then)
            self.stats.count("load_failures")
            return None
        except Exception:
            logger.exception("MooncakeConnector: loading the KV of request %s failed unexpectedly: %s", req.req_id,
                             self._then)
            self.stats.count("load_failures")
            return None
        finally:
            self.stats.gauge("loads_in_flight", -1)
        seconds = time.perf_counter() - start
        self.stats.count("loaded")
        if req.source.from_params:
            self.stats.count("param_loads")
        self.stats.count("loaded_bytes", result.loaded_bytes)
        self.stats.count("fetched_bytes", result.fetched_bytes)
        pushed = result.source == "pushed"
        if result.source == "pool":
            self.stats.count("pool_loaded")
        self.stats.sample({"pushed": "push_loads", "pool": "pool_loads"}.get(result.source, "loads"), req.num_tokens,
                          result.loaded_bytes, seconds)
        partial = result.written < len(req.block_ids)
        if partial:
            self.stats.count("partial_loads")
        rate = "" if pushed else f"{result.loaded_bytes / seconds / 1e9:.2f} GB/s; "  # a push load is a wait
        logger.info("MooncakeConnector: loaded request %s (%s): %d tokens, blocks %d-%d of the prompt%s, %.2f MiB in "
                    "%.1f ms (%s%s)", req.req_id, result.source, req.num_tokens, req.first_block,
                    req.first_block + result.written - 1,
                    f" (the producer's entry covered {result.written} of {len(req.block_ids)} blocks)" if partial else "",
                    result.loaded_bytes / 2**20, seconds * 1e3, rate, result.detail)
        return result

    def pending(self) -> list[Future[LoadResult | None]]:
        return [f for _, f in self._running.values()]

    def collect(self, wait: float = 0.0) -> Finished:
        """Loads finished since the last call. ``wait``: block up to that long for one to finish (when the step had
        nothing to compute: vLLM would otherwise spin its engine loop, taking the CPU and the GIL from the load)."""
        if wait and self._running:
            futures_wait(self.pending(), timeout=wait, return_when=FIRST_COMPLETED)
        out = Finished()
        for req_id, (req, future) in list(self._running.items()):
            if not future.done():
                continue
            del self._running[req_id]
            error = future.exception()  # only something like SystemExit gets out of _run: never into vLLM
            if error is not None:
                logger.error("MooncakeConnector: loading the KV of request %s ended with %r: %s", req_id, error,
                             self._then)
                self.stats.count("load_failures")
            result = None if error is not None else future.result()
            out.done.add(req_id)
            if result is None or result.written == 0:
                out.failed.add(req_id)
            elif result.written < len(req.block_ids):
                out.bad_blocks.update(req.block_ids[result.written:])
                out.partial.add(req_id)
        return out

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every load in flight to end (they stay to be collected); how many have
        not."""
        futures_wait([f for _, f in list(self._running.values())], timeout=timeout)
        return sum(not f.done() for _, f in list(self._running.values()))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._awaiting.shutdown(wait=False, cancel_futures=True)
