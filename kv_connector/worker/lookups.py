"""The consumer's lookups in flight (find before you claim; the scheduler side is ``scheduler.consumer``): each asks
the producer ranks this TP rank would load from how much of a prompt they hold, in a pool thread, with its own
deadline; the engine loop collects the answers every step and vLLM carries them to the scheduler
(``MooncakeWorkerMetadata``). A lookup never raises into vLLM: a producer that cannot be reached, does not answer in
time or answers nonsense is an answer of 0 tokens (the prompt is computed here), logged and counted.

A producer that could not be reached (refused, or its link did not come up: a dead or frozen one) is not asked again
for ``backoff`` seconds: its lookups answer 0 at once. A lookup that timed out on a link that is up (queued behind
large loads, or a producer frozen after it linked) costs its request ``timeout`` and backs nothing off: a busy
producer must not be taken for a dead one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from kv_connector.metadata import LeaseRelease, LookupAnswer, LookupRequest
from kv_connector.stats import StatsRecorder
from kv_lookup_buffer import BufferClosed, StoreError
from kv_pipe import PipeError

logger = logging.getLogger(f"vllm.{__name__}")
THREADS = 8  # lookups in flight at once: each is one small request and answer, mostly a wait on the network


class ProducerDown(Exception):
    """A lookup was not sent: the producer failed to answer a moment ago (``Lookups.backoff``)."""


class Lookups:
    """``look(req, deadline)``: the tokens of ``req``'s prompt the producers hold for this rank (raises if it cannot
    tell); ``producers(req)``: the addresses it asks (for the back-off); ``release(release)``: tell them a lease
    will not be used. All three None: an instance with no producer (its lookups ask the pool only)."""

    def __init__(self, look: Callable[[LookupRequest, float], int] | None,
                 producers: Callable[[LookupRequest], list[str]] | None,
                 release: Callable[[LeaseRelease], None] | None, rank: int, timeout: float, stats: StatsRecorder,
                 backoff: float, thread_init: Callable[[], None] | None = None,
                 pool: Callable[[list[int], float], int] | None = None) -> None:
        """``pool(tokens, deadline)``: the tokens of a prompt the KV pool holds for this rank (None: no pool)."""
        self._look, self._producers, self._release, self._in_pool = look, producers, release, pool
        self.rank, self.timeout, self.stats, self.backoff = rank, timeout, stats, backoff
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="mooncake-kv-lookup",
                                        initializer=thread_init)
        self._pool_asks = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="mooncake-pool-lookup")
        self._running: dict[tuple[str, int], Future[LookupAnswer]] = {}
        self._down: dict[str, float] = {}  # producer -> until when it is not asked
        self._lock = threading.Lock()

    def start(self, req: LookupRequest) -> None:
        self._running[req.req_id, req.lease] = self._pool.submit(self._run, req)

    def release(self, release: LeaseRelease) -> None:
        """Tell the producers ``release.source`` names (those this rank asks) that ``release.lease`` is not used;
        best effort, off the engine loop."""
        self._pool.submit(self._release_quietly, release)

    def _release_quietly(self, release: LeaseRelease) -> None:
        if self._release is None:
            return
        try:
            self._release(release)
        except Exception as e:  # the lease ends on its own anyway
            logger.debug("MooncakeConnector: could not release lease %d: %s", release.lease, e)

    def _run(self, req: LookupRequest) -> LookupAnswer:
        deadline = time.monotonic() + self.timeout  # from when a thread takes it: its wait in the queue is ours
        asks_pool = self._in_pool is not None and req.pool
        if req.source.pool_only or self._look is None:
            pooled = self._ask_pool(req, deadline) if asks_pool else 0
            return LookupAnswer(req.req_id, req.lease, self.rank, 0, "", pooled)
        # both at once, each with the whole deadline: a slow pool must not eat the producer's time, nor the reverse
        pool = self._pool_asks.submit(self._ask_pool, req, deadline) if asks_pool else None
        answer = self._ask_producer(req, deadline)
        if pool is not None:
            try:
                answer.pool_tokens = pool.result(timeout=max(deadline - time.monotonic(), 0.0) + 0.05)
            except FutureTimeout:  # it counts its own timeout
                answer.pool_tokens = 0
        return answer

    def _ask_pool(self, req: LookupRequest, deadline: float) -> int:
        """Tokens of the prompt the pool holds for this rank; 0 if it cannot tell (logged and counted)."""
        assert self._in_pool is not None
        start = time.perf_counter()
        self.stats.count("pool_lookups")
        try:
            tokens = self._in_pool(req.token_ids, deadline)
        except (StoreError, TimeoutError) as e:
            self.stats.count("pool_lookup_errors")
            logger.warning("MooncakeConnector: could not ask the KV pool about request %s (%s): not loaded from it",
                           req.req_id, e)
            return 0
        except Exception:
            self.stats.count("pool_lookup_errors")
            logger.exception("MooncakeConnector: the pool lookup of request %s failed unexpectedly", req.req_id)
            return 0
        seconds = time.perf_counter() - start
        self.stats.count("pool_lookup_hits" if tokens else "pool_lookup_misses")
        self.stats.count("pool_hit_tokens", tokens)
        self.stats.sample("pool_lookup_times", tokens, 0, seconds)
        logger.debug("MooncakeConnector: the pool holds %d of the %d tokens of request %s (%.1f ms)", tokens,
                     len(req.token_ids), req.req_id, seconds * 1e3)
        return tokens

    def _ask_producer(self, req: LookupRequest, deadline: float) -> LookupAnswer:
        start = time.perf_counter()
        error = ""
        tokens = 0
        try:
            self._check_up(req)
            tokens = self._look(req, deadline)
        except ProducerDown as e:
            error = str(e)
        except (PipeError, BufferClosed) as e:  # the producer could not be reached (a PipeTimeout too: the link
            # did not come up, or another send on it hung)
            error = f"{type(e).__name__}: {e}"
            self._mark_down(req, error)
        except TimeoutError as e:  # no answer on a link that is up: a busy producer is not backed off
            error = f"{type(e).__name__}: {e}"
        except OSError as e:  # (after TimeoutError, one of them)
            error = f"{type(e).__name__}: {e}"
            self._mark_down(req, error)
        except ValueError as e:  # a malformed answer, or a layout this rank cannot load from
            error = f"{type(e).__name__}: {e}"
        except Exception as e:
            logger.exception("MooncakeConnector: the lookup of request %s failed unexpectedly", req.req_id)
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        self.stats.count("lookups")
        if error:
            self.stats.count("lookup_errors")
            logger.warning("MooncakeConnector: could not look up the KV of request %s (%d tokens) at %s in %.1f ms "
                           "(%s): computing its prompt here", req.req_id, len(req.token_ids),
                           ", ".join(self._producers(req)) or "the push links", seconds * 1e3, error)
        else:
            self.stats.count("lookup_hits" if tokens else "lookup_misses")
            self.stats.count("lookup_hit_tokens", tokens)
            self.stats.sample("lookup_times", tokens, 0, seconds)
            logger.debug("MooncakeConnector: lookup of request %s: %d of %d tokens held (%.1f ms)", req.req_id,
                         tokens, len(req.token_ids), seconds * 1e3)
        return LookupAnswer(req.req_id, req.lease, self.rank, tokens, error)

    def _check_up(self, req: LookupRequest) -> None:
        now = time.monotonic()
        with self._lock:
            down = [(p, until) for p in self._producers(req) if (until := self._down.get(p, 0.0)) > now]
        if down:
            producer, until = down[0]
            raise ProducerDown(f"the producer at {producer} failed to answer a lookup a moment ago; not asked again "
                               f"for {until - now:.1f} s")

    def _mark_down(self, req: LookupRequest, error: str) -> None:
        until = time.monotonic() + self.backoff
        with self._lock:
            for producer in self._producers(req):
                self._down[producer] = until
        logger.info("MooncakeConnector: lookups skip %s for %.1f s (%s)", ", ".join(self._producers(req)), self.backoff,
                    error)

    def collect(self) -> list[LookupAnswer]:
        """The answers of the lookups that ended since the last call."""
        out = []
        for key, future in list(self._running.items()):
            if future.done():
                del self._running[key]
                out.append(future.result())  # _run never raises
        return out

    def pending(self) -> list[Future[LookupAnswer]]:
        return list(self._running.values())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool_asks.shutdown(wait=False, cancel_futures=True)
